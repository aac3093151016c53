import subprocess
import sys

import pytest

from conftest import ROOT
from dflash_train.core.errors import UserError
from dflash_train.training.config import RunConfig, load_recipe



@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_loads(recipe):
    assert isinstance(load_recipe(recipe), RunConfig)


def test_overrides_are_typed_and_nested():
    cfg = load_recipe(ROOT / "recipes/tiny.yaml", ["output_dir=runs/x", "max_steps=50", "seed=3",
                                                   "train.lr=1e-4", "model.target_layer_ids=[1, 3]"])
    assert (cfg.output_dir, cfg.max_steps, cfg.seed) == ("runs/x", 50, 3)
    assert cfg.train.lr == 1e-4 and cfg.model.target_layer_ids == [1, 3]


@pytest.mark.parametrize("override, message", [
    ("train.lrr=1", "unknown key 'train.lrr'"),
    ("bogus=1", "unknown key 'bogus'"),
    ("max_steps=many", "'max_steps'"),
    ("max_steps=0", "'max_steps'"),
    ("seed=4294967296", "'seed'"),  # 2**32: as dflash-prepare and dflash-eval --seed
    ("seed=-1", "'seed'"),
    ("loss.ce_labels=maybe", "'loss.ce_labels'"),
    ("train=3", "'train'"),
    ("noequals", "not of the form key=value"),
    ("train.betas=[0.9, 1.0]", r"'train.betas.1': Input should be less than 1"),
    ("train.betas=[-0.1, 0.9]", r"'train.betas.0': Input should be greater than or equal to 0"),
    ("eval.ddtree_budgets=[16, -4]", r"'eval.ddtree_budgets.1': Input should be greater than or equal to 0"),
    ("loss.ce_weight=0.5", r"'loss.ce_weight' was replaced by loss.terms \(ce_weight: 1.0, "
                           r"kl_weight: 0.5 -> terms: "),
    ("loss.kl_weight=0.5", "'loss.kl_weight' was replaced by loss.terms"),
    ("loss.terms={ce: 0, tv: 0}", "no term with a positive weight"),
    ("loss.terms={ce: -1}", "'loss.terms.ce'"),
    ("loss.terms={xent: 1}", "'loss.terms.xent"),
    ("loss.position_weight=linear", "'loss.position_weight'"),
    ("loss.dpace_alpha=0", "'loss.dpace_alpha'"),
])
def test_recipe_errors_name_the_key(override, message):
    with pytest.raises(UserError, match=message) as e:
        load_recipe(ROOT / "recipes/tiny.yaml", [override])
    assert "\n" not in str(e.value)


def test_loss_terms_from_the_command_line():
    cfg = load_recipe(ROOT / "recipes/tiny.yaml",
                      ["loss.terms={ce: 0.1, tv: 0.9}", "loss.position_weight=dpace"])
    assert cfg.loss.terms == {"ce": 0.1, "tv": 0.9} and cfg.loss.position_weight == "dpace"
    cfg = load_recipe(ROOT / "recipes/tiny.yaml", ["loss.terms.kl=0.5"])  # one more term beside the recipe's
    assert cfg.loss.terms == {"ce": 1.0, "kl": 0.5}


@pytest.mark.parametrize("override", ["loss.terms={tv:1.0,kl:0.5}", "loss.terms={tv: 1.0, kl: 0.5}",
                                      "loss.terms={'tv':1.0,\"kl\":0.5}"])
def test_dict_and_list_overrides_as_hydra_and_yaml_spell_them(override):
    """Hydra's `{tv:1.0}` (YAML alone reads it as the key 'tv:1.0' with no value) and YAML's `{tv: 1.0}`."""
    assert load_recipe(ROOT / "recipes/tiny.yaml", [override]).loss.terms == {"tv": 1.0, "kl": 0.5}
    for spelling in ["[1,5]", "[1, 5]"]:
        assert load_recipe(ROOT / "recipes/tiny.yaml",
                           [f"model.target_layer_ids={spelling}"]).model.target_layer_ids \
            == [1, 5]
    # a colon in a plain value is left alone
    assert (load_recipe(ROOT / "recipes/tiny.yaml", ["model.target=hf://org/name"]).model.target
            == "hf://org/name")


@pytest.mark.parametrize("override", ["loss.terms.ce=.inf", "train.lr=.nan", "loss.gamma=.inf",
                                      "train.betas=[0.9, .nan]"])
def test_non_finite_recipe_numbers_are_refused(override):
    with pytest.raises(UserError, match="Input should be a finite number"):
        load_recipe(ROOT / "recipes/tiny.yaml", [override])


