"""FSDP2 and DeepSpeed ZeRO-2/3 on CPU (gloo, 2 processes), launched through the shipped accelerate
configs: they train to DDP's losses, checkpoint under sharding, and a run killed with SIGKILL and
started again with the same command resumes exactly. Every shipped config launches.

accelerate does not shard on a CPU-only host, so under fsdp.yaml dflash-train applies torch's
fully_shard itself (dflash_train/training/engines.py); DeepSpeed runs on its CPU accelerator.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT
from dflash_train.checkpoint.folders import load_drafter

CONFIGS = ROOT / "recipes" / "accelerate"
STEPS = 12
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def command(config: str, out: Path, small_data: Path, processes: int = 2, steps: int = STEPS) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
            # a free port: other launches may run beside
            "--num_processes", str(processes), "--main_process_port", "0",
            "dflash_train/train.py", f"output_dir={out}", "seed=7",
            f"max_steps={steps}", "checkpoint_every=2", "train.batch_size=4", "data.num_anchors=16",
            f"data.train={small_data / 'train.jsonl'}", f"data.val={small_data / 'val.jsonl'}",
            "eval.max_samples=8"]


def run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and its workers (torchrun starts them in their own sessions)."""
    try:
        launcher = psutil.Process(proc.pid)
        tree = [launcher, *launcher.children(recursive=True)]
    except psutil.NoSuchProcess:  # the launcher has already been reaped
        return
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(tree[1:], timeout=30)


def records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def assert_same_weights(a: Path, b: Path) -> None:
    """Engines sum gradients in different orders (float32 noise ~1e-7 relative per step). Adam
    divides each gradient by its own running scale, so an element whose gradient is near zero can
    move differently by far more than that noise, while the tensor as a whole does not: compare
    each tensor's relative Frobenius distance (measured: ~1e-6 at most after 12 steps, ZeRO-3 against DDP)."""
    wa, wb = load_drafter(a)[0].state_dict(), load_drafter(b)[0].state_dict()
    assert wa.keys() == wb.keys()
    for k in wa:
        distance = ((wa[k].double() - wb[k].double()).norm() / wa[k].double().norm()).item()
        assert distance < 1e-5, (k, distance)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, small_data):
    out = tmp_path_factory.mktemp("ddp") / "run"
    run(command("ddp.yaml", out, small_data))
    assert json.loads((out / "summary.json").read_text())["engine"] == "ddp"
    return out


@pytest.mark.parametrize("config, engine", [("fsdp.yaml", "fsdp"), ("deepspeed_zero2.yaml", "deepspeed"),
                                            ("deepspeed_zero3.yaml", "deepspeed")])
def test_engine_trains_like_ddp_and_resumes_after_sigkill(config, engine, ddp_run, small_data, tmp_path):
    out, extensions = tmp_path / "run", tmp_path / "extensions"
    cmd = command(config, out, small_data)
    env = {**ENV, "TORCH_EXTENSIONS_DIR": str(extensions)}  # where a JIT build would land
    log = tmp_path / "first.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.time() + 300  # ~30-65 s here; a hang must not hold the next test (or CI) hostage
    while not (out / "checkpoints" / "step_000002" / "trainer_state.json").exists():
        if proc.poll() is not None or time.time() > deadline:
            what = "ended" if proc.returncode is not None else "hung"
            kill_tree(proc)
            pytest.fail(f"training {what} before the kill at step 2; its output "
                        f"ends:\n{log.read_text()[-3000:]}")
        time.sleep(0.02)
    kill_tree(proc)
    assert not (out / "summary.json").exists(), "training ended before the kill"
    killed_at = max(records(out))

    r = run(cmd, env)  # the same command again
    assert "resuming from" in r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == engine and summary["processes"] == 2
    assert summary["resumed_from_step"] >= 2 and killed_at >= 2
    mine, ddp = records(out), records(ddp_run)
    assert sorted(mine) == list(range(1, STEPS + 1))
    assert [mine[s]["loss"] for s in mine] == pytest.approx([ddp[s]["loss"] for s in mine], rel=1e-5)
    assert ([mine[s]["grad_norm"] for s in mine] == pytest.approx([ddp[s]["grad_norm"] for s in mine],
                                                                  rel=1e-4))
    assert_same_weights(out / "final", ddp_run / "final")  # full, unsharded weights in our format
    if engine == "deepspeed":  # the engine's own sharded state rides in every checkpoint
        assert (out / "checkpoints" / "step_000002" / "deepspeed").is_dir()
    # DeepSpeed's CPU shm op (inference all-reduce only) was not JIT-built: no ~40 s compile per
    # fresh machine, no ownerless build lock for a killed launch to leave behind
    assert not list(extensions.rglob("deepspeed_shm_comm")), list(extensions.rglob("*"))
    assert "deepspeed_shm_comm" not in log.read_text() + r.stdout + r.stderr


