"""DFlash2 in the Speculators format: our export loads in speculators as a DFlash2DraftModel with
our logits and selector scores, round-trips exactly, is read by vLLM 0.33's own config conversion
as DFlash2DraftModel with the trained attention; speculators-written DFlash2 checkpoints import."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_TARGET
from dflash_train.checkpoint.folders import load_drafter, save_drafter
from dflash_train.cli.export import main
from dflash_train.model.drafter import ContextCache, DFlashDrafter
from dflash_train.model.target import target_forward
from dflash_train.model.variants import dflash2
from helpers.dflash2 import dflash2_config, randomize


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("dflash2") / "final"
    save_drafter(out, randomize(DFlashDrafter(dflash2_config(tiny_target))), tiny_target)
    return out


@pytest.fixture(scope="module")
def exported(drafter_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "spec"
    main(["--format", "speculators", "--checkpoint", str(drafter_dir), "--output", str(out)])
    return out


def our_block(drafter, target, ids, a):
    """hidden [B, H] and unary logits [B, V] of the block anchored at a (context: tokens < a)."""
    cfg = drafter.config
    taps, _ = target_forward(target, ids[:, :a], torch.ones_like(ids[:, :a]), cfg.target_layer_ids)
    cache = ContextCache(cfg.num_hidden_layers)
    drafter.extend_context(cache, taps, torch.arange(a)[None])
    block = torch.full((1, cfg.block_size), cfg.mask_token_id)
    block[0, 0] = ids[0, a]
    hidden = drafter.forward_cached(target.embed(block), torch.arange(a, a + cfg.block_size)[None], cache)[0]
    return hidden, target.lm_head(hidden)


def speculators_block(spec, target, ids, a):
    """The same block through speculators' own modules: its fc, layers (with their convolutions),
    norm and heads; speculators indexes the target's hidden states by its aux ids (no +1)."""
    c = spec.config
    out = target.model.get_decoder()(input_ids=ids[:, :a], output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i] for i in c.aux_hidden_state_layer_ids], -1)
    block = torch.full((1, c.block_size), c.mask_token_id)
    block[0, 0] = ids[0, a]
    ctx = spec.hidden_norm(spec.fc(taps))
    x = spec.embed_tokens(block)
    pos_emb = spec.rotary_emb(x, torch.arange(a + c.block_size)[None])
    for layer in spec.layers:
        x = layer(target_hidden=ctx, hidden_states=x, attention_mask=None, position_embeddings=pos_emb)
    hidden = spec.norm(x)[0]
    return hidden, spec.lm_head(hidden)


@torch.no_grad()
def test_export_loads_in_speculators_with_our_logits(exported, drafter_dir, tiny_target):
    from speculators import SpeculatorModel
    from speculators.models.dflash2 import DFlash2DraftModel

    spec = SpeculatorModel.from_pretrained(str(exported), verifier=str(TINY_TARGET)).eval()
    # flex attention is for training on GPU
    spec.config.transformer_layer_config._attn_implementation = "sdpa"
    assert isinstance(spec, DFlash2DraftModel)
    ours, _ = load_drafter(drafter_dir)
    ours.eval()
    c = spec.config
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (2, 16, 16, 8)
    assert c.speculators_config.algorithm == "dflash2" and c.sample_from_anchor is False
    assert c.sliding_window_non_causal is True  # bidirectional blocks, speculators' DFlash2 default
    assert c.speculators_config.proposal_methods[0].speculative_tokens == ours.config.block_size - 1
    ids = torch.randint(0, 1000, (1, 30))
    for a in (9, 17):
        spec_hidden, spec_logits = speculators_block(spec, tiny_target, ids, a)
        hidden, logits = our_block(ours, tiny_target, ids, a)
        torch.testing.assert_close(logits, spec_logits, rtol=1e-5, atol=1e-5)
        # the selector: speculators' select() against our edge table, predecessor = each candidate
        candidates, edges = dflash2.edge_scores(ours.candidate_selector, hidden[1:], logits[1:],
                                                int(ids[0, a]))
        for t in range(1, candidates.shape[0]):
            for p, before in enumerate(candidates[t - 1].tolist()):
                ids_t, scores = spec.candidate_selector.select(spec_logits[t + 1], spec_hidden[t + 1],
                                                               torch.tensor(before))
                assert torch.equal(ids_t, candidates[t])
                torch.testing.assert_close(edges[t, p], scores, rtol=1e-5, atol=1e-5)


def test_export_round_trip_is_exact(exported, drafter_dir):
    original, _ = load_drafter(drafter_dir)
    imported, meta = load_drafter(exported)
    assert meta["format"] == "speculators" and imported.config == original.config
    for k, v in original.state_dict().items():
        assert torch.equal(imported.state_dict()[k], v), k
    names = set(load_file(exported / "model.safetensors"))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.1.mlp_conv.kernel_projection.weight"} <= names
    assert not {n for n in names if "embed" in n or "lm_head" in n or "verifier" in n}


