"""Attention that shares grouped K/V heads (enable_gqa) instead of copying them: the same logits and
hidden states as transformers' sdpa, bit for bit, for a prefill and for masked tree verifies."""

import torch
from transformers import DynamicCache

from dflash_train.decoding.ddtree import build_tree, root_only_tree
from dflash_train.decoding.decode import verify
from dflash_train.model import gqa_attention
from dflash_train.model.gqa_attention import use_gqa_sdpa


def forwards(target, ids):
    """Prefill, then a root-only, a 4-node and a 12-node tree verified after it (each cropped away)."""
    cache, outs = DynamicCache(config=target.model.config), []
    g = torch.Generator().manual_seed(0)
    trees = [root_only_tree()] + [build_tree(torch.randn(7, 50, generator=g), b) for b in (4, 12)]
    with torch.no_grad():
        out = target.model(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        outs += [out.logits, *out.hidden_states]
        for tree in trees:
            logits, hidden = verify(target, cache, tree, 7, ids.shape[1], True)
            outs += [logits, *hidden]
            cache.crop(-(tree.size + 1))
    return outs


def test_shared_kv_heads_give_sdpas_bits(tiny_target, monkeypatch):
    config = tiny_target.model.config
    assert config.num_key_value_heads < config.num_attention_heads  # the tiny target is GQA: the path runs
    ids = torch.randint(0, config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(1))
    want = forwards(tiny_target, ids)
    calls = []
    real = gqa_attention.F.scaled_dot_product_attention
    monkeypatch.setattr(gqa_attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k.get("enable_gqa")) or real(*a, **k))
    assert use_gqa_sdpa(tiny_target.model)
    try:
        got = forwards(tiny_target, ids)
    finally:
        tiny_target.model.set_attn_implementation("sdpa")
    assert calls and all(calls)  # the masked forwards went through enable_gqa
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_model_not_on_sdpa_is_left_alone(tiny_target):
    tiny_target.model.set_attn_implementation("eager")
    try:
        assert not use_gqa_sdpa(tiny_target.model)
        assert tiny_target.model.config._attn_implementation == "eager"
    finally:
        tiny_target.model.set_attn_implementation("sdpa")
