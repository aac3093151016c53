"""Grouped-query attention that shares K/V heads instead of copying them, for decoding on a CPU.

transformers' sdpa attention repeats a GQA model's K/V heads to the query heads (a copy of the layer's
whole KV cache, every layer, every forward) whenever an attention mask is passed, because on CUDA a
masked GQA call would fall back to SDPA's math kernel. Decoding always passes one: a verify forward's
ancestor-only tree mask (plain decoding's root-only tree included). On a CPU, torch's SDPA takes the
mask together with enable_gqa, with the same results bit for bit, and skips the copy: SmolLM2-135M
(9 query / 3 K/V heads), 300 cached tokens, one thread, one layer's attention 250 -> 95 us for a
4-token verify (30 layers a forward).

    from dflash_train.model.gqa_attention import use_gqa_sdpa
    use_gqa_sdpa(target.model)  # -> True when switched (an sdpa model); masks are built as for sdpa

Everything else (no mask, no GQA, a position bias) goes through transformers' own sdpa function.
"""

import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "sdpa_shared_kv"  # not "flash": transformers takes any name holding it for flash attention


def sdpa_gqa(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
             is_causal=None, **kwargs):
    """transformers' attention-function signature: query [b, h, q, d], key / value [b, kv, t, d] ->
    ([b, q, h, d], None)."""
    if attention_mask is None or key.shape[1] == query.shape[1] or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    # with a mask transformers' sdpa is never causal (the mask says it all): the same call, minus the copy
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_gqa_sdpa(model: nn.Module) -> bool:
    """Switch a transformers model that runs sdpa attention to sdpa_gqa. -> whether it was switched."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, sdpa_gqa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # masks exactly as for sdpa
    model.set_attn_implementation(NAME)
    return True