def test_ddp_checkpoint_resumes_under_fsdp(ddp_run, small_data, tmp_path):
    """Checkpoints hold full, name-keyed model and optimizer state: a run checkpointed under
    ddp.yaml continues under fsdp.yaml (sharded) with the losses it would have had."""
    out = tmp_path / "run"
    shutil.copytree(ddp_run, out)
    (out / "summary.json").unlink()  # as if it had died right after its checkpoint at step 2
    shutil.rmtree(out / "final")
    for d in (out / "checkpoints").glob("step_*"):
        if d.name != "step_000002":
            shutil.rmtree(d)
    r = run(command("fsdp.yaml", out, small_data))
    assert "resuming from" in r.stdout + r.stderr
    mine, ddp = records(out), records(ddp_run)
    assert json.loads((out / "summary.json").read_text())["engine"] == "fsdp"
    assert [mine[s]["loss"] for s in range(1, STEPS + 1)] == pytest.approx(
        [ddp[s]["loss"] for s in range(1, STEPS + 1)], rel=1e-5)
    assert_same_weights(out / "final", ddp_run / "final")


def test_single_gpu_config_launches(small_data, tmp_path):
    """single_gpu.yaml (bf16 on a GPU) on a CPU-only host: one process, fp32."""
    out = tmp_path / "run"
    run(command("single_gpu.yaml", out, small_data, processes=1, steps=2))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "single" and summary["processes"] == 1 and summary["precision"] == "fp32"


def test_every_shipped_config_is_covered():
    """A config added to recipes/accelerate/ must get a launch test here."""
    launched = {"ddp.yaml", "fsdp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "single_gpu.yaml",
                "fsdp_dspark.yaml"}
    assert {p.name for p in CONFIGS.glob("*.yaml")} == launched


@pytest.mark.parametrize("variant, reference", [
    (["model.variant=dspark", "model.markov_rank=16"], "single"),
    # DFlash2's convolution kernel projections start at zero, where Adam turns the float32 noise of
    # summing gradients over 1 or 2 processes into ~3e-5 relative weight differences after 3 steps
    # (DDP and FSDP alike; FSDP against DDP: 3e-7), so FSDP is checked against DDP there
    (["model.variant=dflash2", "model.selector_rank=16"], "ddp"),
], ids=["dspark", "dflash2"])
def test_heads_under_fsdp_train_like_one_process(small_data, tmp_path, variant, reference):
    """DSpark's heads and DFlash2's selector run after the backbone's forward (and W2 / the
    successor codebook inside the loss): under fsdp_dspark.yaml (parameters gathered until
    backward) 2 processes x batch 4 train the model that 1 process x batch 8 trains (DFlash2:
    that 2 DDP processes train)."""
    from dflash_train.cli.train import main as train_main

    steps = 3
    sharded = tmp_path / "fsdp"
    run(command("fsdp_dspark.yaml", sharded, small_data, steps=steps) + variant)
    assert json.loads((sharded / "summary.json").read_text())["engine"] == "fsdp"
    other = tmp_path / reference
    if reference == "ddp":
        run(command("ddp.yaml", other, small_data, steps=steps) + variant)
    else:
        args = command("fsdp_dspark.yaml", other, small_data, steps=steps)
        train_main([a for a in args[args.index("dflash_train/train.py") + 1:] if a != "train.batch_size=4"]
                   + ["train.batch_size=8"] + variant)
    a, b = records(sharded), records(other)
    assert [a[s]["loss"] for s in range(1, steps + 1)] == pytest.approx([b[s]["loss"]
                                                                         for s in range(1, steps + 1)],
                                                                         rel=1e-5)
    assert_same_weights(sharded / "final", other / "final")



def test_a_parameter_without_optimizer_state_resumes_as_if_never_stopped():
    """A parameter with no gradient before the checkpoint has no AdamW state saved (a DSpark run whose
    confidence head had not trained crashed on resume with torch's 'Missing optimizer state'). Resumed,
    it must train exactly as in the run that was never stopped."""
    import copy

    import torch
    from accelerate import Accelerator

    from dflash_train.training.engines import full_optimizer_state, load_optimizer_state

    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))

    def make():
        torch.manual_seed(0)
        m = torch.nn.ModuleDict({"body": torch.nn.Linear(3, 3), "head": torch.nn.Linear(3, 3)})
        return m, torch.optim.AdamW(m.parameters(), lr=0.1)

    def step(m, opt, head: bool):
        loss = m["body"](x).square().sum() + (m["head"](x).square().sum() if head else 0)
        loss.backward()
        opt.step()
        opt.zero_grad()

    accelerator = Accelerator(cpu=True)
    m, opt = make()
    step(m, opt, head=False)
    saved = full_optimizer_state(accelerator, m, opt)
    assert not any(k.startswith("head") for k in saved["state"])  # the case: nothing saved for it
    resumed, resumed_opt = make()
    resumed.load_state_dict(m.state_dict())
    load_optimizer_state(accelerator, resumed, resumed_opt, copy.deepcopy(saved))  # as from disk: no aliasing
    for _ in range(3):
        step(m, opt, head=True)
        step(resumed, resumed_opt, head=True)
    for k, w in m.state_dict().items():
        assert torch.equal(w, resumed.state_dict()[k]), k
