"""Exact resume after SIGKILL, and 2-process (gloo) training and gradient accumulation equal to 1 process
at the same global batch (bit for bit where the float operations are the same, else within a stated
number of float32 roundings)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT
from dflash_train.checkpoint.folders import load_drafter
from dflash_train.training.blocks import ddtree_acceptance



def run_args(out, small_data, *extra):
    return [f"output_dir={out}", "seed=7", f"data.train={small_data / 'train.jsonl'}",
            f"data.val={small_data / 'val.jsonl'}", "eval.max_samples=8", "data.num_anchors=16", *extra]


def losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_sigkill_then_rerun_resumes_exactly(tmp_path, small_data):
    """Kill the run with SIGKILL after a checkpoint, rerun the same command: every step's loss
    equals an uninterrupted run's (same machine, same threads: bit-identical in practice;
    asserted to 1e-6 relative)."""
    args = run_args(tmp_path / "run", small_data, "max_steps=12", "checkpoint_every=3", "train.batch_size=4",
                    "train.grad_accum=2", "eval.every=6")
    cmd = [sys.executable, "-m", "dflash_train.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (tmp_path / "run" / "checkpoints" / "step_000006" / "trainer_state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "training ended before the kill"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "run" / "summary.json").exists()
    killed_at = max(losses(tmp_path / "run"))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming from" in r.stdout + r.stderr

    full = subprocess.run([sys.executable, "-m", "dflash_train.train",
                           *run_args(tmp_path / "full", small_data, "max_steps=12", "checkpoint_every=3",
                                     "train.batch_size=4", "train.grad_accum=2", "eval.every=6")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-2000:]
    resumed, uninterrupted = losses(tmp_path / "run"), losses(tmp_path / "full")
    assert sorted(resumed) == list(range(1, 13)) and killed_at >= 6
    assert ([resumed[s] for s in range(1, 13)] == pytest.approx([uninterrupted[s] for s in range(1, 13)],
                                                                rel=1e-6))
    a, b = load_drafter(tmp_path / "run" / "final")[0], load_drafter(tmp_path / "full" / "final")[0]
    for k, v in a.state_dict().items():
        torch.testing.assert_close(v, b.state_dict()[k], rtol=1e-6, atol=1e-7)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["resumed_from_step"] in (6, 9)

    # a changed recipe is refused rather than silently mixed into the run
    (tmp_path / "run" / "summary.json").unlink()
    bad = subprocess.run(cmd + ["train.lr=1e-2"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "the recipe changed (train.lr)" in bad.stderr


# float32 rounding of one value: every comparison below allows a stated number of them.
EPS32 = torch.finfo(torch.float32).eps


def assert_same_training(a: dict, b: dict, roundings: float) -> None:
    """Two trainings of the same model that differ only in the order of float32 sums. Compared per
    tensor in float64 norm: ||a - b|| <= roundings * eps32 * ||a||. Elementwise comparisons are
    flaky here: AdamW divides each gradient by its own running RMS, so an element whose gradient is
    mostly cancellation (near zero) can move by thousands of roundings, while the tensor as a
    whole moves by a few. Measured: 17 roundings at most; one fewer step at the end of the
    cosine schedule is 56000."""
    for k, v in a.items():
        x, y = v.double(), b[k].double()
        assert ((x - y).norm() <= roundings * EPS32 * x.norm()), (k, ((x - y).norm()
                                                                      / (EPS32 * x.norm())).item())


def test_two_processes_match_one(tmp_path, small_data):
    """Global batch 8: 1 process x 8, 2 gloo processes x 4 and 1 process x 4 x 2 micro-batches.
    Same rows per step (the sampler shards whole batches), same anchors (drawn per row), one global
    loss normaliser. 2 x 4 and 1 x 4 x 2 run the very same float operations (a process's share of
    the loss is scaled by 2, exactly, and DDP's mean of two gradients undoes it, exactly): equal
    bit for bit. 1 x 8 rounds its larger matmuls differently: within 1000 float32 roundings (norm)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = [sys.executable, "-m", "dflash_train.train"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", "0", "dflash_train/train.py"]
    runs = {"one": [*train, *run_args(tmp_path / "one", small_data, "max_steps=5", "train.batch_size=8")],
            "accum": [*train, *run_args(tmp_path / "accum", small_data, "max_steps=5", "train.batch_size=4",
                                        "train.grad_accum=2")],
            "two": [*launch, *run_args(tmp_path / "two", small_data, "max_steps=5", "train.batch_size=4")]}
    for name, cmd in runs.items():
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (name, r.stderr[-3000:])
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["processes"] == 2
    l1, l2 = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [l1[s] for s in range(1, 6)] == pytest.approx([l2[s] for s in range(1, 6)], rel=1e-5)
    w = {name: load_drafter(tmp_path / name / "final")[0].state_dict() for name in runs}
    for k, v in w["two"].items():
        assert torch.equal(v, w["accum"][k]), k
    assert_same_training(w["one"], w["two"], roundings=1000)
    s1, s2 = (json.loads((tmp_path / d / "summary.json").read_text())["eval"] for d in ["one", "two"])
    assert s1["blocks"] == s2["blocks"] and s1["eal"] == pytest.approx(s2["eal"], rel=1e-6)


@pytest.mark.parametrize("objective, roundings", [
    ([], 1000),
    # D-PACE weights come from the drafter's own CE and AUF's mask from its argmax: both are per
    # block, and the divisor (slot count / exp weights) is known before the forward. TV makes
    # near-zero gradients (see assert_same_training) common. Measured: 10 (ce-exp), 23 (dpace),
    # 55 (auf) roundings; a wrong normaliser (per micro-batch) moves weights by ~1e-2 elementwise.
    (["loss.position_weight=dpace", "loss.terms={ce: 1.0, kl: 0.5}", "loss.chunk_slots=40"], 1000),
    (["loss.until_first_failure=true", "loss.terms={ce: 0.1, tv: 0.9}"], 1000),
], ids=["ce-exp", "dpace", "auf"])
def test_accumulation_matches_a_full_batch(tmp_path, small_data, objective, roundings):
    """1 x 4 x 2 micro-batches and 1 x 8: the same rows, anchors and global normaliser per step."""
    from dflash_train.cli.train import main

    main(run_args(tmp_path / "full", small_data, "max_steps=4", "train.batch_size=8", *objective))
    main(run_args(tmp_path / "accum", small_data, "max_steps=4", "train.batch_size=4", "train.grad_accum=2",
                  *objective))
    full, accum = losses(tmp_path / "full"), losses(tmp_path / "accum")
    assert [full[s] for s in range(1, 5)] == pytest.approx([accum[s] for s in range(1, 5)], rel=1e-5)
    a, b = load_drafter(tmp_path / "full" / "final")[0], load_drafter(tmp_path / "accum" / "final")[0]
    assert_same_training(a.state_dict(), b.state_dict(), roundings=roundings)


def test_teacher_forced_tree_acceptance():
    """V = 4, K = 2 slots. Block 0: the drafter prefers token 0 (logp -0.64) over token 1 (-0.74)
    at slot 1, and is sure of token 2 at slot 2; the target takes token 1 then 2. Best-first
    pops token 0, then its child (-0.64), then token 1 (-0.74), then token 1's child: so
    budgets 1, 2, 3, 8 accept 0, 0, 1, 2 tokens (the chain: 0). Block 1: the target follows
    the argmax twice: 1, 2, 2, 2. Spine counts (the largest tree): block 0's token 1 is off the
    spine (rank 1) and its best child 2 is the target's next token; block 1's token 3 is on it
    and so is its best child 2."""
    logits = torch.full((2, 2, 4), -10.0)
    logits[0, 0, 0], logits[0, 0, 1] = 5.0, 4.9
    logits[0, 1, 2] = 5.0
    logits[1, 0, 3], logits[1, 1, 2] = 5.0, 5.0
    labels = torch.tensor([[1, 2], [3, 2]])
    valid = torch.ones(2, 2, dtype=torch.bool)
    counts = ddtree_acceptance(logits, labels, valid, [1, 2, 3, 8], max_blocks=10)
    assert counts.tolist() == [0 + 1, 0 + 2, 1 + 2, 2 + 2, 2, 1, 1, 1, 1]
    valid[1, 1] = False  # a slot past the response ends the walk (and hides the next token)
    assert ddtree_acceptance(logits, labels, valid, [8], 10).tolist() == [2 + 1, 2, 0, 0, 1, 1]
    assert ddtree_acceptance(logits, labels, valid, [8], max_blocks=1).tolist() == [2, 1, 0, 0, 1, 1]
