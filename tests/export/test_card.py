"""The model card says what tree distillation did, not what the recipe asked (issue 30): "trained for
its tree" only when the run's metrics.jsonl counts distilled steps, with the count; none counted, it
says so; no metrics beside the drafter (a copy, an export), it says that the count is not known."""

import json
import shutil

import pytest

from dflash_train.checkpoint.folders import distilled_steps, trained_for
from dflash_train.cli.export import main as export_main
from dflash_train.evaluation.report import _distilled_text
from dflash_train.export.card import training_section
from dflash_train.training.config import dump_recipe, load_recipe

DISTILLING = ["model.variant=dspark", "tree_distill.weight=1.0", "tree_distill.budget=8",
              "tree_distill.every=2", "max_steps=4"]


def fake_run(folder, drafter, distilled_at=(2, 4)):
    """A run folder as training leaves it: final/ and checkpoints/step_000001/ (the drafter, with a
    tree-distilling recipe) and metrics.jsonl, whose steps in `distilled_at` carry tree_agree."""
    recipe = dump_recipe(load_recipe(None, DISTILLING))
    for sub in ["final", "checkpoints/step_000001"]:
        shutil.copytree(drafter, folder / sub)
        (folder / sub / "recipe.yaml").write_text(recipe)
    records = [{"step": s, "loss": 1.0, "terms": {"ce": 1.0, "tree": 0.5 * (s in distilled_at)}}
               | ({"tree_agree": 0.25} if s in distilled_at else {}) for s in range(1, 5)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_distilled_steps_are_counted_up_to_the_folders_step(tmp_path, fresh_drafter_dir):
    run = fake_run(tmp_path / "run", fresh_drafter_dir)
    assert distilled_steps(run / "final") == {"distilled": 2, "steps": 4}
    assert distilled_steps(run / "checkpoints" / "step_000001") == {"distilled": 0, "steps": 1}
    assert trained_for(run / "final")["distilled"] == {"distilled": 2, "steps": 4}
    shutil.copytree(run / "final", tmp_path / "copy")
    assert distilled_steps(tmp_path / "copy") is None  # no run beside it: unknown, not zero
    (run / "metrics.jsonl").write_text('{"step": 1, "loss"\n')  # damaged
    assert distilled_steps(run / "final") is None


@pytest.mark.parametrize("distilled, says, not_says", [
    ({"distilled": 2, "steps": 4}, "Trained for its tree: 2 of its 4 steps distilled trees (metrics.jsonl), "
                                   "every 2 step(s), 2 blocks' own 8-node trees", "Not trained"),
    ({"distilled": 0, "steps": 1}, "Not trained for its tree: its recipe asks for tree "
                                   "distillation (every 2 step(s)",
     "Trained for its tree"),
    (None, "but the training run's metrics.jsonl is not beside this drafter, so how many "
           "steps distilled is not known: it is not claimed as trained for its tree", "Trained for its tree"),
])
def test_the_card_claims_only_what_the_metrics_count(distilled, says, not_says):
    text = training_section(dump_recipe(load_recipe(None, DISTILLING)), "dflash-train", None, distilled)
    assert says in text and not_says not in text
    report_line = _distilled_text({"tree_distill": {"anchors": 2, "budget": 8, "every": 2, "weight": 1.0},
                                   "distilled": distilled})
    assert ("tree-distilled on 2 of 4 steps" in report_line) == bool(distilled and distilled["distilled"])


def test_export_states_the_runs_count(tmp_path, fresh_drafter_dir):
    """End to end: final/ of a run whose metrics count 2 distilled steps, its step-1 checkpoint (none
    yet), and the export of the export (no metrics beside it)."""
    run = fake_run(tmp_path / "run", fresh_drafter_dir)
    cards = {}
    for name, folder in [("final", run / "final"), ("step1", run / "checkpoints" / "step_000001")]:
        export_main(["--format", "speculators", "--checkpoint", str(folder), "--output",
                     str(tmp_path / name)])
        cards[name] = (tmp_path / name / "README.md").read_text()
    assert "Trained for its tree: 2 of its 4 steps distilled trees (metrics.jsonl)" in cards["final"]
    assert ("Not trained for its tree" in cards["step1"] and "not one of its 1 step "
                                                             "distilled" in cards["step1"])
    # as if kept with the export
    shutil.copy(run / "final" / "recipe.yaml", tmp_path / "final" / "recipe.yaml")
    export_main(["--format", "speculators", "--checkpoint", str(tmp_path / "final"), "--output",
                 str(tmp_path / "re")])
    card = (tmp_path / "re" / "README.md").read_text()
    assert "Trained for its tree" not in card and "is not claimed as trained for its tree" in card


def test_a_run_from_another_drafter_says_its_steps_come_on_top():
    """A recipe with model.init_from trains on from another drafter: its max_steps are not the drafter's
    whole training, and the card must not read as if they were."""
    plain = training_section(dump_recipe(load_recipe(None, ["max_steps=4"])), "dflash-train").splitlines()[0]
    assert "**4 steps** (batch" in plain and "init_from" not in plain  # the first line; the recipe follows
    on = training_section(dump_recipe(load_recipe(None, ["max_steps=4", "model.init_from=runs/first/final"])),
                          "dflash-train")
    assert ("**4 steps** on from the drafter `runs/first/final` (model.init_from: these steps "
            "come on top of its own) (batch") in on


def test_the_card_names_no_variant():
    """Every variant's card text is its own (card_* methods of model/variants/): export/ tests no variant's
    name or head and imports no variant's module, so a new variant's card needs no edit here."""
    from pathlib import Path

    import dflash_train.export as export

    words = ("dspark", "dflash2", "xpress", "markov", "selector", "confidence", "refiner", "model.variants.")
    for source in Path(export.__file__).parent.glob("*.py"):
        text = source.read_text().lower()
        assert not [w for w in words if w in text], source.name
