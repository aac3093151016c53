"""training/validate.py: what a validation scores."""

from dflash_train.cli.train import main


def quick(out, small_data, *extra) -> list[str]:
    """A run of a few seconds on the small data."""
    return [f"output_dir={out}", f"data.train={small_data / 'train.jsonl'}",
            f"data.val={small_data / 'val.jsonl'}", "max_steps=2", "train.batch_size=4", "data.num_anchors=4",
            "eval.max_samples=4", "model.num_layers=1", *extra]


def test_ddtree_max_blocks_caps_the_whole_validation(tmp_path, small_data, monkeypatch):
    """eval.ddtree_max_blocks is the number of blocks scored with trees in a validation (per
    process), not per validation batch: 2 batches of 4 rows x 4 anchors with a cap of 10 score
    10 blocks (before: 10 + 10)."""
    import dflash_train.training.validate as validate_module

    scored = []
    real = validate_module.ddtree_acceptance
    monkeypatch.setattr(validate_module, "ddtree_acceptance",
                        lambda logits, labels, *a: scored.append(len(labels)) or real(logits, labels, *a))
    main(quick(tmp_path / "run", small_data, "eval.max_samples=8", "eval.num_anchors=4",
               "eval.ddtree_max_blocks=10"))
    assert sum(scored) == 10, scored

