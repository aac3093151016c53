"""evaluation/run.py, the parts before the target loads: the device asked for and the suites read
(the eval end to end, through `evaluate`: test_eval.py)."""

import json

import pytest
import torch

from dflash_train.core.errors import UserError
from dflash_train.evaluation.run import read_suites, resolve_device
from dflash_train.evaluation.suites import DEFAULT_SUITE, load_suite


def messages_file(path, questions):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": "ok"}]}) + "\n"
                            for q in questions))
    return str(path)


def test_suites_keep_their_order_and_limit_and_default_to_the_bundled_one(tmp_path):
    a = messages_file(tmp_path / "a.jsonl", ["one?", "two?", "three?"])
    b = messages_file(tmp_path / "b.jsonl", ["four?"])
    suites = read_suites([b, a], limit=2)
    assert [(name, [p.turns for p in prompts]) for name, prompts in suites] == [
        ("b", [["four?"]]), ("a", [["one?"], ["two?"]])]
    assert read_suites(None, 3) == [load_suite(DEFAULT_SUITE, 3)]


def test_two_suites_of_one_name_are_refused_naming_both(tmp_path):
    first = messages_file(tmp_path / "x" / "same.jsonl", ["one?"])
    second = messages_file(tmp_path / "y" / "same.jsonl", ["two?"])
    with pytest.raises(UserError, match="are both named 'same'") as e:
        read_suites([first, second], None)
    assert first in str(e.value) and second in str(e.value)


def test_the_device_is_one_this_torch_runs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    for text, message in [("bogus", "is not a device"), ("mps", "is not supported")]:
        with pytest.raises(UserError, match=message):
            resolve_device(text)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(UserError, match="torch sees no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(UserError, match="only 2 CUDA device"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(UserError, match="has no CUDA support"):
        resolve_device("cuda")
