"""dflash-prepare: formats, template-aware loss masks (Qwen3- and Llama-3-style templates), the
CLI's outputs, training on a prepared folder, and bad input through a subprocess."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import load_from_disk
from transformers import AutoTokenizer

from conftest import ROOT, TINY_TARGET, run_main
from dflash_train.core.errors import UserError
from dflash_train.cli import prepare as prepare_cli
from dflash_train.data import chat as prepare
from dflash_train.data.chat import Fields, Malformed, normalize
from dflash_train.data.dataset import load_conversations

TINY_DATA = ROOT / "data" / "tiny" / "train.jsonl"

# Written after Qwen3's template: ChatML turns; the last assistant reply after the last user turn
# gets a (possibly empty) <think> block, replies in history lose theirs; enable_thinking=false
# adds an empty think block to the generation prompt.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- "
    "endif %}{%- endfor %}{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + "
    "content.lstrip('\\n') }}{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- "
    "'<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# Written after Llama 3.1's: BOS, a system block that always carries the dates, trimmed contents.
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' + system + '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 12 + 30?"},
                {"role": "assistant", "content": "12 + 30 = 42."},
                {"role": "user", "content": "And 42 + 1? Answer: 43."},
                {"role": "assistant", "content": "43."}]


@pytest.fixture(scope="module")
def qwen3_tok():
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    tok.chat_template = QWEN3_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def llama3_tok():
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    tok.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                   special_tokens=True)
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def supervised_runs(tok, ids, mask) -> list[str]:
    runs, cur = [], []
    for i, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


def encode(tok, messages, max_length=4096, enable_thinking=False):
    eot = prepare.end_of_turn(tok)
    return next(prepare.encode_conversations(tok, [messages], eot, max_length, enable_thinking))


@pytest.mark.parametrize("template, eot", [("qwen3", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_supervised_tokens_are_exactly_the_replies_and_end_of_turn(template, eot, qwen3_tok, llama3_tok):
    tok = {"qwen3": qwen3_tok, "llama3": llama3_tok}[template]
    assert prepare.end_of_turn(tok) == eot
    ids, mask = encode(tok, CONVERSATION)
    # "43." also ends the second user turn: the search starts after it, so only the reply is supervised.
    assert supervised_runs(tok, ids, mask) == ["12 + 30 = 42." + eot, "43." + eot]
    text = tok.decode(ids)
    assert text == prepare.chat_text(tok, CONVERSATION, enable_thinking=False)
    if template == "qwen3":  # the last reply is rendered after an empty think block, which is not supervised
        assert "<|im_start|>assistant\n<think>\n\n</think>\n\n43.<|im_end|>" in text
    else:
        assert text.startswith("<|begin_of_text|><|start_header_id|>system") and "Cutting Knowledge" in text



def test_thinking_replies_keep_their_think_block_only_where_rendered(qwen3_tok):
    messages = [{"role": "user", "content": "Add 2 and 3."},
                {"role": "assistant", "content": "<think>\n2 plus 3\n</think>\n\nIt is 5."},
                {"role": "user", "content": "Add 4 and 4."},
                {"role": "assistant", "content": "<think>\n4 plus 4\n</think>\n\nIt is 8."}]
    ids, mask = encode(qwen3_tok, messages)
    # History drops the think block; the last reply is rendered whole.
    assert supervised_runs(qwen3_tok, ids, mask) == ["It is 5.<|im_end|>",
                                                     "<think>\n4 plus 4\n</think>\n\nIt is 8.<|im_end|>"]


def test_enable_thinking_reaches_the_template(qwen3_tok):
    from dflash_train.data.regenerate import _prompt_ids

    history = [{"role": "user", "content": "Hi"}]
    off = qwen3_tok.decode(_prompt_ids(qwen3_tok, history, enable_thinking=False))
    on = qwen3_tok.decode(_prompt_ids(qwen3_tok, history, enable_thinking=True))
    assert (off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
            and on.endswith("<|im_start|>assistant\n"))


def test_unlocatable_and_straddling_replies_are_dropped(qwen3_tok):
    eot = prepare.end_of_turn(qwen3_tok)
    # A template that rewrites the turns: their contents are nowhere in the text.
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    tok.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content | upper "
                         "+ '<|im_end|>\\n' }}{%- endfor %}")
    convs = [CONVERSATION, [{"role": "user", "content": "Hi"}], [{"role": "assistant", "content": ""}]]
    assert list(prepare.encode_conversations(tok, convs, eot, 512, False)) == [
        "turn_not_located", "no_assistant_turn", "no_assistant_turn"]
    # A token that crosses the start of a reply (header and reply share a token) -> dropped.
    assert prepare.mask_from_offsets([(0, 3), (3, 6), (6, 8)], [(4, 8)]) is None
    assert prepare.mask_from_offsets([(0, 3), (3, 6), (6, 8)], [(3, 8)]) == [0, 1, 1]


def test_formats_normalise_to_openai_messages():
    want = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}]
    fields = {f: Fields(*prepare.FORMATS[f], prepare.ROLE_NAMES) for f in prepare.FORMATS}
    share = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "U"},
                               {"from": "gpt", "value": "A"}]}
    assert normalize(share, "sharegpt", fields["sharegpt"]) == want
    assert normalize({"messages": want, "id": 3}, "messages", fields["messages"]) == want
    assert normalize({"messages": want}, "ultrachat", fields["ultrachat"]) == want
    assert normalize({"data": ["U", "A", "U2"]}, "ultrachat", fields["ultrachat"]) == want[1:] + [
        {"role": "user", "content": "U2"}]
    assert normalize({"messages": want, "reasoning": "off"}, "nemotron", fields["nemotron"]) == want
    old = {"input": [{"role": "user", "content": "U"}], "output": "A", "system_prompt": "S",
           "reasoning": "off"}
    assert normalize(old, "nemotron", fields["nemotron"]) == want
    assert normalize({"input": "U", "output": "A"}, "nemotron", fields["nemotron"]) == want[1:]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "U"}]}]}
    assert normalize(parts, "messages", fields["messages"]) == [want[1]]
    # Configurable names and roles.
    custom = Fields("turns", "speaker", "text", prepare.ROLE_NAMES | {"bot": "assistant", "person": "user"})
    row = {"turns": [{"speaker": "person", "text": "U"}, {"speaker": "bot", "text": "A"}]}
    assert normalize(row, "messages", custom) == want[1:]
    for bad in [{"messages": "x"}, {"messages": [{"role": "tool", "content": "x"}]},
                {"messages": [{"role": "user", "content": None}]}, {"conversation": []}, {"messages": [3]}]:
        with pytest.raises(Malformed):
            normalize(bad, "messages", fields["messages"])


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def tiny_rows(n: int) -> list[dict]:
    return [json.loads(line) for line in TINY_DATA.read_text().splitlines()[:n]]


def test_prepare_writes_splits_info_and_trains(tmp_path, tiny_target):
    no_answer = {"messages": [{"role": "user", "content": "no answer"}]}
    src = write_jsonl(tmp_path / "in.jsonl", tiny_rows(40) + ["{not json", no_answer])
    out = tmp_path / "prep"
    args = ["--input", str(src), "--format", "messages", "--target", str(TINY_TARGET),
            "--min-supervised-tokens", "12"]
    prepare_cli.main(args + ["--output", str(out), "--val-size", "8", "--shuffle", "--seed", "3"])
    info = json.loads((out / "prepare_info.json").read_text())
    c = info["counts"]
    assert c["read"] == 42 and c["malformed"] == 1 and c["dropped"]["no_assistant_turn"] == 1
    assert c["kept"] + sum(c["dropped"].values()) + c["malformed"] == c["read"]
    assert (info["splits"] == {"train": c["kept"] - 8,
                               "val": 8} and info["malformed_examples"][0].startswith("row 41:"))
    assert (info["template"] == {"sha256": prepare.template_sha256(tiny_target.tokenizer),
                                 "end_of_turn": "<|im_end|>"})
    assert info["enable_thinking"] is False and info["target"]["name_or_path"] == str(TINY_TARGET)
    train, val = load_from_disk(str(out / "train")), load_from_disk(str(out / "val"))
    assert train.column_names == ["input_ids", "loss_mask"] and len(train) + len(val) == c["kept"]
    assert all(sum(m) >= 12 for m in train["loss_mask"])

    # Deterministic: the same seed gives the same rows; without --shuffle and split, input order.
    prepare_cli.main(args + ["--output", str(tmp_path / "again"), "--val-size", "8", "--shuffle", "--seed",
                             "3"])
    assert load_from_disk(str(tmp_path / "again" / "val"))["input_ids"] == val["input_ids"]
    prepare_cli.main(args + ["--output", str(tmp_path / "plain"), "--max-length", "40"])
    plain = load_from_disk(str(tmp_path / "plain"))
    eot = prepare.end_of_turn(tiny_target.tokenizer)
    convs = [r["messages"] for r in tiny_rows(40)]
    expect = [r for r in prepare.encode_conversations(tiny_target.tokenizer, convs, eot, 40, False)
              if not isinstance(r, str) and sum(r[1]) >= 12]
    assert plain["input_ids"] == [r[0] for r in expect] and max(len(x) for x in plain["input_ids"]) == 40

    # Training reads the prepared folders (same rows as load_conversations on the jsonl would give).
    assert load_conversations(str(out / "val"), tiny_target.tokenizer, 256)["input_ids"] == val["input_ids"]
    from dflash_train.cli.train import main as train_main

    run = tmp_path / "run"
    train_main([f"output_dir={run}", f"data.train={out}/train", f"data.val={out}/val", "max_steps=2",
                "train.batch_size=4", "model.num_layers=1", "data.num_anchors=4", "eval.max_samples=4"])
    assert json.loads((run / "summary.json").read_text())["steps"] == 2


def test_prepared_folder_for_another_template_is_refused(tmp_path, qwen3_tok):
    out = tmp_path / "prep"
    src = write_jsonl(tmp_path / "in.jsonl", tiny_rows(6))
    prepare_cli.main(["--input", str(src), "--format", "messages", "--target", str(TINY_TARGET), "--output",
                      str(out),
                  "--min-supervised-tokens", "2"])
    with pytest.raises(UserError, match="another chat template"):
        load_conversations(str(out), qwen3_tok, 256)
    with pytest.raises(UserError, match="holds the splits|no dataset"):
        load_conversations(str(tmp_path), qwen3_tok, 256)


def test_prepared_folder_for_another_tokenizer_or_a_damaged_info_is_refused(tmp_path, tiny_target):
    """The same template over other ids is refused; a cut or edited prepare_info.json is one line."""
    out = tmp_path / "prep"
    src = write_jsonl(tmp_path / "in.jsonl", tiny_rows(6))
    prepare_cli.main(["--input", str(src), "--format", "messages", "--target", str(TINY_TARGET), "--output",
                      str(out), "--min-supervised-tokens", "2"])
    load_conversations(str(out), tiny_target.tokenizer, 256)  # its own tokenizer reads it
    info = out / "prepare_info.json"
    good = json.loads(info.read_text())
    info.write_text(json.dumps(good | {"tokenizer": {"sha256": "0" * 64}}))
    with pytest.raises(UserError, match="another tokenizer"):
        load_conversations(str(out), tiny_target.tokenizer, 256)
    for damaged in ['{"template": ', '["a list"]', json.dumps(good | {"template": None})]:
        info.write_text(damaged)
        with pytest.raises(UserError, match="prepare_info.json is damaged"):
            load_conversations(str(out), tiny_target.tokenizer, 256)


def run_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "dflash_train.cli.prepare", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def no_template_target(tmp_path) -> Path:
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "plain-target")
    return tmp_path / "plain-target"


BAD_INPUTS = {  # case -> (how to make the input, expected error fragment)
    "missing": (lambda d: d / "none.jsonl", "not found"),
    "empty": (lambda d: write_jsonl(d / "e.jsonl", []), "is empty"),
    "not_json": (lambda d: write_jsonl(d / "t.jsonl", ["hello", "world"]), "is not JSON lines"),
    "binary": (lambda d: (d / "b.jsonl").write_bytes(bytes(range(256)) * 4) and d / "b.jsonl", "binary"),
    "no_assistant": (lambda d: write_jsonl(d / "q.jsonl",
                                           [{"messages": [{"role": "user", "content": "hi"}]}] * 3),
                     "no usable conversation"),
    "hub_offline": (lambda d: "someone/not-a-dataset", "cannot load dataset 'someone/not-a-dataset'"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS) + ["no_chat_template", "strict", "vllm_missing"])
def test_bad_input_is_one_error_line(case, tmp_path):
    """One `error:` line, exit 2, nothing written. The first case runs the real command line
    (interpreter, entry point); the rest call main in-process, which is the same code under cli_guard."""
    target, extra = TINY_TARGET, []
    if case in BAD_INPUTS:
        make, expected = BAD_INPUTS[case]
        src = make(tmp_path)
    else:
        src = write_jsonl(tmp_path / "ok.jsonl", tiny_rows(3) + ["{broken"])
        if case == "no_chat_template":
            target, expected = no_template_target(tmp_path), "has no chat template"
        elif case == "strict":
            extra, expected = ["--strict"], "row 4 of"
        else:
            extra, expected = ["--regenerate", "--backend", "vllm"], "needs the 'vllm' package"
    out = tmp_path / "out"
    args = ["--input", src, "--format", "messages", "--target", target, "--output", out, *extra]
    if case == "missing":
        r = run_cli(*args)
        code, stderr = r.returncode, r.stderr
    else:
        code, _, stderr = run_main(prepare_cli.main, args)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in stderr, stderr[-2000:]
    assert len(errors) == 1 and expected in errors[0], stderr[-2000:]
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
