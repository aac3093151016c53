"""dflash-prepare's command line, cli/prepare.py: numeric options bounded and a device this torch cannot
use, each one line and exit 2 before anything loads (the work folder's refusals and resume:
test_bad_inputs_prepare.py; the pipeline: tests/data/test_prepare.py)."""

import json

import pytest
import torch

from conftest import TINY_TARGET
from dflash_train.cli import prepare
from helpers.prepare_cli import argv, refused, rows


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("extra, says", [
    (["--temperature", "inf"], "--temperature must be a number from 0 (greedy) to 2"),
    (["--temperature", "nan"], "--temperature must be a number from 0 (greedy) to 2"),
    (["--temperature", "-0.5"], "--temperature must be a number from 0 (greedy) to 2"),
    (["--temperature", "2.5"], "--temperature must be a number from 0 (greedy) to 2"),
    (["--top-p", "nan"], "--top-p in (0, 1]"),
    (["--val-fraction", "nan"], "--val-fraction must be in (0, 1)"),
    (["--val-fraction", "inf"], "--val-fraction must be in (0, 1)"),
    (["--seed", "-1"], "--seed must be from 0 to 2**32 - 1"),
    (["--seed", str(2**64)], "--seed must be from 0 to 2**32 - 1"),
    (["--max-length", "16", "--min-supervised-tokens", "17"], "every conversation would be dropped"),
    (["--backend", "vllm", "--target-dtype", "fp32"],
     "--target-dtype applies to the transformers and static"),
    (["--batch-size", "5000"], "--batch-size must be at most 4096 (conversations generated together), got "
                               "5000"),
    (["--max-length", "513"], f"--max-length 513 is past the 512 positions of target '{TINY_TARGET}' (its "
                              "max_position_embeddings): give at most 512"),
    (["--max-new-tokens", "100000"], "--max-new-tokens 100000 is past the 512 positions of target"),
    (["--min-supervised-tokens", "600"], "--min-supervised-tokens 600 is more than --max-length 512"),
])
def test_numeric_options_out_of_range_are_one_line(tmp_path, capsys, extra, says):
    out = tmp_path / "out"
    line = refused(capsys, argv(rows(tmp_path / "in.jsonl"), out, *extra))
    assert says in line and not out.exists() and not (tmp_path / "out.work").exists()


@pytest.mark.parametrize("backend", ["transformers", "static"])
@pytest.mark.parametrize("device, says", [
    ("cuda", "--device cuda: "), ("cuda:3", "--device cuda:3: "), ("gpu", "--device 'gpu' is not a device"),
    ("meta", "--device 'meta': use auto, cpu, cuda or cuda:N"),
])
def test_a_device_torch_cannot_use_is_one_line(tmp_path, capsys, monkeypatch, backend, device, says):
    """On a CPU build of torch --device cuda was a traceback once the target had loaded (AssertionError:
    Torch not compiled with CUDA enabled), for both backends; the static engine is the CPU's alone."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine's torch, wherever it runs
    out = tmp_path / "out"
    line = refused(capsys, argv(rows(tmp_path / "in.jsonl"), out, "--device", device, "--backend", backend))
    assert says in line and not out.exists() and not (tmp_path / "out.work").exists()
    if backend == "static" and device.startswith("cuda"):
        assert "--backend static runs on the CPU" in line
    elif device.startswith("cuda"):
        assert "sees no CUDA device" in line


def test_static_backend_on_auto_runs_on_the_cpu_beside_a_gpu(tmp_path, monkeypatch):
    """--device auto picked cuda beside a GPU, which the static engine then refused after loading."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = tmp_path / "out"
    prepare.main(argv(rows(tmp_path / "in.jsonl"), out, "--backend", "static"))
    assert json.loads((out / "prepare_info.json").read_text())["regeneration"]["backend"] == "static"