@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_vllm_reads_the_export_as_dflash2(attention, drafter_dir, tiny_target, tmp_path):
    """vLLM 0.33's own conversion (tests/helpers/vllm_reference.py): DFlash2DraftModel served as method dflash
    with B-1 tokens, our taps, the convolution and selector fields, and every draft layer with the
    in-block attention the drafter was trained with."""
    import dataclasses

    from helpers.vllm_reference import speculators_conversion, vllm_draft_config, vllm_layer_causal

    drafter, _ = load_drafter(drafter_dir)
    source = drafter_dir
    if attention == "causal":
        causal = DFlashDrafter(dataclasses.replace(drafter.config, block_attention="causal"))
        causal.load_state_dict(drafter.state_dict())
        source = tmp_path / "causal"
        save_drafter(source, causal, tiny_target)
    main(["--format", "speculators", "--checkpoint", str(source), "--output", str(tmp_path / "o")])
    ours = drafter.config
    pre, spec = speculators_conversion(tmp_path / "o")
    assert spec == {"method": "dflash", "num_speculative_tokens": ours.block_size - 1}
    config = vllm_draft_config(tmp_path / "o")
    assert config.architectures == ["DFlash2DraftModel"]
    d = config.dflash_config
    assert d["target_layer_ids"] == ours.target_layer_ids and d["mask_token_id"] == ours.mask_token_id
    assert ((d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"], d["selector_top_k"])
            == (2, 16, 16, 8))
    assert d["sample_from_anchor"] is False
    assert config.eagle_aux_hidden_state_layer_ids == [k + 1 for k in ours.target_layer_ids]
    layers = ours.num_hidden_layers
    assert [vllm_layer_causal(config, i) for i in range(layers)] == [attention == "causal"] * layers
    assert load_drafter(tmp_path / "o")[0].config.block_attention == attention


def test_native_format_is_refused_for_dflash2(drafter_dir, tmp_path, capsys):
    out = tmp_path / "native"
    with pytest.raises(SystemExit) as e:
        main(["--format", "dflash", "--checkpoint", str(drafter_dir), "--output", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error:") and "--format speculators" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.fixture(scope="module")
def speculators_written(tiny_target, tmp_path_factory):
    """A DFlash2 checkpoint as speculators itself writes one (its config class and save_pretrained;
    no dflash-train keys in config.json), with random weights."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    cfg = dflash2_config(tiny_target)
    layer_config = cfg.qwen3_config()
    layer_config._attn_implementation = "sdpa"
    config = DFlash2SpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=cfg.vocab_size, block_size=cfg.block_size,
        aux_hidden_state_layer_ids=[k + 1 for k in cfg.target_layer_ids], mask_token_id=cfg.mask_token_id,
        selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash2",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=cfg.block_size - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(TINY_TARGET), architectures=["Qwen3ForCausalLM"])))
    torch.manual_seed(1)
    model = DFlash2DraftModel(config)
    randomize(model.layers, seed=2)
    randomize(model.candidate_selector, seed=3)
    out = tmp_path_factory.mktemp("spec-written") / "ckpt"
    model.save_pretrained(str(out))
    return out, model


@torch.no_grad()
def test_speculators_written_checkpoint_imports(speculators_written, tiny_target):
    folder, model = speculators_written
    config = json.loads((folder / "config.json").read_text())
    assert "dflash_train" not in config and "is_causal" not in config["transformer_layer_config"]
    drafter, meta = load_drafter(folder)
    assert meta["format"] == "speculators" and meta["target"]["name_or_path"] == str(TINY_TARGET)
    c = drafter.config
    assert (c.variant, c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (
        "dflash2", 2, 16, 16, 8)
    assert c.block_attention == "bidirectional"  # what speculators trains its full-attention layers with
    theirs = model.state_dict()
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, theirs[k]), k


def test_speculators_written_checkpoint_evaluates_and_fine_tunes(speculators_written, tmp_path, small_data):
    from dflash_train.cli.eval import main as eval_main
    from dflash_train.cli.train import main as train_main

    folder, _ = speculators_written
    eval_main(["--drafter", str(folder), "--limit", "1", "--budgets", "8", "--max-new-tokens", "12",
               "--output", str(tmp_path / "eval")])
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert all(r["lossless"] for r in report["results"] if r["method"] != "ar")
    train_main([f"output_dir={tmp_path / 'ft'}", f"model.init_from={folder}", "model.variant=dflash2",
                "model.selector_rank=16", "model.selector_top_k=8", "max_steps=2", "train.lr=1e-12",
                f"data.train={small_data / 'train.jsonl'}", f"data.val={small_data / 'val.jsonl'}",
                "train.batch_size=4", "eval.max_samples=4"])
    start, end = load_drafter(folder)[0], load_drafter(tmp_path / "ft" / "final")[0]
    assert end.config.variant == "dflash2"
    for k, v in start.state_dict().items():
        torch.testing.assert_close(end.state_dict()[k], v, rtol=0, atol=1e-8)


def test_card_describes_dflash2(exported):
    from huggingface_hub import ModelCard

    card = ModelCard.load(exported / "README.md")
    assert "dflash2" in card.data.tags
    text = card.text
    assert "# DFlash2 drafter for" in text and "A **DFlash2** drafter" in text
    assert "rank-16 candidate selector re-ranks each slot's top-8 tokens" in text
    assert "DFlash2DraftModel, method dflash" in text and "selector walk" in text
