"""dflash-train's command line, cli/train.py: the recipe and its key=value overrides as argparse reads
them (what training does with them: tests/training/)."""

import pytest

from conftest import ROOT, error_line
from dflash_train.cli.train import main as train_main


def test_overrides_on_both_sides_of_the_recipe(tmp_path, small_data, capsys):
    """Issue 30: `dflash-train key=val --recipe R key2=val2` was refused (argparse took the overrides
    before --recipe and called those after it unrecognized). Both sides are overrides now, applied in
    command-line order (a key given twice: the later one, as before); --recipe twice is one line
    instead of the last recipe replacing the first silently."""
    from dflash_train.cli.train import parse_args
    from dflash_train.training.config import load_recipe

    recipe = str(ROOT / "recipes" / "tiny.yaml")
    overrides = ["max_steps=7", "train.lr=1e-4", "seed=3", "max_steps=9"]
    args = parse_args([overrides[0], "--recipe", recipe, *overrides[1:]])
    assert args.recipe == recipe and args.overrides == overrides
    cfg = load_recipe(args.recipe, args.overrides)
    assert (cfg.max_steps, cfg.train.lr, cfg.seed) == (9, 1e-4, 3)
    out = tmp_path / "run"
    for argv, words in [
        ([f"output_dir={out}", "--recipe", recipe, "train.lrr=1"], "unknown key 'train.lrr'"),  # after: read
        (["train.lrr=1", "--recipe", recipe, f"output_dir={out}"], "unknown key 'train.lrr'"),  # before: read
        (["--recipe", recipe, "seed=1", "--recipe", recipe], "--recipe is given twice"),
    ]:
        with pytest.raises(SystemExit) as e:
            train_main(argv)
        assert e.value.code == 2 and words in error_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []
