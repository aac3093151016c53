"""Shipped recipes for real targets and the accelerate / DeepSpeed configs beside them."""

import json

import pytest

from conftest import ROOT
from dflash_train.core.errors import UserError
from dflash_train.model.target import build_target_layer_ids
from dflash_train.training.build import drafter_config_for
from dflash_train.training.config import ModelConfig, load_recipe

ACCEL = ROOT / "recipes" / "accelerate"
# layer counts of the real targets (public configs), to check the recipes' taps against DFlash's rule
LAYERS = {"qwen3-4b": 36, "qwen3-8b": 36, "llama-3.1-8b-instruct": 32, "qwen3-coder-30b-a3b": 48}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_real_target_recipes(name):
    cfg = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    m = cfg.model
    assert (m.num_layers, m.block_size, cfg.loss.gamma, cfg.train.lr) == (5, 16, 7.0, 6e-4)
    assert m.target_layer_ids == build_target_layer_ids(LAYERS[name], m.num_layers)
    assert max(m.target_layer_ids) <= LAYERS[name] - 2  # never the last layer
    assert (m.mask_token_id == 151669) == name.startswith("qwen3")
    assert cfg.data.num_anchors == 512 and cfg.data.max_length == 3072


@pytest.mark.parametrize("name, kind, n", [("single_gpu", "NO", 1), ("ddp", "MULTI_GPU", 8),
                                           ("fsdp", "FSDP", 8), ("deepspeed_zero2", "DEEPSPEED", 8),
                                           ("deepspeed_zero3", "DEEPSPEED", 8)])
def test_accelerate_configs_parse(name, kind, n):
    from accelerate.commands.config.config_args import load_config_from_file

    c = load_config_from_file(str(ACCEL / f"{name}.yaml"))
    assert c.distributed_type.value == kind and c.num_processes == n
    if kind == "FSDP":
        assert c.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "DFlashDecoderLayer"
        from dflash_train.model import drafter as model
        assert hasattr(model, c.fsdp_config["fsdp_transformer_layer_cls_to_wrap"])
    if kind == "DEEPSPEED":
        assert (ROOT / c.deepspeed_config["deepspeed_config_file"]).is_file()


def _fill_auto(node, values: dict, path=""):
    """Replace "auto" the way accelerate does at launch (values by dotted key)."""
    if isinstance(node, dict):
        return {k: _fill_auto(v, values, f"{path}{k}.") for k, v in node.items()}
    return values[path[:-1]] if node == "auto" else node


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_configs_parse(stage):
    pytest.importorskip("deepspeed")
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.config import DeepSpeedConfig

    path = ACCEL / f"ds_zero{stage}.json"
    plugin = DeepSpeedPlugin(hf_ds_config=str(path))
    assert plugin.zero_stage == stage
    H = 4096  # Qwen3-8B's hidden size, as accelerate fills the ZeRO-3 bucket sizes
    filled = _fill_auto(json.loads(path.read_text()), {
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "bf16.enabled": True,
        "zero_optimization.reduce_bucket_size": H * H,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * H * H),
        "zero_optimization.stage3_param_persistence_threshold": 10 * H})
    ds = DeepSpeedConfig(filled)
    assert ds.zero_optimization_stage == stage and ds.gradient_clipping == 1.0 and ds.bfloat16_config.enabled


def test_mask_token_id_for_tokenizers_without_a_mask_token(tiny_target):
    cfg = drafter_config_for(tiny_target, ModelConfig(mask_token="<|nope|>", mask_token_id=1000))
    assert cfg.mask_token_id == 1000
    with pytest.raises(UserError, match="outside the target's embedding table"):
        drafter_config_for(tiny_target, ModelConfig(mask_token_id=5000))
    with pytest.raises(UserError, match="no mask token '<|nope|>'"):
        drafter_config_for(tiny_target, ModelConfig(mask_token="<|nope|>"))


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_dspark_recipes_are_their_dflash_recipe_plus_dspark(name):
    """recipes/*-dspark.yaml: the DFlash recipe beside it with only the DSpark keys, DSpark's
    published objective and the run folder changed."""
    dflash = load_recipe(ROOT / "recipes" / f"{name}.yaml").model_dump()
    dspark = load_recipe(ROOT / "recipes" / f"{name}-dspark.yaml").model_dump()
    assert dspark["model"]["variant"] == "dspark" and dspark["model"]["markov_rank"] == 256
    assert dspark["model"]["markov_head_type"] == "vanilla" and dspark["model"]["confidence_head"]
    assert dspark["output_dir"] == dflash["output_dir"] + "-dspark"
    assert dspark["loss"]["terms"] == {"ce": 0.1, "tv": 0.9} and dspark["loss"]["position_weight"] == "exp"
    assert dspark["loss"]["confidence_weight"] == 1.0
    dspark_keys = {("model", k) for k in ("variant", "markov_rank", "markov_head_type",
                                          "confidence_head")} | {
        ("loss", "terms"), ("loss", "position_weight")}
    for section, values in dflash.items():
        if isinstance(values, dict):
            for k, v in values.items():
                if (section, k) not in dspark_keys:
                    assert dspark[section][k] == v, (section, k)


