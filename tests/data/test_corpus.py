"""The committed corpus: published from the work folder's finished prefix, seeded back from the commit on a
fresh clone, read by dflash-prepare --format messages as it is (gzip)."""

import gzip
import json
import shutil

import pytest
from datasets import load_from_disk

from conftest import ROOT, TINY_TARGET, error_line, run_main
from dflash_train.cli import corpus as corpus_cli
from dflash_train.cli import prepare
from dflash_train.data import corpus
from dflash_train.data import regenerate as regen

COMMITTED = ROOT / "data" / "smollm2-135m-corpus"


def fake_work(work):
    """Four finished prompts, out of order, one dropped, and a line cut by an interruption."""
    rows = [{"i": 0, "key": "k0", "messages": [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Hello."}], "tokens": 3},
            {"i": 2, "key": "k2", "dropped": "empty_generation", "tokens": 0},
            {"i": 1, "key": "k1", "messages": [{"role": "user", "content": "2+2?"},
                                               {"role": "assistant", "content": "4", "truncated": True}],
             "tokens": 1},
            {"i": 4, "key": "k4", "messages": [{"role": "user", "content": "later"},
                                               {"role": "assistant", "content": "x"}], "tokens": 1}]
    work.mkdir(parents=True)
    (work / regen.SETTINGS_FILE).write_text(json.dumps({"temperature": 0.0}) + "\n")
    (work / regen.DONE_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"i": 3, "ke')
    return rows


def test_publish_writes_the_finished_prefix_and_a_fresh_clone_seeds_it_back(tmp_path):
    out = tmp_path / "corpus"
    out.mkdir()
    rows = fake_work(out / ".work")
    info = corpus.publish(out, out / ".work", {"generation": {"temperature": 0.0}})
    # prompt 3's line was cut, so prompt 4 (finished out of order) waits: the corpus is prompts 0-2
    assert (info["prompts_answered"], info["conversations"], info["answer_tokens"]) == (3, 2, 4)
    assert info["dropped_rows"] == {"2": {"key": "k2", "reason": "empty_generation", "tokens": 0}}
    assert info["truncated_answers"] == 1
    published = [json.loads(line) for line in gzip.open(out / corpus.CONVERSATIONS, "rt")]
    assert [r["i"] for r in published] == [0, 1] and published[1]["messages"] == rows[2]["messages"]
    assert json.loads((out / corpus.INFO).read_text()) == info

    shutil.rmtree(out / ".work")  # a fresh clone: the committed files only
    corpus.seed_work(out, out / ".work")
    seeded = [json.loads(line) for line in (out / ".work" / regen.DONE_FILE).read_text().splitlines()]
    assert seeded == [rows[0], rows[2], rows[1]]  # by index: 0, 1, 2 (the dropped row included)
    assert json.loads((out / ".work" / regen.SETTINGS_FILE).read_text()) == {"temperature": 0.0}
    corpus.seed_work(out, out / ".work")  # a work folder in place is never replaced
    assert len((out / ".work" / regen.DONE_FILE).read_text().splitlines()) == 3


def test_publishing_the_same_rows_gives_the_same_bytes(tmp_path, monkeypatch):
    """The gzip header holds no file name or time: another folder, another clock, the same bytes."""
    import time

    written = []
    for name, clock in [("a", 1.0e9), ("b", 2.0e9)]:
        monkeypatch.setattr(time, "time", lambda clock=clock: clock)
        out = tmp_path / name
        out.mkdir()
        fake_work(out / ".work")
        corpus.publish(out, out / ".work", {"generation": {"temperature": 0.0}})
        written.append((out / corpus.CONVERSATIONS).read_bytes())
    assert written[0] == written[1] and gzip.decompress(written[0]).count(b"\n") == 2


def test_a_folder_that_is_not_a_corpus_is_refused_untouched(tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    code, _, err = run_main(corpus_cli.main, ["--real", str(ROOT / "data"), "--output", str(out)])
    assert code == 2 and "make real-target" in err  # the missing target is named first
    real = tmp_path / "real"
    shutil.copytree(TINY_TARGET, real / corpus.MODEL_DIR)
    (real / "prompts").mkdir()
    (real / "prompts" / "sharegpt.jsonl").write_text('{"messages": [{"role": "user", "content": "Hi"}]}\n')
    code, _, err = run_main(corpus_cli.main, ["--real", str(real), "--output", str(out)])
    assert code == 2 and "is not a corpus folder" in err
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


def test_the_gzipped_corpus_trains_through_dflash_prepare(tmp_path):
    """The committed file itself when present (else a published fake): rows carry i/key/tokens beside
    their messages, and --format messages reads them as conversations."""
    src = COMMITTED / corpus.CONVERSATIONS
    rows = [json.loads(line) for line in gzip.open(src, "rt")][:6] if src.is_file() else []
    if len(rows) < 2:
        out = tmp_path / "corpus"
        out.mkdir()
        fake_work(out / ".work")
        corpus.publish(out, out / ".work", {})
        rows = [json.loads(line) for line in gzip.open(out / corpus.CONVERSATIONS, "rt")]
    small = tmp_path / "small.jsonl.gz"
    with gzip.open(small, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    code, _, err = run_main(prepare.main, ["--input", str(small), "--format", "messages", "--target",
                                           str(TINY_TARGET), "--output", str(tmp_path / "prepared"),
                                           "--val-size", "1", "--min-supervised-tokens", "1"])
    assert code == 0, err
    sizes = [len(load_from_disk(str(tmp_path / "prepared" / split))) for split in ("train", "val")]
    assert sizes == [len(rows) - 1, 1]


def test_a_damaged_gzip_input_is_one_line(tmp_path):
    bad = tmp_path / "cut.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write('{"messages": []}\n' * 2000)
    bad.write_bytes(bad.read_bytes()[:40])
    code, _, err = run_main(prepare.main, ["--input", str(bad), "--format", "messages", "--target",
                                           str(TINY_TARGET), "--output", str(tmp_path / "p")])
    assert code == 2 and "cannot be read" in err and not (tmp_path / "p").exists()


# --- the builder itself on the tiny target (issue 42) ---------------------------------------------
QUESTIONS = ["Hi", "What is 2+2?", "Name a colour.", "Say yes.", "Count to three.", "Who are you?"]
SMALL = ["--conversations", "4", "--chunk", "2", "--slots", "2", "--max-new-tokens", "4",
         "--max-prompt-tokens", "64"]


def fake_real(folder):
    """make real-target's layout with the tiny target as 'SmolLM2' and six ShareGPT prompts."""
    shutil.copytree(TINY_TARGET, folder / corpus.MODEL_DIR)
    (folder / "prompts").mkdir()
    (folder / "prompts" / "sharegpt.jsonl").write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in QUESTIONS))
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A corpus of 4 prompts built in chunks of 2, and make real-target's folder it came from."""
    d = tmp_path_factory.mktemp("corpus")
    real = fake_real(d / "real")
    code, out, err = run_main(corpus_cli.main, ["--real", real, "--output", d / "built", *SMALL])
    assert code == 0 and "holds 4 conversations" in out, err[-2000:]
    return real, d / "built"


def clone(built, tmp_path, work=False):
    """The built corpus as committed (no .work: a fresh clone), or with its work folder."""
    out = tmp_path / "corpus"
    shutil.copytree(built[1], out, ignore=None if work else shutil.ignore_patterns(".work"))
    return out


def files(out):
    return {name: (out / name).read_bytes() for name in (corpus.CONVERSATIONS, corpus.INFO)}


@pytest.mark.parametrize("work", [False, True])
def test_a_rerun_with_nothing_to_do_writes_nothing(built, tmp_path, work):
    """The same command again, on a fresh clone or beside its work folder: the gzip's bytes (its header
    carries a timestamp) and info.json (speed, engine) were rewritten with this run's, wrongly."""
    out = clone(built, tmp_path, work)
    before = files(out)
    code, stdout, err = run_main(corpus_cli.main,
                                 ["--real", built[0], "--output", out, *SMALL, "--slots", "3"])
    assert code == 0 and "nothing to do, nothing written" in stdout, err[-2000:]
    assert files(out) == before


def test_growing_appends_and_records_the_run(built, tmp_path):
    out = clone(built, tmp_path)
    code, _, err = run_main(corpus_cli.main,
                            ["--real", built[0], "--output", out, *SMALL, "--conversations", "6"])
    assert code == 0, err[-2000:]
    info = json.loads((out / corpus.INFO).read_text())
    rows = [json.loads(line) for line in gzip.open(out / corpus.CONVERSATIONS, "rt")]
    old = [json.loads(line) for line in gzip.open(built[1] / corpus.CONVERSATIONS, "rt")]
    assert info["prompts_answered"] == 6 and rows[:len(old)] == old


@pytest.mark.parametrize("extra, says", [
    (["--chunk", "3"], "was built with --chunk 2 (this run: --chunk 3): rerun with --chunk 2 to extend it"),
    (["--max-new-tokens", "5", "--max-prompt-tokens", "60"],
     "was built with --max-new-tokens 4 --max-prompt-tokens 64 (this run: --max-new-tokens 5 "
     "--max-prompt-tokens 60)"),
    (["--conversations", "3"], "already holds 4 answered prompts and is never cut: "
                               "--conversations 3 asks for fewer; ask for 4 or more to grow it"),
])
def test_other_flags_or_fewer_conversations_name_what_to_type(built, tmp_path, extra, says):
    """'other settings (batch_size: 128 != 96)' named no flag (it is --chunk), and asking for fewer
    prompts than the corpus holds said 'other input'."""
    out = clone(built, tmp_path)
    before = files(out)
    code, _, err = run_main(corpus_cli.main, ["--real", built[0], "--output", out, *SMALL, *extra])
    assert code == 2 and says in error_line(err)
    assert files(out) == before


@pytest.mark.parametrize("damage", ["gzip_cut", "not_gzip", "row_not_an_object", "info_cut",
                                    "info_no_generation", "dropped_rows_a_list", "gzip_missing"])
def test_a_damaged_corpus_on_a_fresh_clone_is_one_line(built, tmp_path, damage):
    out = clone(built, tmp_path)
    gz, info = out / corpus.CONVERSATIONS, out / corpus.INFO
    record = json.loads(info.read_text())
    if damage == "gzip_cut":
        gz.write_bytes(gz.read_bytes()[:30])
    if damage == "not_gzip":
        gz.write_text("not gzip")
    if damage == "row_not_an_object":
        with gzip.open(gz, "wt") as f:
            f.write("[1, 2]\n")
    if damage == "gzip_missing":
        gz.unlink()
    if damage == "info_cut":
        info.write_text(info.read_text()[:50])
    if damage == "info_no_generation":
        info.write_text(json.dumps({k: v for k, v in record.items() if k != "generation"}))
    if damage == "dropped_rows_a_list":
        info.write_text(json.dumps(record | {"dropped_rows": [1]}))
    before = sorted(p.name for p in out.iterdir())
    code, _, err = run_main(corpus_cli.main, ["--real", built[0], "--output", out, *SMALL])
    assert code == 2 and f"the corpus in '{out}' is damaged (" in error_line(err)
    assert sorted(p.name for p in out.iterdir()) == before  # no work folder seeded from it


@pytest.mark.parametrize("where, says", [("", "is a file, not a folder"), ("sub", "cannot be created: '")])
def test_an_output_naming_a_file_is_one_line(built, tmp_path, where, says):
    (tmp_path / "f").write_text("mine")
    code, _, err = run_main(corpus_cli.main, ["--real", built[0], "--output", tmp_path / "f" / where, *SMALL])
    assert code == 2 and says in error_line(err) and (tmp_path / "f").read_text() == "mine"
