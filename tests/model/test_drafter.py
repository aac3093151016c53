"""The drafter's two forwards and its attention visibility."""

import dataclasses

import pytest
import torch

from dflash_train.model.drafter import ContextCache, DFlashDrafter
from dflash_train.model.target import target_forward
from dflash_train.training.build import drafter_config_for
from dflash_train.training.config import ModelConfig

B = 8


@pytest.fixture(scope="module")
def setup(tiny_target):
    torch.manual_seed(0)
    cfg = drafter_config_for(tiny_target, ModelConfig(num_layers=2, block_size=B))
    drafter = DFlashDrafter(cfg).eval()
    # random (non-trivial) weights everywhere, norms included, so masks and positions matter
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    return tiny_target, drafter, cfg


def block_logits_train(target, drafter, cfg, ids, anchors):
    """Training forward over all anchored blocks of `ids` [1, T] -> logits [A, B, V]."""
    taps, _ = target_forward(target, ids, torch.ones_like(ids), cfg.target_layer_ids)
    A = anchors.shape[1]
    block = torch.full((1, A, B), cfg.mask_token_id)
    block[:, :, 0] = ids.gather(1, anchors)
    hidden = drafter(target.embed(block.view(1, A * B)), taps, anchors,
                     torch.ones_like(ids, dtype=torch.bool))
    return target.lm_head(hidden).view(A, B, -1)


def block_logits_cached(target, drafter, cfg, ids, anchor, chunks=2):
    """Inference forward: context = taps of tokens < anchor, fed to the cache in pieces."""
    taps, _ = target_forward(target, ids[:, :anchor], torch.ones_like(ids[:, :anchor]), cfg.target_layer_ids)
    cache = ContextCache(cfg.num_hidden_layers)
    bounds = torch.linspace(0, anchor, chunks + 1).long().tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        drafter.extend_context(cache, taps[:, lo:hi], torch.arange(lo, hi)[None])
    assert len(cache) == anchor
    block = torch.full((1, B), cfg.mask_token_id)
    block[0, 0] = ids[0, anchor]
    hidden = drafter.forward_cached(target.embed(block), torch.arange(anchor, anchor + B)[None], cache)
    return target.lm_head(hidden)[0]


@torch.no_grad()
def test_training_and_cached_forward_agree(setup):
    target, drafter, cfg = setup
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (1, 40))
    anchors = torch.tensor([[3, 10, 11, 25, 31]])
    train = block_logits_train(target, drafter, cfg, ids, anchors)
    for j, a in enumerate(anchors[0].tolist()):
        cached = block_logits_cached(target, drafter, cfg, ids, a, chunks=3)
        torch.testing.assert_close(train[j], cached, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_cache_crop_drops_rejected_context(setup):
    """Cropping queued or already cached context gives the block the same logits as a cache
    that never held the rejected tokens."""
    target, drafter, cfg = setup
    ids = torch.randint(0, 1000, (1, 30))
    taps, _ = target_forward(target, ids, torch.ones_like(ids), cfg.target_layer_ids)
    block = target.embed(torch.full((1, B), cfg.mask_token_id))
    positions = torch.arange(22, 22 + B)[None]

    fresh = ContextCache(cfg.num_hidden_layers)
    drafter.extend_context(fresh, taps[:, :22], torch.arange(22)[None])
    expected = drafter.forward_cached(block, positions, fresh)

    queued = ContextCache(cfg.num_hidden_layers)  # rejected tokens still queued
    drafter.extend_context(queued, taps[:, :20], torch.arange(20)[None])
    drafter.extend_context(queued, taps[:, 20:26], torch.arange(20, 26)[None])  # 6 tokens, 4 then rejected
    queued.crop(22)
    assert len(queued) == 22
    torch.testing.assert_close(drafter.forward_cached(block, positions, queued), expected)

    cached = ContextCache(cfg.num_hidden_layers)  # rejected tokens already projected into the cache
    drafter.extend_context(cached, taps[:, :26], torch.arange(26)[None])
    drafter.forward_cached(block, torch.arange(26, 26 + B)[None], cached)
    cached.crop(22)
    assert len(cached) == 22
    torch.testing.assert_close(drafter.forward_cached(block, positions, cached), expected)
    for k1, k2 in zip(cached.k, fresh.k):
        torch.testing.assert_close(k1, k2)


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_every_layer_uses_its_weights_inside_its_own_forward(setup, variant):
    """What per-layer wrappers (FSDP2 fully_shard, activation checkpointing) need: each layer's
    parameters are only used while that layer's forward runs, in training and in decoding
    (DFlash2: its convolutions' kernel projections too)."""
    target, drafter, cfg = setup
    if variant == "dflash2":
        cfg = drafter_config_for(target, ModelConfig(num_layers=2, block_size=B, variant="dflash2"))
        drafter = DFlashDrafter(cfg).eval()
        assert any("kernel_projection" in n for n, _ in drafter.layers[0].named_modules())
    inside, outside_uses = set(), []
    hooks = []
    for i, layer in enumerate(drafter.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: inside.add(i)))
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: inside.discard(i)))
        for name, mod in layer.named_modules():
            if isinstance(mod, torch.nn.Linear):
                hooks.append(mod.register_forward_pre_hook(
                    lambda m, a, i=i, name=name: None if i in inside else outside_uses.append((i, name))))
    try:
        ids = torch.randint(0, 1000, (1, 24))
        with torch.no_grad():
            block_logits_train(target, drafter, cfg, ids, torch.tensor([[3, 12]]))
            block_logits_cached(target, drafter, cfg, ids, 12, chunks=2)
    finally:
        for h in hooks:
            h.remove()
    assert outside_uses == []