def test_fsdp_dspark_config_keeps_parameters_unsharded_to_backward():
    from accelerate.commands.config.config_args import load_config_from_file

    c = load_config_from_file(str(ACCEL / "fsdp_dspark.yaml"))
    base = load_config_from_file(str(ACCEL / "fsdp.yaml"))
    assert c.distributed_type.value == "FSDP" and c.fsdp_config["fsdp_reshard_after_forward"] is False
    assert {k: v for k, v in c.fsdp_config.items() if k != "fsdp_reshard_after_forward"} == {
        k: v for k, v in base.fsdp_config.items() if k != "fsdp_reshard_after_forward"}


DFLASH2_KEYS = {("model", k) for k in ("variant", "conv_kernel_size", "conv_group_size", "selector_rank",
                                       "selector_top_k")} | {("loss", "selector_weight")}


@pytest.mark.parametrize("name", ["tiny"] + sorted(LAYERS))
def test_dflash2_recipes_are_their_dflash_recipe_plus_dflash2(name):
    """recipes/*-dflash2.yaml: the DFlash recipe beside it with only the DFlash2 keys (speculators'
    DFlash2 defaults) and the run folder changed."""
    dflash = load_recipe(ROOT / "recipes" / f"{name}.yaml").model_dump()
    dflash2 = load_recipe(ROOT / "recipes" / f"{name}-dflash2.yaml").model_dump()
    m = dflash2["model"]
    assert (m["variant"], m["conv_kernel_size"], m["conv_group_size"], m["selector_rank"],
            m["selector_top_k"]) == (
        "dflash2", 2, 16, 256, 16)
    assert dflash2["loss"]["selector_weight"] == 1.0
    assert dflash2["output_dir"] == dflash["output_dir"] + "-dflash2"
    for section, values in dflash.items():
        if isinstance(values, dict):
            for k, v in values.items():
                if (section, k) not in DFLASH2_KEYS:
                    assert dflash2[section][k] == v, (section, k)


@pytest.mark.parametrize("variant", ["", "-dspark", "-dflash2"])
def test_smollm2_recipes(variant):
    """The real-target recipes (make real-target): taps by DFlash's rule for SmolLM2's 30 layers, the
    mask an existing special token chat never uses, the three variants on one backbone and schedule."""
    base = load_recipe(ROOT / "recipes" / "smollm2-135m.yaml")
    cfg = load_recipe(ROOT / "recipes" / f"smollm2-135m{variant}.yaml")
    m = cfg.model
    assert m.target_layer_ids == build_target_layer_ids(30, m.num_layers) == [1, 27]
    assert m.mask_token == "<empty_output>" and m.mask_token_id is None
    assert m.variant == (variant[1:] or "dflash")
    assert (cfg.max_steps, cfg.train, cfg.data, cfg.loss.terms, m.block_size) == \
        (base.max_steps, base.train, base.data, base.loss.terms, base.model.block_size)


def test_the_continue_recipe_trains_on_from_the_committed_drafter_with_its_shape():
    """recipes/smollm2-135m-continue.yaml starts from checkpoints/smollm2-135m-dflash (model.init_from):
    its model section must describe that drafter (init_drafter refuses any other shape), on the first
    version's held-out rows, with the first recipe's objective."""
    base = load_recipe(ROOT / "recipes" / "smollm2-135m.yaml")
    cfg = load_recipe(ROOT / "recipes" / "smollm2-135m-continue.yaml")
    folder = ROOT / "checkpoints" / "smollm2-135m-dflash"
    assert (ROOT / cfg.model.init_from).resolve() == folder.resolve()
    trained = json.loads((folder / "config.json").read_text())
    m = cfg.model
    assert m.num_layers == trained["transformer_layer_config"]["num_hidden_layers"]
    assert (m.block_size, m.draft_vocab_size) == (trained["block_size"], trained["draft_vocab_size"])
    assert [i + 1 for i in m.target_layer_ids] == trained["aux_hidden_state_layer_ids"]
    assert (m.target_layer_ids, m.mask_token, m.block_size) == (base.model.target_layer_ids,
                                                                base.model.mask_token,
                                                                 base.model.block_size)
    assert cfg.data.val == base.data.val and cfg.data.train != base.data.train
    assert (cfg.loss, cfg.data.max_length, cfg.data.num_anchors) == (base.loss, base.data.max_length,
                                                                     base.data.num_anchors)


