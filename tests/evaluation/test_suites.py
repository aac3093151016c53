"""Suites: the bundled one, and local files in each Hub set's schema read through the same spec."""

import json

import pytest

from dflash_train.core.errors import UserError
from dflash_train.evaluation.suites import load_suite, suite_definitions

# One row per protocol set, in that dataset's own schema (extra columns included).
ROWS = {
    "gsm8k-hub": {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "7"},
    "math500": {"problem": "Compute $1+1$.", "solution": "2", "answer": "2", "subject": "x", "level": 1,
                "unique_id": "a"},
    "humaneval-hub": {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "canonical_solution": "",
                      "test": "",
                  "entry_point": "add"},
    "mbpp": {"task_id": 2, "prompt": "Write a function to add two numbers.", "code": "", "test_list": []},
    "mt-bench": {"prompt": ["Write a haiku about rain.", "Now make it about snow."], "category": "writing",
                 "prompt_id": 1},
    "alpaca": {"instruction": "Summarise the text.", "input": "Cats sleep a lot.", "output": "..."},
}


def test_every_protocol_suite_is_defined():
    defs = suite_definitions()
    assert set(ROWS) | {"tinychat"} <= set(defs)
    for name in ROWS:
        assert {"dataset", "split", "field", "samples"} <= set(defs[name])


@pytest.mark.parametrize("name", sorted(ROWS))
def test_local_file_in_the_sets_schema(tmp_path, name):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(json.dumps(ROWS[name]) for _ in range(3)) + "\n")
    suite, prompts = load_suite(f"{name}={path}", limit=2)
    assert suite == name and len(prompts) == 2
    p = prompts[0]
    if name == "mt-bench":
        assert p.turns == ROWS[name]["prompt"]
    elif name == "alpaca":
        assert p.turns == ["Summarise the text.\n\nCats sleep a lot."]
    else:
        field = suite_definitions()[name]["field"]
        assert p.turns == [ROWS[name][field]]


def test_bundled_suite_keeps_system_and_user_turns():
    name, prompts = load_suite("tinychat")
    assert name == "tinychat" and len(prompts) == 32
    assert any(p.system for p in prompts) and any(len(p.turns) > 1 for p in prompts)


def test_bad_suites(tmp_path):
    with pytest.raises(UserError, match="unknown suite 'nope'"):
        load_suite("nope")
    with pytest.raises(UserError, match="not found"):
        load_suite(f"gsm8k-hub={tmp_path / 'missing.jsonl'}")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(UserError, match="no field 'question'"):
        load_suite(f"gsm8k-hub={wrong}")


def test_offline_real_target_suites_read_the_fetched_files(tmp_path, monkeypatch):
    """mtbench / gsm8k / humaneval name the files `make real-target` writes (messages rows): both
    MT-Bench turns are user turns (the target writes the first answer during evaluation)."""
    import dflash_train.evaluation.suites as suites

    defs = suite_definitions()
    for name in ("mtbench", "gsm8k", "humaneval"):
        assert defs[name]["file"] == f"data/real/prompts/{name}.jsonl"
    root = tmp_path / "checkout"
    (root / "eval").mkdir(parents=True)
    (root / "eval" / "suites.yaml").write_text(suites.SUITES_FILE.read_text())
    (root / "data" / "real" / "prompts").mkdir(parents=True)
    rows = [{"messages": [{"role": "user", "content": "Write a haiku."},
                          {"role": "user", "content": "Now shorter."}]}]
    (root / "data" / "real" / "prompts" / "mtbench.jsonl").write_text("".join(json.dumps(r)
                                                                              + "\n" for r in rows))
    monkeypatch.setattr(suites, "SUITES_FILE", root / "eval" / "suites.yaml")
    name, prompts = load_suite("mtbench")
    assert name == "mtbench" and prompts[0].turns == ["Write a haiku.", "Now shorter."]
    with pytest.raises(UserError, match="not found"):
        load_suite("gsm8k")  # not fetched
