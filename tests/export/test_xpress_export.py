"""XPress training outputs and their Speculators export: loaded by speculators' own XPressDraftModel with
our refined logits, read back exactly, a card that says no released vLLM serves it and what to run."""

import json

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from conftest import TINY_TARGET
from dflash_train.checkpoint.folders import load_drafter
from dflash_train.cli.export import main
from helpers.xpress import our_blocks, speculators_forward

REFINER = {f"refiner_head.{k}" for k in ("token_embed.weight", "down_h.weight", "down_g.weight",
                                         "in_proj.weight", "mix_l", "mlp_gate.weight", "mlp_up.weight",
                                         "mlp_down.weight", "readout.weight")}


@pytest.fixture(scope="module")
def trained_xpress(tmp_path_factory, small_data):
    """An XPress drafter trained a few steps (the tiny recipe's backbone, a rank-16 refiner)."""
    from dflash_train.cli.train import main as train_main

    out = tmp_path_factory.mktemp("xpress") / "run"
    train_main([f"output_dir={out}", "max_steps=3", "model.variant=xpress", "model.xpress_rank=16",
                "model.num_jacobi_passes=5", "model.block_size=6",
                f"data.train={small_data / 'train.jsonl'}", f"data.val={small_data / 'val.jsonl'}",
                "train.batch_size=8", "eval.max_samples=8", "eval.ddtree_budgets=[4, 16]",
                "checkpoint_every=0"])
    return out


@pytest.fixture(scope="module")
def exported(trained_xpress, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "spec"
    main(["--format", "speculators", "--checkpoint", str(trained_xpress / "final"), "--output", str(out)])
    return out


def test_training_reports_xpress_terms(trained_xpress):
    last = [json.loads(line) for line in (trained_xpress / "metrics.jsonl").read_text().splitlines()][-1]
    assert set(last["val_terms"]) == {"ce", "consistency", "base_anchor"}
    drafter, _ = load_drafter(trained_xpress / "final")
    assert drafter.config.variant == "xpress" and drafter.refiner_head is not None
    assert all(torch.isfinite(p).all() for p in drafter.parameters())


@torch.no_grad()
def test_export_loads_in_speculators_with_our_logits(exported, trained_xpress, tiny_target, monkeypatch):
    from speculators import SpeculatorModel
    from speculators.models.xpress import XPressDraftModel, XPressSpeculatorConfig

    config = XPressSpeculatorConfig.from_pretrained(str(exported))
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention is for training on GPU
    spec = SpeculatorModel.from_pretrained(str(exported), config=config, verifier=str(TINY_TARGET)).eval()
    assert isinstance(spec, XPressDraftModel)
    ours, _ = load_drafter(trained_xpress / "final")
    ours.eval()
    theirs = spec.state_dict()
    for k, v in ours.state_dict().items():  # every saved tensor loaded as written
        assert torch.equal(theirs[k], v), k
    # speculators 0.9.0's from_pretrained (transformers 5, meta-device init) leaves the non-persistent
    # mask buffer as uninitialised memory; the card says to set it (speculators PR #1061 adds the re-init)
    B = ours.config.block_size
    spec.refiner_head.causal_tril.copy_(torch.tril(torch.ones(B, B)))
    c = spec.config
    assert (c.xpress_rank, c.xpress_mlp_ratio, c.num_jacobi_passes, c.sample_from_anchor) == (16, 2, 5, False)
    assert c.speculators_model_type == "xpress" and c.speculators_config.algorithm == "xpress"
    assert c.draft_vocab_size == ours.config.vocab_size and c.block_size == ours.config.block_size
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, 28))
    anchors = torch.tensor([4, 11, 18])
    tf, _, base = speculators_forward(spec, tiny_target, ids, anchors, monkeypatch)
    o = our_blocks(ours, tiny_target, ids, anchors)
    ours_base = tiny_target.lm_head(o.draft_hidden[0])
    torch.testing.assert_close(ours_base + ours.refiner_head.readout(o.heads["y"][0]), tf[:, 1:], rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(ours_base, base[:, 1:], rtol=1e-5, atol=1e-5)


def test_export_round_trip_is_exact(exported, trained_xpress):
    original, _ = load_drafter(trained_xpress / "final")
    imported, meta = load_drafter(exported)
    assert meta["format"] == "speculators" and imported.config == original.config
    for k, v in original.state_dict().items():
        assert torch.equal(imported.state_dict()[k], v), k
    # speculators' names, nothing of the verifier's, the mixer's mask not saved
    keys = set(load_file(exported / "model.safetensors"))
    assert {k for k in keys if k.startswith("refiner_head.")} == REFINER
    assert not any(k.startswith(("embed_tokens", "lm_head", "verifier_")) for k in keys)


def test_card_says_which_vllm_serves_it(exported):
    card = ModelCard.load(exported / "README.md")
    assert "xpress" in card.data.tags
    text = card.text
    assert "# XPress drafter for" in text and "causal refiner" in text and "Jacobi" in text
    assert "An **XPress** drafter" in text  # not "A **XPress**"
    assert ("No released vLLM serves XPress" in text and "PR #54448" in text
            and "dflash-eval --drafter" in text)
    assert "consistency rounds" in text and "vllm serve" not in text
    assert "causal_tril" in text  # speculators 0.9.0's loading leaves it uninitialised


def test_native_format_is_refused_for_xpress(trained_xpress, tmp_path, capsys):
    out = tmp_path / "native"
    with pytest.raises(SystemExit) as e:
        main(["--format", "dflash", "--checkpoint", str(trained_xpress / "final"), "--output", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error:") and "--format speculators" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