def test_missing_and_malformed_recipe(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_recipe(bad)


def test_cli_error_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dflash_train.train", "train.lrr=1",
                        f"output_dir={tmp_path / 'out'}"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: recipe 'recipes/tiny.yaml': unknown key 'train.lrr'"]
    assert not (tmp_path / "out").exists()


def test_the_default_recipe_and_shipped_ones_load_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_recipe().model.target == "data/tiny-target"  # resolved by training (from the checkout)
    assert load_recipe("recipes/qwen3-8b.yaml").model.target == "Qwen/Qwen3-8B"
    with pytest.raises(UserError, match="recipe 'recipes/nope.yaml' not found"):
        load_recipe("recipes/nope.yaml")


RECIPE_CASES = {  # recipe text (None: binary bytes) -> the one line it gets
    "duplicated_section": ("loss:\n  position_weight: exp\nloss:\n  position_weight: dpace\n",
                           "key 'loss' appears twice in one mapping"),
    "duplicated_key": ("max_steps: 5\nmax_steps: 6\n", "key 'max_steps' appears twice"),
    "binary": (None, "is not UTF-8 text"),
}


@pytest.mark.parametrize("case", list(RECIPE_CASES))
def test_a_recipe_that_yaml_would_read_wrongly_is_one_line(case, tmp_path):
    text, fragment = RECIPE_CASES[case]
    recipe = tmp_path / "r.yaml"
    if text is None:
        recipe.write_bytes(bytes(range(256)) * 8)
    else:
        recipe.write_text(text)
    with pytest.raises(UserError, match=fragment):
        load_recipe(recipe)


def test_a_recipe_folder_is_named_as_a_folder(tmp_path):
    with pytest.raises(UserError, match="is a folder: give a recipe .yaml file"):
        load_recipe(tmp_path)


@pytest.mark.parametrize("overrides, fragment", [
    (["model.variant=dflash2", "tree_distill.weight=1.0", "tree_distill.every=50", "max_steps=10"],
     "tree_distill.every=50 is past max_steps=10: no step would ever distil"),
    (["model.variant=dflash2", "tree_distill.weight=1.0", "tree_distill.budget=100000"],
     "'tree_distill.budget': Input should be less than or equal to 4096"),
    (["eval.ddtree_budgets=[4, 4]"], "eval.ddtree_budgets [4, 4] names a budget twice"),
])
def test_schedules_and_budgets_that_cannot_work_are_refused(overrides, fragment):
    with pytest.raises(UserError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        load_recipe(ROOT / "recipes/tiny.yaml", overrides)
    # the same schedule that can run is fine
    load_recipe(ROOT / "recipes/tiny.yaml", ["model.variant=dflash2", "tree_distill.weight=1.0",
                                             "tree_distill.every=10", "max_steps=10"])


def test_each_variants_keys_come_from_its_file_after_the_common_ones():
    """ModelConfig and LossConfig gather each variant's model_keys / loss_keys (declared in its file, with
    their recipe defaults) after the keys every variant reads, in registry order: the saved recipe's order."""
    from dflash_train.model.variants import VARIANTS
    from dflash_train.training.config import LossConfig, LossKeys, ModelConfig, ModelKeys

    for config, core, part in [(ModelConfig, ModelKeys, "model_keys"), (LossConfig, LossKeys, "loss_keys")]:
        theirs = [k for v in VARIANTS.values() if getattr(v, part) for k in getattr(v, part).model_fields]
        own = [k for k in config.model_fields if k not in core.model_fields and k not in theirs]
        assert list(config.model_fields) == [*core.model_fields, *theirs, *own]
        for v in VARIANTS.values():
            for k, f in (getattr(v, part).model_fields.items() if getattr(v, part) else ()):
                assert getattr(config(), k) == f.default
    assert list(ModelConfig.model_fields)[-1] == "draft_vocab_size"
    assert ModelConfig().markov_rank == 256 and LossConfig().consistency_passes == 3  # recipe defaults
    with pytest.raises(UserError, match=r"'model.markov_rank': Input should be greater than or equal to 0"):
        load_recipe(ROOT / "recipes/tiny.yaml", ["model.markov_rank=-1"])  # a variant's key keeps its bounds
    with pytest.raises(UserError, match="unknown key 'model.markov_rnk'"):
        load_recipe(ROOT / "recipes/tiny.yaml", ["model.markov_rnk=4"])


def test_the_variant_is_one_of_the_registry():
    with pytest.raises(UserError, match=r"^recipe '.*': 'model.variant': Input should be 'dflash', 'dspark', "
                                        r"'dflash2' or 'xpress' \(got 'eagle'\)$"):
        load_recipe(ROOT / "recipes/tiny.yaml", ["model.variant=eagle"])