@torch.no_grad()
def test_block_sees_exactly_its_visible_range(setup):
    """A block anchored at a sees tokens < a through the taps and token a as its slot 0;
    changing any later token leaves its logits unchanged, changing a visible one does not."""
    target, drafter, cfg = setup
    torch.manual_seed(2)
    ids = torch.randint(0, 1000, (1, 32))
    anchors = torch.tensor([[6, 14, 20]])
    base = block_logits_train(target, drafter, cfg, ids, anchors)
    a = 14
    for pos, visible in [(a + 1, False), (a + 5, False), (31, False), (a, True), (a - 1, True), (0, True)]:
        changed = ids.clone()
        changed[0, pos] = (changed[0, pos] + 17) % 1000
        new = block_logits_train(target, drafter, cfg, changed, anchors)
        differs = not torch.allclose(new[1], base[1], atol=1e-5)
        assert differs == visible, f"token {pos} for anchor {a}: differs={differs}"
        if pos > 20:  # also invisible to the block at 20; visible to none before it
            assert torch.allclose(new[2], base[2], atol=1e-5)


@torch.no_grad()
def test_blocks_never_see_each_other(setup):
    """A block's logits are the same whether other blocks share the pass or not."""
    target, drafter, cfg = setup
    ids = torch.randint(0, 1000, (1, 36))
    together = block_logits_train(target, drafter, cfg, ids, torch.tensor([[5, 9, 12, 20]]))
    for j, a in enumerate([5, 9, 12, 20]):
        alone = block_logits_train(target, drafter, cfg, ids, torch.tensor([[a]]))
        torch.testing.assert_close(together[j], alone[0], rtol=1e-5, atol=1e-5)


def test_drafter_state_is_only_its_own_weights(setup):
    """Embeddings and LM head are the target's: not in the drafter's state, not trainable copies."""
    target, drafter, cfg = setup
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    expected_top = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert expected_top <= names
    per_layer = {"input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    assert (names == expected_top | {f"layers.{i}.{n}" for i in range(cfg.num_hidden_layers)
                                     for n in per_layer})
    target_ptrs = {p.data_ptr() for p in target.model.parameters()}
    assert not any(p.data_ptr() in target_ptrs for p in drafter.parameters())
    assert drafter.fc.weight.shape == (cfg.hidden_size, len(cfg.target_layer_ids) * cfg.hidden_size)


