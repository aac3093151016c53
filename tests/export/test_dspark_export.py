"""DSpark training outputs and their Speculators export: loaded by speculators as a DSpark model with
our logits, read by vLLM 0.33's own config conversion, a card that serves it as method dspark."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from conftest import TINY_TARGET
from fetch_vllm import DEST
from dflash_train.checkpoint.folders import load_drafter, save_drafter
from dflash_train.cli.export import main
from helpers.dspark import our_block_logits, random_dspark, speculators_block_logits

# vLLM 0.33's speculators config conversion, from tests/fetch_vllm.py's copy (DFLASH_VLLM_SRC);
# algos.py imports nothing, so it loads standalone
ALGOS = Path("vllm") / "transformers_utils" / "configs" / "speculators" / "algos.py"
VLLM_ALGOS = DEST / ALGOS


@pytest.fixture(scope="module")
def trained_dspark(tmp_path_factory, small_data):
    """A DSpark drafter trained a few steps (the tiny recipe's backbone, a rank-16 vanilla head)."""
    from dflash_train.cli.train import main as train_main

    out = tmp_path_factory.mktemp("dspark") / "run"
    train_main([f"output_dir={out}", "max_steps=3", "model.variant=dspark", "model.markov_rank=16",
                f"data.train={small_data / 'train.jsonl'}", f"data.val={small_data / 'val.jsonl'}",
                "train.batch_size=8", "eval.max_samples=8", "eval.ddtree_budgets=[4, 16]",
                "checkpoint_every=0"])
    return out


@pytest.fixture(scope="module")
def exported(trained_dspark, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "spec"
    main(["--format", "speculators", "--checkpoint", str(trained_dspark / "final"), "--output", str(out)])
    return out


def test_training_reports_dspark_diagnostics(trained_dspark):
    records = [json.loads(line) for line in (trained_dspark / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    B = 8
    assert len(last["val_confidence"]["predicted"]) == len(last["val_confidence"]["alpha"]) == B - 1
    assert all(0 <= x <= 1 for x in last["val_confidence"]["predicted"] + last["val_confidence"]["alpha"])
    assert "val_off_spine_acc" in last and "val_on_spine_acc" in last
    summary = json.loads((trained_dspark / "summary.json").read_text())["eval"]
    assert summary["off_spine_nodes"] >= 0 and set(summary["ddtree_tau"]) == {"4", "16"}
    drafter, meta = load_drafter(trained_dspark / "final")
    assert drafter.config.variant == "dspark" and drafter.markov_head is not None
    assert all(torch.isfinite(p).all() for p in drafter.parameters())


@torch.no_grad()
def test_export_loads_in_speculators_with_our_logits(exported, trained_dspark, tiny_target, monkeypatch):
    from speculators import SpeculatorModel
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    config = DSparkSpeculatorConfig.from_pretrained(str(exported))
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention is for training on GPU
    spec = SpeculatorModel.from_pretrained(str(exported), config=config, verifier=str(TINY_TARGET)).eval()
    assert isinstance(spec, DSparkDraftModel)
    ours, _ = load_drafter(trained_dspark / "final")
    ours.eval()
    c = spec.config
    assert (c.markov_rank, c.markov_head_type, c.enable_confidence_head, c.sample_from_anchor) == (
        16, "vanilla", True, False)
    assert c.speculators_config.algorithm == "dspark"
    assert c.speculators_config.proposal_methods[0].speculative_tokens == ours.config.block_size - 1
    ids = torch.randint(0, 1000, (1, 28))
    anchors = torch.tensor([4, 11, 18])
    spec_logits, spec_conf = speculators_block_logits(spec, tiny_target, ids, anchors, monkeypatch)
    logits, conf = our_block_logits(ours, tiny_target, ids, anchors)
    torch.testing.assert_close(logits, spec_logits[:, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conf, spec_conf[:, 1:], rtol=1e-5, atol=1e-5)


def test_export_round_trip_is_exact(exported, trained_dspark):
    original, _ = load_drafter(trained_dspark / "final")
    imported, meta = load_drafter(exported)
    assert meta["format"] == "speculators" and imported.config == original.config
    for k, v in original.state_dict().items():
        assert torch.equal(imported.state_dict()[k], v), k
    heads = {k for k in load_file(exported / "model.safetensors")
             if k.startswith(("markov_head", "confidence_head"))}
    # the names vLLM 0.33's Qwen3DSparkModel defines (DSparkMarkovHead, DSparkConfidenceHead with a bias)
    assert heads == {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                     "confidence_head.proj.weight", "confidence_head.proj.bias"}


@pytest.mark.skipif(not VLLM_ALGOS.is_file(), reason=f"vLLM 0.33 sources not found at {DEST} "
                    "(run python tests/fetch_vllm.py, or set DFLASH_VLLM_SRC)")
def test_vllm_config_conversion_reads_the_export(exported, trained_dspark):
    """vLLM 0.33's own speculators config conversion (algos.py, loaded standalone: it imports
    nothing) turns the export into the Qwen3DSparkModel config our drafter is."""
    spec = importlib.util.spec_from_file_location("vllm_speculators_algos", VLLM_ALGOS)
    algos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(algos)
    config = json.loads((exported / "config.json").read_text())
    ours = load_drafter(trained_dspark / "final")[0].config
    pre = dict(config["transformer_layer_config"])
    algos.SUPPORTED_SPECULATORS_TYPES[config["speculators_model_type"]](config_dict=config,
                                                                        pre_trained_config=pre)
    assert pre["architectures"] == ["Qwen3DSparkModel"]
    assert pre["target_layer_ids"] == ours.target_layer_ids  # vLLM's aux - 1 = our z-lab taps
    assert pre["sample_from_anchor"] is False and pre["dspark_bonus_anchor"] is True
    assert (pre["markov_rank"], pre["markov_head_type"], pre["block_size"], pre["mask_token_id"]) == (
        16, "vanilla", ours.block_size, ours.mask_token_id)
    assert pre["enable_confidence_head"] is True and pre["confidence_head_with_markov"] is True
    assert (pre["hidden_size"], pre["num_hidden_layers"]) == (ours.hidden_size, ours.num_hidden_layers)
    # what vLLM's SpeculatorsConfig reads for the serving method (base.py): method dspark, B-1 tokens
    assert config["speculators_model_type"] == "dspark"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == ours.block_size - 1
    assert config["speculators_config"]["verifier"]["name_or_path"]


def test_vllm_serves_the_export_as_method_dspark(exported, trained_dspark):
    """vLLM 0.33's whole SpeculatorsConfig path (tests/helpers/vllm_reference.py): method dspark with B-1
    tokens, Qwen3DSparkModel, and every draft layer with the in-block attention it was trained with."""
    from helpers.vllm_reference import speculators_conversion, vllm_draft_config, vllm_layer_causal

    ours = load_drafter(trained_dspark / "final")[0].config
    pre, spec = speculators_conversion(exported)
    assert spec == {"method": "dspark", "num_speculative_tokens": ours.block_size - 1}
    assert pre["architectures"] == ["Qwen3DSparkModel"] and pre["markov_rank"] == 16
    config = vllm_draft_config(exported)
    assert ([vllm_layer_causal(config, i) for i in range(ours.num_hidden_layers)] == [False]
            * ours.num_hidden_layers)


def test_card_serves_method_dspark(exported):
    card = ModelCard.load(exported / "README.md")
    assert "dspark" in card.data.tags
    text = card.text
    assert text.startswith("\n# DSpark drafter for") or "# DSpark drafter for" in text
    assert "vllm serve" in text and '"method": "dspark"' in text and "Markov" in text
    assert "confidence head's BCE" in text and "(weight 1.0).." not in text  # one full stop
    assert "implements the vanilla Markov head only" not in text


def test_gated_card_says_vllm_serves_vanilla_only(tiny_target, tmp_path):
    save_drafter(tmp_path / "d", random_dspark(tiny_target, "gated"), tiny_target)
    main(["--format", "speculators", "--checkpoint", str(tmp_path / "d"), "--output", str(tmp_path / "o")])
    assert "implements the vanilla Markov head only" in (tmp_path / "o" / "README.md").read_text()


def test_native_format_is_refused_for_dspark(trained_dspark, tmp_path, capsys):
    out = tmp_path / "native"
    with pytest.raises(SystemExit) as e:
        main(["--format", "dflash", "--checkpoint", str(trained_dspark / "final"), "--output", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error:") and "--format speculators" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
