"""Bad inputs to dflash-prepare --regenerate (issue 30): its work folder OUT.work is marked as ours
(core/outputs.py's marker, kind "regenerate") and checked before anything is read, written or
deleted. A folder there that we did not write (a user's notes, the --input itself), a file there, a
damaged settings.json or done.jsonl: one `error:` line, exit 2, nothing deleted. An interrupted
regeneration says how to continue, and the rerun resumes."""

import json

import pytest

from conftest import ROOT, TINY_TARGET
from dflash_train.cli import prepare
from dflash_train.core.outputs import MARKER
from dflash_train.data import regenerate as regen
from dflash_train.data.prepare import fit_positions
from helpers.prepare_cli import argv, refused, rows


pytestmark = pytest.mark.usefixtures("one_thread")


def tree(folder):
    return sorted((p.relative_to(folder), p.read_bytes() if p.is_file() else None) for p in folder.rglob("*"))


def test_a_work_folder_we_did_not_write_is_refused_and_kept(tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "out.work"
    work.mkdir()
    (work / "notes.txt").write_text("my notes")
    src = rows(tmp_path / "in.jsonl")
    line = refused(capsys, argv(src, out))
    assert (f"the regeneration work folder '{work}' is not empty and was not written by" in line
            and MARKER in line)
    assert (work / "notes.txt").read_text() == "my notes" and not out.exists()
    # an output folder of another kind there is no work folder either
    (work / "notes.txt").unlink()
    (work / MARKER).write_text(json.dumps({"tool": "dflash-train", "kind": "cache"}))
    assert "holds a hidden-state cache" in refused(capsys, argv(src, out))


@pytest.mark.parametrize("marked", [False, True])
def test_an_input_inside_the_work_folder_is_refused_and_kept(tmp_path, capsys, marked):
    """Even a work folder of ours is refused when it holds the input: finishing would delete it."""
    out, work = tmp_path / "out", tmp_path / "out.work"
    work.mkdir()
    if marked:
        (work / MARKER).write_text(json.dumps({"tool": "dflash-train", "kind": "regenerate"}))
    src = rows(work / "in.jsonl")
    before = tree(work)
    line = refused(capsys, argv(src, out))
    assert f"the regeneration work folder '{work}' holds the --input" in line
    assert tree(work) == before and not out.exists()


def test_a_file_at_the_work_path_is_refused(tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "out.work"
    work.write_text("not a folder")
    line = refused(capsys, argv(rows(tmp_path / "in.jsonl"), out))
    assert f"the regeneration work folder '{work}' is a file, not a folder" in line
    assert work.read_text() == "not a folder" and not out.exists()


def test_without_regenerate_the_work_path_is_not_touched(tmp_path):
    out, work = tmp_path / "out", tmp_path / "out.work"
    work.mkdir()
    (work / "notes.txt").write_text("my notes")
    prepare.main(["--input", str(rows(tmp_path / "in.jsonl")), "--format", "messages", "--target",
                  str(TINY_TARGET), "--output", str(out), "--min-supervised-tokens", "1"])
    assert (out / "prepare_info.json").is_file() and (work / "notes.txt").read_text() == "my notes"


def interrupt_second_chunk(monkeypatch):
    chunk = regen.regenerate_chunk
    calls = []

    def flaky(convs, tokenizer, generate, s, start):
        calls.append(start)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return chunk(convs, tokenizer, generate, s, start)

    monkeypatch.setattr(regen, "regenerate_chunk", flaky)
    return calls


def test_interrupted_regeneration_says_how_to_continue_and_resumes(tmp_path, capsys, monkeypatch):
    out, work = tmp_path / "out", tmp_path / "out.work"
    src = rows(tmp_path / "in.jsonl")
    calls = interrupt_second_chunk(monkeypatch)
    with pytest.raises(SystemExit) as e:
        prepare.main(argv(src, out))
    assert e.value.code == 130
    err = capsys.readouterr().err
    assert "interrupted with 2 of 4 conversations regenerated" in err
    assert "rerun the same command to resume" in err and "Traceback" not in err
    assert json.loads((work / MARKER).read_text())["kind"] == "regenerate" and not out.exists()
    assert json.loads((work / regen.SETTINGS_FILE).read_text())["seed"] == 0
    assert not list(work.glob(".*.part"))  # settings.json is written beside and renamed
    calls.clear()
    prepare.main(argv(src, out))
    assert calls == [2]  # only the second chunk is answered again
    info = json.loads((out / "prepare_info.json").read_text())
    assert info["regeneration"]["stats"]["resumed"] == 2 and not work.exists()


def damaged_work(tmp_path, monkeypatch, edit):
    """An interrupted run's work folder (first chunk done), then edit(work)."""
    out, work = tmp_path / "out", tmp_path / "out.work"
    src = rows(tmp_path / "in.jsonl")
    interrupt_second_chunk(monkeypatch)
    with pytest.raises(SystemExit):
        prepare.main(argv(src, out))
    edit(work)
    return src, out, work


def test_a_cut_settings_file_is_one_line(tmp_path, capsys, monkeypatch):
    cut = lambda w: (w / regen.SETTINGS_FILE).write_text((w / regen.SETTINGS_FILE).read_text()[:40])  # noqa: E731
    src, out, work = damaged_work(tmp_path, monkeypatch, cut)
    capsys.readouterr()
    before = tree(work)
    line = refused(capsys, argv(src, out))
    assert f"the regeneration work folder '{work}' is damaged (settings.json does not parse" in line
    assert tree(work) == before and not out.exists()


@pytest.mark.parametrize("drop", ["key", "i", "tokens"])
def test_a_done_line_without_its_key_is_one_line(tmp_path, capsys, monkeypatch, drop):
    def edit(work):
        lines = (work / regen.DONE_FILE).read_text().splitlines()
        row = json.loads(lines[1])
        del row[drop]
        (work / regen.DONE_FILE).write_text("\n".join([lines[0], json.dumps(row)]) + "\n")

    src, out, work = damaged_work(tmp_path, monkeypatch, edit)
    capsys.readouterr()
    before = tree(work)
    line = refused(capsys, argv(src, out))
    assert f"is damaged (done.jsonl line 2 has no valid '{drop}')" in line
    assert tree(work) == before and not out.exists()


def test_a_line_cut_by_an_interruption_is_answered_again(tmp_path, capsys, monkeypatch):
    """A last line cut mid-way is answered again, and stays alone on its line: the next run's rows
    are not glued to it (they would be lost to the run after)."""
    def cut(work):
        text = (work / regen.DONE_FILE).read_text()
        (work / regen.DONE_FILE).write_text(text[:-20])

    src, out, work = damaged_work(tmp_path, monkeypatch, cut)
    interrupt_second_chunk(monkeypatch)  # the rerun answers chunk 0 again (row 1 was cut), stops at chunk 2
    with pytest.raises(SystemExit):
        prepare.main(argv(src, out))
    parsed = []
    for line in (work / regen.DONE_FILE).read_text().splitlines():
        try:
            parsed.append(json.loads(line)["i"])
        except json.JSONDecodeError:
            parsed.append("cut")
    assert parsed == [0, "cut", 1] and regen.conversations_done(work) == 2
    monkeypatch.undo()
    prepare.main(argv(src, out))
    info = json.loads((out / "prepare_info.json").read_text())
    assert info["regeneration"]["stats"]["resumed"] == 2 and info["counts"]["read"] == 4


# --- default lengths; the target's dtype in the resume key (issue 30; bounds: test_prepare_cli.py) --
def test_default_lengths_are_lowered_to_the_targets_positions(tmp_path):
    """--max-length (3072) and --max-new-tokens (2048) by default: the tiny target has 512 positions."""
    out = tmp_path / "out"
    given = ["--input", str(rows(tmp_path / "in.jsonl")), "--format", "messages", "--target", TINY_TARGET]
    prepare.main([*map(str, given), "--output", str(out), "--min-supervised-tokens", "1"])
    assert json.loads((out / "prepare_info.json").read_text())["max_length"] == 512
    settings = fit_positions(prepare.parse_args([*map(str, given), "--output", "o"]))
    assert (settings.max_length, settings.max_new_tokens) == (512, 512)


def test_the_targets_dtype_is_recorded_and_part_of_the_resume_key(tmp_path, capsys, monkeypatch):
    # interrupted, in fp32 (auto on a CPU)
    src, out, work = damaged_work(tmp_path, monkeypatch, lambda w: None)
    assert json.loads((work / regen.SETTINGS_FILE).read_text())["target_dtype"] == "fp32"
    capsys.readouterr()
    monkeypatch.undo()
    before = tree(work)
    line = refused(capsys, argv(src, out, "--target-dtype", "bf16"))
    assert "holds answers made with other settings (target_dtype: 'fp32' != 'bf16')" in line
    assert tree(work) == before and not out.exists()
    prepare.main(argv(src, out, "--target-dtype", "fp32"))
    info = json.loads((out / "prepare_info.json").read_text())
    assert info["regeneration"]["target_dtype"] == "fp32" and info["regeneration"]["stats"]["resumed"] == 2


def test_output_dot_in_an_empty_folder_is_written_there(tmp_path, monkeypatch):
    """`--output .`: Path('.').with_name raised after the work was done (issue 30)."""
    here = tmp_path / "here"
    here.mkdir()
    src = rows(tmp_path / "in.jsonl")
    monkeypatch.chdir(here)
    prepare.main(argv(src, ".") + ["--val-size", "1"])
    assert json.loads((here / "prepare_info.json").read_text())["splits"] == {"train": 3, "val": 1}
    # no work folder or sibling left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "in.jsonl"]


def test_a_data_folder_as_target_is_named_in_one_line(tmp_path, capsys):
    line = refused(capsys, ["--input", str(rows(tmp_path / "in.jsonl")), "--format", "messages", "--target",
                            str(ROOT / "data" / "tiny"), "--output", str(tmp_path / "out")])
    assert "is not a model folder: it has no config.json and no tokenizer" in line
    assert not (tmp_path / "out").exists()