@torch.no_grad()
def test_block_forward_equals_speculators_layers(setup):
    """Independent reference: speculators' own DFlash decoder layers, loaded with our weights,
    give the same block hidden states (context = fused taps, block attends to all of it)."""
    spec = pytest.importorskip("speculators.models.dflash.model_definitions")
    target, drafter, cfg = setup
    qcfg = cfg.qwen3_config()
    qcfg._attn_implementation = "sdpa"
    layers = torch.nn.ModuleList(spec.Qwen3DFlashDecoderLayer(qcfg, i) for i in range(cfg.num_hidden_layers))
    layers.load_state_dict({k[len("layers."):]: v for k, v in drafter.state_dict().items()
                            if k.startswith("layers.")})
    layers.eval()

    ids = torch.randint(0, 1000, (1, 21))
    a = 13
    taps, _ = target_forward(target, ids[:, :a], torch.ones_like(ids[:, :a]), cfg.target_layer_ids)
    block = torch.full((1, B), cfg.mask_token_id)
    block[0, 0] = ids[0, a]
    x = target.embed(block)

    ctx = drafter.hidden_norm(drafter.fc(taps))
    positions = torch.arange(a + B)[None]  # context 0..a-1, then the block a..a+B-1
    pos_emb = drafter.rotary_emb(x, positions)
    h = x
    for layer in layers:
        h = layer(target_hidden=ctx, hidden_states=h, attention_mask=None, position_embeddings=pos_emb)
    reference = drafter.norm(h)

    cache = ContextCache(cfg.num_hidden_layers)
    drafter.extend_context(cache, taps, torch.arange(a)[None])
    ours = drafter.forward_cached(x, torch.arange(a, a + B)[None], cache)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_flex_block_mask_equals_the_dense_mask(causal):
    from torch.nn.attention.flex_attention import create_mask

    from dflash_train.model.drafter import anchored_block_block_mask, anchored_block_mask

    anchors = torch.tensor([[3, 10, 11, 25], [0, 5, 6, 7]])
    ctx_valid = torch.ones(2, 30, dtype=torch.bool)
    ctx_valid[1, 20:] = False  # padding
    flex = anchored_block_block_mask(anchors, ctx_valid, 4, causal)
    dense = anchored_block_mask(anchors, ctx_valid, 4, causal)
    assert torch.equal(create_mask(flex.mask_mod, 2, 1, 16, 46, device="cpu"), dense)
    in_block = dense[0, 0, 4:8, 30 + 4 : 30 + 8]  # block 1's slots against block 1's slots
    assert torch.equal(in_block, torch.tril(torch.ones(4, 4, dtype=torch.bool)) if causal
                       else torch.ones(4, 4, dtype=torch.bool))


@pytest.fixture(scope="module")
def causal_setup(setup):
    target, drafter, cfg = setup
    causal_cfg = dataclasses.replace(cfg, block_attention="causal")
    causal = DFlashDrafter(causal_cfg).eval()
    causal.load_state_dict(drafter.state_dict())
    return target, causal, causal_cfg


@torch.no_grad()
@pytest.mark.parametrize("mode", ["bidirectional", "causal"])
def test_causal_block_slot_sees_only_earlier_slots(setup, causal_setup, mode):
    """Causal: changing block slot j changes no slot i < j (and changes slot j itself);
    bidirectional: it changes the earlier slots too. Other blocks never change."""
    target, drafter, cfg = causal_setup if mode == "causal" else setup
    ids = torch.randint(0, 1000, (1, 30))
    anchors = torch.tensor([[4, 15]])
    taps, _ = target_forward(target, ids, torch.ones_like(ids), cfg.target_layer_ids)
    block = torch.full((1, 2, B), cfg.mask_token_id)
    block[:, :, 0] = ids.gather(1, anchors)
    embeds = target.embed(block.view(1, 2 * B))
    ones = torch.ones_like(ids, dtype=torch.bool)
    base = drafter(embeds, taps, anchors, ones).view(2, B, -1)
    j = 5
    changed = embeds.clone()
    changed[0, B + j] += 0.5  # block 1, slot j
    new = drafter(changed, taps, anchors, ones).view(2, B, -1)
    torch.testing.assert_close(new[0], base[0])
    assert not torch.allclose(new[1, j], base[1, j])
    earlier_same = torch.allclose(new[1, :j], base[1, :j], atol=1e-6)
    assert earlier_same == (mode == "causal")


