"""training/objective.py: a recipe's loss terms, trained and reported (the loss their weighted sum)."""

import json
from pathlib import Path

from dflash_train.cli.train import main


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_non_default_objective_trains_and_reports_every_term(tmp_path, small_data):
    """KL + NLA with uniform slot weights (and TV at weight 0: reported, not trained): the loss
    falls, every record carries each term (the loss is their weighted sum) and alpha per slot,
    validation and summary.json too, and the tracker gets them as scalars."""
    from dflash_train.training.trainer import flat_for_tracker

    out = tmp_path / "kl_nla"
    main([f"output_dir={out}", "max_steps=24", "seed=3", "eval.every=12", "eval.max_samples=8",
          f"data.train={small_data / 'train.jsonl'}", f"data.val={small_data / 'val.jsonl'}",
          "train.batch_size=8", "data.num_anchors=16", "train.warmup_ratio=0.25",
          "loss.terms={kl: 1.0, nla: 0.5, tv: 0.0}", "loss.position_weight=uniform", "loss.chunk_slots=100"])
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
    assert ({"loss/kl", "loss/tv", "val/loss/nla", "alpha_7", "val/alpha_1", "val/acc_7",
             "val/ddtree_tau@64"} <= flat.keys())
    assert all(isinstance(v, (int, float)) for v in flat.values())

