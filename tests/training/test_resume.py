"""Resuming a training run (dflash_train/training/resume.py): which recipe changes it allows."""

import pytest

from dflash_train.training.config import load_recipe


def test_the_deploy_budget_may_change_on_resume_and_the_math_may_not(tmp_path):
    from dflash_train.core.errors import UserError
    from dflash_train.training.resume import check_same_recipe

    saved = load_recipe(None, []).model_dump(mode="json")
    # only names a checkpoint
    check_same_recipe(saved, load_recipe(None, ["eval.deploy_budget=64"]), tmp_path, "x")
    with pytest.raises(UserError, match=r"eval.ddtree_budgets"):
        check_same_recipe(saved, load_recipe(None, ["eval.ddtree_budgets=[8]"]), tmp_path, "x")
