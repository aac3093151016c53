"""The DFlash drafter: a small non-causal block model conditioned on tapped target states.

Shapes: b batch, t context length, q = block tokens (one block of B at inference, A*B in
training), H hidden size, h/kvh query/key-value heads, d head dim, n number of taps.

How the target's hidden states enter (DFlash, see shared/reference/dflash.md):
    taps [b, t, n*H] --fc (no bias)--> [b, t, H] --hidden_norm--> ctx [b, t, H]
    every layer l:  K/V = [k_norm(k_proj_l(ctx)) + RoPE(ctx positions) ; K/V of the block]
                    Q   = from the block only.
Each layer projects the context K/V inside its own forward (as the reference models do), so
per-layer wrappers (FSDP2's fully_shard, activation checkpointing, per-layer compile) see every
use of a layer's weights inside that layer's call.

In-block attention (`block_attention`): "bidirectional" (DFlash: every slot sees the whole
block) or "causal" (JetSpec-style: slot i sees slots <= i). Context visibility is the same.

Variants (`variant`, dflash_train/model/variants/) add modules to this backbone: DSpark its heads,
DFlash2 (z-lab/inco, speculators `models/dflash2/`) a pair of token-conditioned grouped convolutions
around each sublayer (`dflash2.GroupedDynamicConv`: slot s mixes slots s-k+1..s of its OWN block,
never the previous block, initialised to the identity, so an untrained DFlash2 computes DFlash) and
its candidate selector.

The target's embeddings and LM head are shared and frozen; they are NOT part of this
module (its state_dict is exactly the trainable weights, named as Speculators names
DFlash weights), so the caller embeds the block and applies the LM head. With a draft
vocabulary (`draft_vocab_size`) the drafter carries its own frozen `lm_head` [N, H] (the
target's rows of the N kept tokens) and the d2t / t2d buffers, under speculators' names:
`logits_head` picks the head, `full_logits` scatters draft logits into the target's
vocabulary (-inf elsewhere, as vLLM does), so decoding never proposes a token outside it.
"""

import functools
from dataclasses import asdict, dataclass, field, make_dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from dflash_train.model.variants import VARIANTS, variant_bases
from dflash_train.model.variants.base import Variant
from dflash_train.model.variants.dflash2 import GroupedDynamicConv
from dflash_train.model.vocab import DraftVocab


@dataclass
class BackboneConfig:
    """DrafterConfig's fields every variant has."""
    hidden_size: int  # must equal the target's: the drafter shares its embeddings and LM head
    intermediate_size: int
    num_hidden_layers: int  # drafter layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    block_size: int  # B: [bonus token, MASK x (B-1)]
    mask_token_id: int
    # Target decoder layers tapped, z-lab convention: layer k is read as HF
    # output_hidden_states[k + 1]. Speculators' aux_hidden_state_layer_ids are these + 1.
    target_layer_ids: list[int]
    num_target_layers: int | None  # None when imported from a checkpoint that does not record it
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    attention_bias: bool = False
    # In-block attention: DFlash's bidirectional block, or JetSpec-style causal (slot i sees <= i).
    block_attention: Literal["bidirectional", "causal"] = "bidirectional"
    variant: str = "dflash"  # one of VARIANTS (model/variants/)


def _as_dataclass(keys) -> type:
    """A variant's drafter_keys (a pydantic model, for config.json's schema) as a dataclass for DrafterConfig
    to inherit: the same names, types and defaults."""
    return make_dataclass(keys.__name__, [(k, f.annotation, f.default) for k, f in keys.model_fields.items()])


