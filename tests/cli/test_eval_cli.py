"""dflash-eval's command line, cli/eval.py: each flag it checks is one line and exit 2 before the drafter
or target loads (the eval end to end: tests/evaluation/test_eval.py)."""

import json

import torch

from conftest import run_main
from dflash_train.cli.eval import main


def test_cheap_inputs_are_checked_before_any_loading(tmp_path, trained_drafter_dir):
    """Each bad flag is one line and exit 2, named before the (missing) drafter or target is
    touched: the drafter and target given here do not exist, so reaching them would say so."""
    nope = ["--drafter", str(tmp_path / "no-drafter"), "--target", str(tmp_path / "no-target")]
    bad_costs = tmp_path / "costs.json"
    bad_costs.write_text(json.dumps({"verify_ms_by_width": {"1": "fast"}, "draft_ms": 1.0}))
    for folder in ("a", "b"):  # two suite files with one stem
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "x.jsonl").write_text('{"messages": [{"role": "user", "content": "Hi"}]}\n')
    same_stem = [str(tmp_path / "a" / "x.jsonl"), str(tmp_path / "b" / "x.jsonl")]
    cases = [
        (["--suite", same_stem[0], "--suite", same_stem[1]], "are both named 'x'"),
        (["--suite", same_stem[0], "--suite", same_stem[0]], "are both named 'x'"),
        (["--temperature", "nan"], "--temperature must be a finite number"),
        (["--temperature=-1"], "--temperature must be a finite number"),
        (["--device", "bogus"], "--device 'bogus' is not a device"),
        (["--device", "mps"], "--device 'mps' is not supported"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--max-new-tokens", "1"], "--max-new-tokens must be >= 2"),
        (["--repeats", "0"], "--repeats must be in 1..100"),
        (["--concurrency", "0,4"], "--concurrency must be integers >= 1"),
        (["--concurrency", "4,x"], "--concurrency must be comma-separated integers"),
        (["--budgets=-1,4"], "--budgets must be non-negative"),
        (["--verify-times", str(bad_costs)], "is not a costs JSON"),
        (["--verify-times", str(tmp_path / "missing.json")], "is not a costs JSON"),
        (["--suite", str(tmp_path / "missing.jsonl")], "not found"),
        (["--suite", f"gsm8k={tmp_path / 'missing.jsonl'}"], "not found"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"],
                      "has no CUDA support" if torch.version.cuda is None else "no CUDA device"))
    for args, message in cases:
        out = tmp_path / "out"
        code, _, err = run_main(main, [*nope, *args, "--output", out])
        lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
        assert code == 2 and len(lines) == 1 and message in lines[0], (args, err)
        assert not out.exists()
    # and a good suite with a missing target fails on the target, after the drafter loaded
    code, _, err = run_main(main, ["--drafter", trained_drafter_dir, "--target", tmp_path / "no-target",
                                   "--output", tmp_path / "out"])
    assert code == 2 and "target not found" in err