def test_the_xpress_recipe_grows_from_the_committed_drafter():
    """recipes/smollm2-135m-xpress.yaml: the continue recipe's drafter shape, data and schedule, variant
    xpress with speculators' XPress objective, from checkpoints/smollm2-135m-dflash (its backbone and
    draft vocabulary; a fresh refiner, checked on the folder itself: no target needed)."""
    import torch

    from dflash_train.checkpoint.folders import load_drafter
    from dflash_train.model.drafter import DFlashDrafter

    cont = load_recipe(ROOT / "recipes" / "smollm2-135m-continue.yaml")
    cfg = load_recipe(ROOT / "recipes" / "smollm2-135m-xpress.yaml")
    m = cfg.model
    assert (m.variant, m.xpress_rank, m.xpress_mlp_ratio, m.num_jacobi_passes) == ("xpress", 256, 2, 6)
    assert m.init_from == cont.model.init_from and (cfg.data, cfg.train) == (cont.data, cont.train)
    for key in ("num_layers", "block_size", "target_layer_ids", "mask_token", "draft_vocab_size"):
        assert getattr(m, key) == getattr(cont.model, key), key
    assert (cfg.loss.terms, cfg.loss.position_weight, cfg.loss.gamma) == ({"ce": 0.1, "tv": 0.9}, "exp", 4.0)
    assert ((cfg.loss.consistency_weight, cfg.loss.consistency_passes, cfg.loss.base_anchor_weight)
            == (0.3, 3, 0.6))
    dflash, _ = load_drafter(ROOT / m.init_from)
    c = dflash.config
    grown = DFlashDrafter(type(c)(**{**c.to_dict(), "variant": "xpress", "xpress_rank": m.xpress_rank,
                                     "xpress_mlp_ratio": m.xpress_mlp_ratio,
                                     "num_jacobi_passes": m.num_jacobi_passes}))
    missing, unexpected = grown.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("refiner_head.") for k in missing)
    assert grown.refiner_head.readout.weight.shape == (m.draft_vocab_size, m.xpress_rank)
    assert torch.equal(grown.t2d, dflash.t2d)


@pytest.mark.parametrize("variant, keys", [
    ("dspark", {("model", "variant"), ("model", "markov_rank"), ("model", "markov_head_type"),
                ("model", "confidence_head"), ("loss", "confidence_weight")}),
    ("dflash2", DFLASH2_KEYS | {("model", "draft_vocab_size")}),
])
def test_the_grow_recipes_are_the_continue_recipe_plus_their_variant(variant, keys):
    """recipes/smollm2-135m-{dspark,dflash2}-grow.yaml, the equal-CPU arms of benchmarks/variants_smollm2.sh:
    the control arm's recipe (the continue recipe) with only the variant's keys and the run folder changed
    (DFlash2 without the draft vocabulary, which it drops), so the arms compare heads, not settings."""
    cont = load_recipe(ROOT / "recipes" / "smollm2-135m-continue.yaml").model_dump()
    grow = load_recipe(ROOT / "recipes" / f"smollm2-135m-{variant}-grow.yaml").model_dump()
    assert grow["model"]["variant"] == variant and grow["output_dir"] == f"runs/smollm2-135m-{variant}-grow"
    assert grow["model"]["draft_vocab_size"] == (None if variant == "dflash2" else 16384)
    for section, values in cont.items():
        if isinstance(values, dict):
            for k, v in values.items():
                if (section, k) not in keys:
                    assert grow[section][k] == v, (section, k)
    m, loss = grow["model"], grow["loss"]
    if variant == "dspark":
        assert (m["markov_rank"], m["markov_head_type"], m["confidence_head"], loss["confidence_weight"]) == (
            256, "vanilla", True, 1.0)
    else:
        assert (m["conv_kernel_size"], m["conv_group_size"], m["selector_rank"], m["selector_top_k"],
                loss["selector_weight"]) == (2, 16, 256, 16, 1.0)


@pytest.mark.skipif(not (ROOT / "data" / "real" / "smollm2-135m-instruct").is_dir(),
                    reason="the real target is not here (make real-target)")
def test_the_xpress_recipe_builds_on_the_real_target():
    """init_drafter on SmolLM2 itself: model.init_from grows the committed DFlash drafter into XPress."""
    from dflash_train.model.target import load_target
    from dflash_train.training.build import init_drafter

    cfg = load_recipe(ROOT / "recipes" / "smollm2-135m-xpress.yaml")
    target = load_target(str(ROOT / cfg.model.target))
    drafter = init_drafter(target,
                           cfg.model.model_copy(update={"init_from": str(ROOT / cfg.model.init_from)}))
    assert drafter.config.variant == "xpress" and drafter.config.draft_vocab_size == 16384