@dataclass
class DrafterConfig(*map(_as_dataclass, variant_bases("drafter_keys")), BackboneConfig):
    """The backbone's fields, then each variant's (Variant.drafter_keys, declared in its file: its defaults
    when another variant is drafted), then the draft vocabulary."""
    # A draft vocabulary (model/vocab.py): the drafter predicts over N < vocab_size of the target's
    # tokens through its own frozen `lm_head` [N, H] (the target's rows) and maps draft index i to
    # target id i + d2t[i]. None: the full vocabulary through the target's own head.
    draft_vocab_size: int | None = None

    def qwen3_config(self) -> Qwen3Config:
        """The Qwen3 config the drafter's layers are built from (Speculators' transformer_layer_config)."""
        return Qwen3Config(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters), attention_bias=self.attention_bias,
            tie_word_embeddings=False,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d]; cos/sin [b, s, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DFlashAttention(nn.Module):
    def __init__(self, c: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # its slot in a ContextCache
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=c.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=c.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, H] -> k, v [b, kvh, s, d]; k normed and rotated at x's positions."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, rope, ctx, ctx_rope, mask, cache: "ContextCache | None" = None):
        """x [b, q, H] (block, normed), rope = (cos, sin) [b, q, d] at the block's positions;
        ctx [b, t, H] fused context at ctx_rope's positions (training: the whole sequence;
        inference: the tokens accepted since the last pass, t may be 0); with `cache`, ctx's
        K/V are appended to this layer's cached context and the block attends to all of it.
        mask [b, 1, q, t+q] bool, a flex BlockMask of the same visibility, or None (all visible)."""
        b, q_len, _ = x.shape
        cos, sin = rope
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.project_kv(x, cos, sin)
        ctx_k, ctx_v = self.project_kv(ctx, *ctx_rope)  # [b, kvh, t, d]
        if cache is not None:
            ctx_k, ctx_v = cache.update(self.layer_idx, ctx_k, ctx_v)
        k = torch.cat([ctx_k, k_blk], dim=2)  # [b, kvh, t+q, d]
        v = torch.cat([ctx_v, v_blk], dim=2)
        if isinstance(mask, BlockMask):  # block-sparse training mask: only visible tiles are computed
            attend = _compiled_flex_attention() if q.is_cuda else flex_attention  # eager on CPU: tests only
            out = attend(q, k, v, block_mask=mask, enable_gqa=self.kv_heads != self.heads)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer whose attention also sees the context K/V (projected here, by this
    layer); for DFlash2 each sublayer runs between the two sides of its GroupedDynamicConv."""

    def __init__(self, c: Qwen3Config, layer_idx: int, conv: tuple[int, int, int] | None = None):
        """conv: DFlash2's (block_size, kernel_size, group_size), None for DFlash."""
        super().__init__()
        self.self_attn = DFlashAttention(c, layer_idx)
        self.mlp = Qwen3MLP(c)
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None
        if conv is not None:
            self.attention_conv = GroupedDynamicConv(c.hidden_size, *conv)
            self.mlp_conv = GroupedDynamicConv(c.hidden_size, *conv)

    def forward(self, x, rope, ctx, ctx_rope, mask, cache: "ContextCache | None" = None):
        if self.attention_conv is None:
            x = x + self.self_attn(self.input_layernorm(x), rope, ctx, ctx_rope, mask, cache)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, rope, ctx, ctx_rope, mask, cache), delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), delta)


class ContextCache:
    """Per-layer K/V of the fused context for inference; grows with accepted tokens, can be cropped.

    `extend_context` queues the fused context of newly accepted tokens; the next draft pass
    hands it to every layer, which projects it with its own k/v weights and appends it here.
    Only context lives here: the block's own K/V are recomputed every draft pass, which is
    what DFlash's `crop(start)` after each pass amounts to.
    """

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ctx [b, s, H], positions [b, s])

    def __len__(self) -> int:
        cached = 0 if self.k[0] is None else self.k[0].shape[2]
        return cached + sum(c.shape[1] for c, _ in self.pending)

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The queued context as one (ctx [b, s, H], positions [b, s]), emptying the queue."""
        if not self.pending:
            return None
        ctx, pos = (torch.cat(parts, dim=1) for parts in zip(*self.pending))
        self.pending = []
        return ctx, pos

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k/v [b, kvh, s, d] to `layer`'s context; returns all of it."""
        if self.k[layer] is not None:
            k, v = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        """Keep the first `length` context positions (drop rejected ones, queued or cached)."""
        cached = 0 if self.k[0] is None else self.k[0].shape[2]
        self.k = [None if k is None else k[:, :, :length] for k in self.k]
        self.v = [None if v is None else v[:, :, :length] for v in self.v]
        keep, kept = max(length - cached, 0), []
        for ctx, pos in self.pending:
            if keep > 0:
                kept.append((ctx[:, :keep], pos[:, :keep]))
            keep -= ctx.shape[1]
        self.pending = kept


