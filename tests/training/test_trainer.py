"""Short end-to-end runs of the training entry on tiny targets."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, TINY_TARGET, broken_target, error_line
from dflash_train.checkpoint.folders import load_drafter
from dflash_train.cli.train import main
from dflash_train.core.outputs import MARKER


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_accelerate_launch_trains_and_writes_outputs(tmp_path, small_data):
    """The user's command, on the bundled target: the loss falls and all outputs are written."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "dflash_train/train.py",
           f"output_dir={out}", "max_steps=24", "seed=3", "checkpoint_every=12", "eval.every=12",
           f"data.train={small_data / 'train.jsonl'}", f"data.val={small_data / 'val.jsonl'}",
           "train.batch_size=8", "train.warmup_ratio=0.25", "wandb.enabled=true", "wandb.mode=offline"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "WANDB_SILENT": "true"})
    assert r.returncode == 0, r.stderr[-3000:]

    rows = read_metrics(out)
    assert [m["step"] for m in rows] == list(range(1, 25))
    assert all({"step", "loss", "lr"} <= m.keys() for m in rows)
    first, last = sum(m["loss"] for m in rows[:3]) / 3, sum(m["loss"] for m in rows[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    lrs = [m["lr"] for m in rows]  # 6 warmup steps from 0, then cosine decay
    assert lrs[0] == 0 and lrs[:7] == sorted(lrs[:7]) and lrs[6:] == sorted(lrs[6:], reverse=True)
    assert "val_eal" in rows[11] and "val_eal" in rows[23] and "val_eal" not in rows[0]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 24 and summary["wall_s"] > 0 and summary["train_tokens_per_s"] > 0
    assert summary["eval"]["eal"] >= 1.0 and len(summary["eval"]["acc_per_position"]) == 7
    assert (summary["eval"]["eal"] == rows[-1]["val_eal"] or abs(summary["eval"]["eal"]
                                                                 - rows[-1]["val_eal"]) < 1e-4)

    drafter, meta = load_drafter(out / "final")
    saved = load_file(out / "final" / "model.safetensors")
    assert set(saved) == set(drafter.state_dict())
    assert "max_steps: 24" in (out / "final" / "recipe.yaml").read_text()
    assert drafter.config.target_layer_ids == [1, 5] and meta["mask_token"] == "<|MASK|>"
    ckpt = out / "checkpoints" / "step_000012"
    assert json.loads((ckpt / "trainer_state.json").read_text()) == {"step": 12}
    assert not torch.equal(load_file(ckpt / "model.safetensors")["fc.weight"], saved["fc.weight"])
    assert list((out / "wandb").glob("offline-run-*"))


def test_llama_target_same_code_path(tmp_path, small_data, llama_target_dir):
    """A Llama-architecture target trains through the very same entry (in-process)."""
    out = tmp_path / "llama"
    main([f"output_dir={out}", f"model.target={llama_target_dir}", "max_steps=6", "model.num_layers=1",
          "model.block_size=4", f"data.train={small_data / 'train.jsonl'}",
          f"data.val={small_data / 'val.jsonl'}", "train.batch_size=4", "data.num_anchors=8"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target_layer_ids"] == [3]  # one drafter layer: the middle layer of 6
    assert len(summary["eval"]["acc_per_position"]) == 3
    assert len(read_metrics(out)) == 6


def test_non_empty_output_dir_is_refused(tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for overwrite in ("false", "true"):  # not ours: never replaced
        with pytest.raises(SystemExit) as e:
            main([f"output_dir={out}", "max_steps=1", f"overwrite={overwrite}"])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: output_dir '{out}' is not empty and was not written by dflash-train (no "
                       ".dflash-train.json): choose another output_dir, or empty it yourself"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def quick(out, small_data, *extra) -> list[str]:
    """A run of a few seconds on the small data."""
    return [f"output_dir={out}", f"data.train={small_data / 'train.jsonl'}",
            f"data.val={small_data / 'val.jsonl'}", "max_steps=2", "train.batch_size=4", "data.num_anchors=4",
            "eval.max_samples=4", "model.num_layers=1", *extra]


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return error_line(capsys.readouterr().err)


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(small_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    main(quick(out, small_data, "checkpoint_every=1"))
    return out


def test_overwrite_checks_every_input_before_touching_the_old_run(finished_run, small_data, tmp_path, capsys):
    """overwrite=true replaces only a run of ours, and only once the new run is loaded and checked:
    a bad target (missing, or with weights that do not fill its config) or missing data leaves it as it
    was."""
    before = snapshot(finished_run)
    bad_target = broken_target(tmp_path / "target", "missing")
    for extra, message in [(["model.target=/nope"], "model.target not found: '/nope'"),
                           ([f"model.target={bad_target}"], "its weights do not match its config.json"),
                           # the data is checked before the (broken) target is loaded
                           ([f"model.target={bad_target}", f"data.val={tmp_path / 'none.jsonl'}"],
                            "not found")]:
        argv = quick(finished_run, small_data, "checkpoint_every=1", "overwrite=true", *extra)
        assert message in refused(argv, capsys)
        assert snapshot(finished_run) == before
    assert not [p for p in finished_run.parent.iterdir() if p.name.startswith(".run.")]  # nothing set aside


def test_output_dir_overlapping_an_input_is_refused(finished_run, small_data, tmp_path, capsys):
    line = refused(quick(small_data, small_data), capsys)
    assert line == (f"error: output_dir '{small_data}' holds the data.train '{small_data / 'train.jsonl'}': "
                    "write the output somewhere else")
    inside = finished_run / "final" / "more"
    line = refused(quick(inside, small_data, f"model.init_from={finished_run / 'final'}", "overwrite=true"),
                   capsys)
    assert "is inside the model.init_from" in line
    f = tmp_path / "file"
    f.write_text("x")
    assert refused(quick(f, small_data), capsys) == f"error: output_dir '{f}' is a file, not a folder"
    assert f.read_text() == "x" and not inside.exists()
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert refused(quick(loop / "run", small_data), capsys) == (
        f"error: output_dir '{loop / 'run'}' cannot be created: '{loop}' is a symbolic link that leads "
        "nowhere (to a missing path, or in a loop)")


def test_resume_messages_say_what_overwrite_deletes(finished_run, small_data, capsys):
    line = refused(quick(finished_run, small_data, "checkpoint_every=1"), capsys)
    assert line == (f"error: output_dir '{finished_run}' holds a finished run: overwrite=true deletes it "
                    "(1 checkpoint up to step 1, final/, metrics.jsonl, summary.json), or choose "
                    "another output_dir")


def test_a_moved_run_resumes_with_paths_spelt_differently(finished_run, small_data, tmp_path, monkeypatch,
                                                          capsys):
    """Interrupted after its checkpoint (summary and final removed), moved elsewhere, resumed with
    a trailing slash and relative data paths: the same run."""
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(finished_run, moved)
    (moved / "summary.json").unlink()
    shutil.rmtree(moved / "final")
    monkeypatch.chdir(small_data)
    argv = [f"output_dir={moved}/", "data.train=train.jsonl", "data.val=./val.jsonl",
            *quick(moved, small_data, "checkpoint_every=1")[3:]]
    line = refused([*argv, "train.lr=1e-2"], capsys)
    assert line.startswith(f"error: cannot resume from {moved / 'checkpoints' / 'step_000001'}: "
                           "the recipe changed (train.lr); rerun with the same recipe to resume, choose "
                           "another output_dir, or pass overwrite=true to delete this run (1 checkpoint up "
                           "to step 1, metrics.jsonl)")
    main(argv)
    assert f"resuming from {moved / 'checkpoints' / 'step_000001'}" in capsys.readouterr().out
    assert json.loads((moved / "summary.json").read_text())["resumed_from_step"] == 1
    plain = moved / "plain.txt"  # the weights are as readable as any file the user writes (umask)
    plain.write_text("x")
    for weights in [moved / "final" / "model.safetensors",
                    moved / "checkpoints" / "step_000001" / "model.safetensors"]:
        assert weights.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


def test_a_run_stopped_before_its_first_checkpoint_starts_again(small_data, tmp_path, capsys):
    out = tmp_path / "run"
    main(quick(out, small_data))
    (out / "summary.json").unlink()
    shutil.rmtree(out / "final")  # as if stopped at step 2, with no checkpoint
    main(quick(out, small_data))  # the same command, no overwrite=true
    said = capsys.readouterr().out
    assert "holds a run stopped before its first checkpoint (metrics.jsonl): starting it again" in said
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and (out / "summary.json").is_file()


def test_resume_against_a_changed_target_is_one_line(small_data, qwen3_random_target_dir, tmp_path, capsys):
    """The target folder now holds a model of another hidden size: refused before loading weights."""
    target = tmp_path / "target"
    shutil.copytree(TINY_TARGET, target)
    out = tmp_path / "run"
    main(quick(out, small_data, f"model.target={target}", "checkpoint_every=1"))
    (out / "summary.json").unlink()
    shutil.rmtree(target)
    shutil.copytree(qwen3_random_target_dir, target)
    line = refused(quick(out, small_data, f"model.target={target}", "checkpoint_every=1"), capsys)
    assert line == (f"error: cannot resume from {out / 'checkpoints' / 'step_000001'}: it holds "
                    "a drafter of hidden size 128, the target now gives 64 (the target changed since?)")


def test_runs_from_any_folder_and_prints_only_its_own_progress(tmp_path):
    """The default recipe, target and data come from the checkout; the drafter records its target by
    absolute path, so it exports from yet another folder. Validation shows a bar; the datasets
    Filter/Flattening bars and DeepSpeed's accelerator warning do not print."""
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    r = subprocess.run([sys.executable, "-m", "dflash_train.train", "output_dir=run", "max_steps=2",
                        "train.batch_size=4", "data.num_anchors=4", "eval.max_samples=4"],
                       cwd=elsewhere, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validate" in r.stderr
    for noise in ["Filter", "Flattening", "Setting accelerator to CPU"]:
        assert noise not in r.stderr, r.stderr[-3000:]
    meta = json.loads((elsewhere / "run" / "final" / "config.json").read_text())
    assert meta["target"]["name_or_path"] == str(TINY_TARGET)
    assert (elsewhere / "run" / MARKER).is_file()
    from dflash_train.cli.export import main as export_main

    other = tmp_path / "other"
    other.mkdir()
    os.chdir(other)
    try:
        export_main(["--format", "dflash", "--checkpoint", str(elsewhere / "run" / "final"), "--output", "x"])
    finally:
        os.chdir(ROOT)
    assert (json.loads((other / "x" / "config.json").read_text())["verifier_pin"]["name_or_path"]
            == str(TINY_TARGET))


def test_ctrl_c_is_one_line_exit_130_and_the_same_command_resumes(tmp_path, small_data):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dflash_train.train",
           *quick(out, small_data, "max_steps=100000", "checkpoint_every=3",
                                                                "train.batch_size=2", "log_every=1")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run_until(step: int):
        # Ctrl-C at a terminal: SIGINT at its default in the child, even when this test suite itself
        # runs as a background job (`make test &`), which starts with SIGINT ignored (kept ignored:
        # test_an_ignored_sigint_stays_ignored)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.time() + 300
        while not (out / "metrics.jsonl").is_file() or max([0] + [r["step"]
                                                                  for r in read_metrics(out)]) < step:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
        return proc.returncode, stdout, stderr

    code, _, stderr = run_until(4)
    assert code == 130 and "Traceback" not in stderr, stderr[-3000:]
    done = read_metrics(out)[-1]["step"]
    resume = max(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*"))
    assert resume >= 3 and stderr.strip().splitlines()[-1] == (
        f"interrupted at step {done}; rerun the same command to resume from step {resume}")
    code, stdout, stderr = run_until(done + 1)  # a step the first run never reached
    assert (code == 130 and f"resuming from "
                            f"{out / 'checkpoints' / f'step_{resume:06d}'}" in stdout), stderr[-3000:]


@pytest.mark.parametrize("ignored", [True, False])
def test_an_ignored_sigint_stays_ignored(ignored, tmp_path, small_data, monkeypatch):
    """A `cmd &` job of a non-interactive shell starts with SIGINT ignored: training leaves it so
    (before, it installed its stop flag and Ctrl-C meant for the shell stopped the job). Otherwise
    the stop flag's handler is in place during training, and the caller's is back afterwards."""
    import dflash_train.training.trainer as train_module

    during = []
    real = train_module.validate
    monkeypatch.setattr(train_module, "validate",
                        lambda *a, **k: during.append(signal.getsignal(signal.SIGINT)) or real(*a, **k))
    mine = signal.SIG_IGN if ignored else signal.default_int_handler
    before = signal.signal(signal.SIGINT, mine)
    try:
        main(quick(tmp_path / "run", small_data))
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, before)
    assert len(during) == 1  # validation runs inside the last step
    if ignored:
        assert during[0] is signal.SIG_IGN
    else:
        assert during[0] not in (signal.SIG_IGN, signal.default_int_handler)