@torch.no_grad()
def test_causal_training_and_cached_forward_agree(causal_setup):
    target, drafter, cfg = causal_setup
    ids = torch.randint(0, 1000, (1, 40))
    anchors = torch.tensor([[3, 17, 30]])
    train = block_logits_train(target, drafter, cfg, ids, anchors)
    for j, a in enumerate(anchors[0].tolist()):
        torch.testing.assert_close(train[j], block_logits_cached(target, drafter, cfg, ids, a, chunks=2),
                                   rtol=1e-4, atol=1e-4)


def test_flex_training_forward_matches_sdpa(setup):
    """The flex path (compiled on CUDA; eager here) gives the SDPA path's outputs, and on CUDA its
    gradients (flex attention has no backward on CPU)."""
    target, drafter, cfg = setup
    grads = torch.cuda.is_available()
    ids = torch.randint(0, 1000, (2, 24))
    anchors = torch.tensor([[2, 9, 15], [4, 5, 12]])
    taps, _ = target_forward(target, ids, torch.ones_like(ids), cfg.target_layer_ids)
    block = torch.full((2, 3, B), cfg.mask_token_id)
    block[:, :, 0] = ids.gather(1, anchors)
    embeds = target.embed(block.view(2, 3 * B))
    results = []
    for flex in [False, True]:
        drafter.zero_grad()
        drafter.flex_attention = flex
        with torch.set_grad_enabled(grads):
            out = drafter(embeds.detach(), taps, anchors, torch.ones_like(ids, dtype=torch.bool))
        if grads:
            out.square().mean().backward()
            results.append((out.detach(), drafter.fc.weight.grad.clone(),
                            drafter.layers[0].self_attn.q_proj.weight.grad.clone()))
        else:
            results.append((out,))
    drafter.flex_attention = False
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_drafter_config_and_its_schemas_gather_each_variants_fields():
    """DrafterConfig, config.json's schema (DrafterFields, field for field, same defaults) and the Speculators
    schema take each variant's fields from its file (Variant.drafter_keys, speculators_keys), in registry
    order after the backbone's; the draft vocabulary last. recipe_fields: the keys the recipe names alike."""
    from dflash_train.checkpoint.formats import BackboneFields, DrafterFields, SpeculatorsFile
    from dflash_train.model.drafter import BackboneConfig, DrafterConfig
    from dflash_train.model.variants import VARIANTS

    variant_fields = [k for v in VARIANTS.values() if v.drafter_keys for k in v.drafter_keys.model_fields]
    names = [f.name for f in dataclasses.fields(DrafterConfig)]
    backbone = [f.name for f in dataclasses.fields(BackboneConfig)]
    assert names == [*backbone, *variant_fields, "draft_vocab_size"]
    assert list(DrafterFields.model_fields) == names and list(BackboneFields.model_fields) == backbone
    for f in dataclasses.fields(DrafterConfig):
        if f.default is not dataclasses.MISSING:
            assert DrafterFields.model_fields[f.name].default == f.default, f.name
    assert DrafterConfig.__dataclass_fields__["markov_rank"].default == 0  # off unless DSpark
    for v in VARIANTS.values():
        assert set(v.speculators_keys.model_fields if v.speculators_keys else ()) <= set(
            SpeculatorsFile.model_fields)
    assert {name: v.recipe_fields for name, v in VARIANTS.items()} == {
        "dflash": (), "dspark": ("markov_rank", "markov_head_type", "confidence_head"),
        "dflash2": ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
        "xpress": ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes")}