class DFlashDrafter(nn.Module):
    """Parameter names: fc, hidden_norm, layers.N.*, norm (the Speculators DFlash names); DFlash2
    adds layers.N.{attention_conv, mlp_conv}.* and candidate_selector.* (speculators' DFlash2 names)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        c = config.qwen3_config()
        n_taps = len(config.target_layer_ids)
        self.fc = nn.Linear(n_taps * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        conv = self.variant.conv(config)
        self.layers = nn.ModuleList(DFlashDecoderLayer(c, i, conv) for i in range(c.num_hidden_layers))
        self.norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(c)  # inv_freq is a non-persistent buffer
        self.gradient_checkpointing = False  # training sets it from the recipe
        self.flex_attention = False  # training forward: block-sparse flex attention instead of a dense mask
        self.apply(self._init_weights)
        # DSpark's heads, applied by the caller after the backbone, and DFlash2's candidate selector, after
        # the LM head: None unless the variant adds them (model/variants/)
        self.markov_head = self.confidence_head = self.candidate_selector = self.refiner_head = None
        self.variant.add_modules(self, config)
        self.lm_head = None  # the draft vocabulary's frozen head (set_draft_vocab fills it and d2t / t2d)
        if config.draft_vocab_size is not None:
            n = config.draft_vocab_size
            self.lm_head = nn.Linear(c.hidden_size, n, bias=False).requires_grad_(False)
            # int64 [N] offsets: target id = i + d2t[i]
            self.register_buffer("d2t", torch.zeros(n, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))  # bool [V]

    @property
    def variant(self) -> Variant:
        """What config.variant adds to the backbone and how it drafts (model/variants/)."""
        return VARIANTS[self.config.variant]

    def set_draft_vocab(self, vocab: DraftVocab, target_head: torch.Tensor) -> None:
        """Fill the frozen head with the target's rows of the kept tokens (target_head [V, H]) and
        d2t / t2d with the vocabulary."""
        with torch.no_grad():
            self.lm_head.weight.copy_(target_head[vocab.kept.to(target_head.device)])
            self.d2t.copy_(vocab.d2t)
            self.t2d.copy_(vocab.t2d)

    @property
    def draft_vocab(self) -> DraftVocab | None:
        if self.lm_head is None:
            return None
        return DraftVocab(self.d2t.cpu() + torch.arange(len(self.d2t)), self.config.vocab_size)

    def logits_head(self, target_head: nn.Module) -> nn.Module:
        """The head the drafter's logits come from: its draft-vocabulary head, else the target's."""
        return target_head if self.lm_head is None else self.lm_head

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft indices -> target token ids (the identity over the full vocabulary)."""
        return draft_ids if self.lm_head is None else self.draft_vocab.to_target(draft_ids)

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> draft indices, -1 for ids outside the draft vocabulary (and for -1)."""
        return target_ids if self.lm_head is None else self.draft_vocab.to_draft(target_ids, missing=-1)

    def full_logits(self, hidden: torch.Tensor, target_head: nn.Module) -> torch.Tensor:
        """hidden [.., H] -> logits over the target's vocabulary [.., V]: the target head's, or the
        draft head's scattered into -inf (a token outside the draft vocabulary is never drafted)."""
        logits = self.logits_head(target_head)(hidden)
        if self.lm_head is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.t2d] = logits  # t2d marks the kept ids, ascending: draft index order
        return full

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    @property
    def causal(self) -> bool:
        return self.config.block_attention == "causal"

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [b, t, n*H] -> fused context [b, t, H]."""
        return self.hidden_norm(self.fc(taps))

    def blocks(self, block_embeds, block_positions, ctx, ctx_positions, mask=None,
               cache=None) -> torch.Tensor:
        """block_embeds [b, q, H] (target-embedded block tokens) at block_positions [b, q];
        ctx [b, t, H] fused context at ctx_positions [b, t]; mask [b, 1, q, t'+q] bool, a
        BlockMask or None; cache: a ContextCache (inference) or None (training).
        Returns the final-normed block hidden states [b, q, H]; logits = target LM head of these."""
        rope = self.rotary_emb(block_embeds, block_positions)
        ctx_rope = self.rotary_emb(ctx, ctx_positions)
        x = block_embeds
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                x = checkpoint(layer, x, rope, ctx, ctx_rope, mask, cache, use_reentrant=False)
            else:
                x = layer(x, rope, ctx, ctx_rope, mask, cache)
        return self.norm(x)

    # --- training: many anchored blocks of one sequence in one pass ---------------------------

    def forward(self, block_embeds, taps, anchors, ctx_valid) -> torch.Tensor:
        """The training forward (it is `forward` so that DDP/FSDP wrappers see it).
        block_embeds [b, A*B, H]; taps [b, T, n*H]; anchors [b, A] (block j starts at
        anchors[:, j]); ctx_valid [b, T] bool (False on padding). Returns hidden [b, A*B, H]."""
        b, T, _ = taps.shape
        positions = torch.arange(T, device=taps.device).expand(b, T)
        offsets = torch.arange(self.config.block_size, device=taps.device)
        block_positions = (anchors[:, :, None] + offsets).flatten(1)  # [b, A*B]
        mask_fn = anchored_block_block_mask if self.flex_attention else anchored_block_mask
        mask = mask_fn(anchors, ctx_valid, self.config.block_size, self.causal)
        return self.blocks(block_embeds, block_positions, self.fuse(taps), positions, mask)

    # --- inference: one block against a growing context cache ---------------------------------

    def extend_context(self, cache: ContextCache, taps: torch.Tensor, positions: torch.Tensor) -> None:
        """Queue newly accepted tokens (taps [b, s, n*H] at positions [b, s]) as context; the
        layers project and cache them in the next `forward_cached`."""
        cache.pending.append((self.fuse(taps), positions))

    def forward_cached(self, block_embeds, block_positions, cache: ContextCache) -> torch.Tensor:
        """One block [b, B, H] at positions [b, B] attending to all context: the cached K/V
        and the queued context, which this pass caches."""
        new = cache.take_pending()
        if new is None:  # nothing accepted since the last pass: an empty context chunk
            b, H = block_embeds.shape[0], block_embeds.shape[-1]
            new = (block_embeds.new_zeros(b, 0, H), block_positions[:, :0])
        mask = None
        if self.causal:  # all context visible, the block causal; the context length is known once cached
            t, q = len(cache) + new[0].shape[1], block_embeds.shape[1]
            mask = torch.ones(q, t + q, dtype=torch.bool, device=block_embeds.device)
            mask[:, t:] = torch.tril(mask[:, t:])
            mask = mask[None, None]
        return self.blocks(block_embeds, block_positions, new[0], new[1], mask, cache)


def anchored_block_mask(anchors: torch.Tensor, ctx_valid: torch.Tensor, block_size: int,
                        causal: bool = False) -> torch.Tensor:
    """Visibility [b, 1, A*B, T + A*B] for the training forward (True = may attend).

    A query in block j sees context positions strictly before its anchor (the anchor
    token itself is block slot 0, its target state is not known yet at inference time)
    and the slots of its own block: all of them (bidirectional) or those at or before its
    own slot (causal); blocks never see each other.
    """
    b, A = anchors.shape
    T = ctx_valid.shape[1]
    kv_pos = torch.arange(T, device=anchors.device)
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, A*B]
    sees_ctx = (kv_pos[None, None, :] < q_anchor[:, :, None]) & ctx_valid[:, None, :]  # [b, A*B, T]
    slot = torch.arange(A * block_size, device=anchors.device)
    sees_block = slot[:, None] // block_size == slot[None, :] // block_size  # [A*B, A*B]
    if causal:
        sees_block = sees_block & (slot[:, None] >= slot[None, :])
    return torch.cat([sees_ctx, sees_block.expand(b, -1, -1)], dim=2).unsqueeze(1)


def anchored_block_block_mask(anchors: torch.Tensor, ctx_valid: torch.Tensor, block_size: int,
                              causal: bool = False) -> BlockMask:
    """The same visibility as `anchored_block_mask` as a flex-attention BlockMask: with 512
    anchors x 16 slots over 3072 context tokens the dense mask is ~97% hidden, and flex
    attention skips the hidden 128x128 tiles instead of computing and masking them."""
    b, A = anchors.shape
    T = ctx_valid.shape[1]

    def visible(bi, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        in_ctx = kv_idx < T
        sees_ctx = (kv_idx < anchors[bi, q_block]) & ctx_valid[bi, kv_idx.clamp(max=T - 1)]
        sees_block = (kv_idx - T) // block_size == q_block
        if causal:
            sees_block = sees_block & (kv_idx - T <= q_idx)
        return torch.where(in_ctx, sees_ctx, sees_block)

    return create_block_mask(visible, B=b, H=None, Q_LEN=A * block_size, KV_LEN=T + A * block_size,
                             device=anchors.device)


@functools.cache
def _compiled_flex_attention():
    """flex_attention compiled once (eager flex attention materialises the scores and is slow)."""
    return torch.compile(flex_attention, dynamic=True)
