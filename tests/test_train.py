"""Short end-to-end runs of the training entry on tiny targets."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash_train.checkpoint import load_drafter
from dflash_train.train import main

ROOT = Path(__file__).resolve().parents[1]


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
    assert summary["eval"]["eal"] == rows[-1]["val_eal"] or abs(summary["eval"]["eal"] - rows[-1]["val_eal"]) < 1e-4

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
    try:
        main([f"output_dir={out}", "max_steps=1"])
    except SystemExit as e:
        assert e.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: output_dir '{out}' is not empty and holds no checkpoint to resume (pass overwrite=true to replace it)"]
    assert (out / "keep.txt").read_text() == "mine"


def test_non_default_objective_trains_and_reports_every_term(tmp_path, small_data):
    """KL + NLA with uniform slot weights (and TV at weight 0: reported, not trained): the loss
    falls, every record carries each term (the loss is their weighted sum) and alpha per slot,
    validation and summary.json too, and the tracker gets them as scalars."""
    from dflash_train.train import flat_for_tracker

    out = tmp_path / "kl_nla"
    main([f"output_dir={out}", "max_steps=24", "seed=3", "eval.every=12", "eval.max_samples=8",
          f"data.train={small_data / 'train.jsonl'}", f"data.val={small_data / 'val.jsonl'}", "train.batch_size=8",
          "data.num_anchors=16", "train.warmup_ratio=0.25", "loss.terms={kl: 1.0, nla: 0.5, tv: 0.0}",
          "loss.position_weight=uniform", "loss.chunk_slots=100"])
    rows = read_metrics(out)
    first, last = sum(m["loss"] for m in rows[:3]) / 3, sum(m["loss"] for m in rows[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    for r in rows:
        assert set(r["terms"]) == {"kl", "nla", "tv"} and len(r["alpha_per_position"]) == 7
        assert abs(r["loss"] - (r["terms"]["kl"] + 0.5 * r["terms"]["nla"])) < 1e-5
        assert all(0 <= a <= 1 for a in r["alpha_per_position"]) and 0 < r["terms"]["tv"] <= 1
    for r in (rows[11], rows[23]):
        assert set(r["val_terms"]) == {"kl", "nla", "tv"} and len(r["val_alpha_per_position"]) == 7
        assert abs(r["val_loss"] - (r["val_terms"]["kl"] + 0.5 * r["val_terms"]["nla"])) < 1e-5
    assert sum(rows[23]["val_alpha_per_position"]) > sum(rows[0]["alpha_per_position"])
    summary = json.loads((out / "summary.json").read_text())["eval"]
    assert summary["terms"].keys() == {"kl", "nla", "tv"} and len(summary["alpha_per_position"]) == 7
    flat = flat_for_tracker(rows[23])
    assert {"loss/kl", "loss/tv", "val/loss/nla", "alpha_7", "val/alpha_1", "val/acc_7", "val/ddtree_tau@64"} <= flat.keys()
    assert all(isinstance(v, (int, float)) for v in flat.values())
