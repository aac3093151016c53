"""The DFlash drafter: a small non-causal block model conditioned on tapped target states.

Shapes: b batch, t context length, q = block tokens (one block of B at inference, A*B in
training), H hidden size, h/kvh query/key-value heads, d head dim, n number of taps.

How the target's hidden states enter (DFlash, see shared/reference/dflash.md):
    taps [b, t, n*H] --fc (no bias)--> [b, t, H] --hidden_norm--> ctx [b, t, H]
    every layer l:  K/V = [k_norm(k_proj_l(ctx)) + RoPE(ctx positions) ; K/V of the block]
                    Q   = from the block only, attention non-causal.
The target's embeddings and LM head are shared and frozen; they are NOT part of this
module (its state_dict is exactly the trainable weights, named as Speculators names
DFlash weights), so the caller embeds the block and applies the LM head.
"""

import functools
from dataclasses import asdict, dataclass, field

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

from dflash_train.dspark import dspark_heads


@dataclass
class DrafterConfig:
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
    # DSpark (dflash_train/dspark.py): a Markov logit-bias head of rank markov_rank (0: none) and a
    # confidence head, whose input includes the Markov embedding when confidence_head_with_markov.
    variant: str = "dflash"
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_head_with_markov: bool = False

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
    def __init__(self, c: Qwen3Config):
        super().__init__()
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

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """x [b, q, H] (block, normed); ctx_k/v [b, kvh, t, d]; mask [b, 1, q, t+q] bool, a flex
        BlockMask of the same visibility, or None (all visible)."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.project_kv(x, cos, sin)
        k = torch.cat([ctx_k, k_blk], dim=2)  # [b, kvh, t+q, d]
        v = torch.cat([ctx_v, v_blk], dim=2)
        if isinstance(mask, BlockMask):  # block-sparse training mask: only visible tiles are computed
            attend = _compiled_flex_attention() if q.is_cuda else flex_attention  # eager on CPU: tests only
            out = attend(q, k, v, block_mask=mask, enable_gqa=self.kv_heads != self.heads)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer whose attention also sees the context K/V."""

    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(c)
        self.mlp = Qwen3MLP(c)
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class ContextCache:
    """Per-layer K/V of the fused context for inference; grows with accepted tokens, can be cropped.

    Only context lives here: the block's own K/V are recomputed every draft pass, which is
    what DFlash's `crop(start)` after each pass amounts to.
    """

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k], dim=2)
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v], dim=2)

    def crop(self, length: int) -> None:
        """Keep the first `length` context positions (drop rejected ones)."""
        self.k = [None if k is None else k[:, :, :length] for k in self.k]
        self.v = [None if v is None else v[:, :, :length] for v in self.v]


class DFlashDrafter(nn.Module):
    """Parameter names: fc, hidden_norm, layers.N.*, norm (the Speculators DFlash names)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        c = config.qwen3_config()
        n_taps = len(config.target_layer_ids)
        self.fc = nn.Linear(n_taps * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(c)  # inv_freq is a non-persistent buffer
        self.gradient_checkpointing = False  # training sets it from the recipe
        self.flex_attention = False  # training forward: block-sparse flex attention instead of a dense mask
        self.apply(self._init_weights)
        # DSpark's heads (None for DFlash), applied by the caller after the backbone (dflash_train/dspark.py)
        self.markov_head, self.confidence_head = dspark_heads(config)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps [b, t, n*H], positions [b, t] -> per layer (k, v) [b, kvh, t, d]."""
        ctx = self.hidden_norm(self.fc(taps))  # [b, t, H]
        cos, sin = self.rotary_emb(ctx, positions)
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    def blocks(self, block_embeds, block_positions, ctx_kv, mask=None) -> torch.Tensor:
        """block_embeds [b, q, H] (target-embedded block tokens), block_positions [b, q],
        ctx_kv per layer (k, v) [b, kvh, t, d], mask [b, 1, q, t+q] bool or None.
        Returns the final-normed block hidden states [b, q, H]; logits = target LM head of these."""
        cos, sin = self.rotary_emb(block_embeds, block_positions)
        x = block_embeds
        for layer, (k, v) in zip(self.layers, ctx_kv):
            if self.gradient_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, k, v, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    # --- training: many anchored blocks of one sequence in one pass ---------------------------

    def forward(self, block_embeds, taps, anchors, ctx_valid) -> torch.Tensor:
        """The training forward (it is `forward` so that DDP/FSDP wrappers see it).
        block_embeds [b, A*B, H]; taps [b, T, n*H]; anchors [b, A] (block j starts at
        anchors[:, j]); ctx_valid [b, T] bool (False on padding). Returns hidden [b, A*B, H]."""
        b, T, _ = taps.shape
        positions = torch.arange(T, device=taps.device).expand(b, T)
        ctx_kv = self.context_kv(taps, positions)
        offsets = torch.arange(self.config.block_size, device=taps.device)
        block_positions = (anchors[:, :, None] + offsets).flatten(1)  # [b, A*B]
        mask_fn = anchored_block_block_mask if self.flex_attention else anchored_block_mask
        mask = mask_fn(anchors, ctx_valid, self.config.block_size)
        return self.blocks(block_embeds, block_positions, ctx_kv, mask)

    # --- inference: one block against a growing context cache ---------------------------------

    def extend_context(self, cache: ContextCache, taps: torch.Tensor, positions: torch.Tensor) -> None:
        """Add the fused K/V of newly accepted tokens (taps [b, s, n*H] at positions [b, s])."""
        for i, (k, v) in enumerate(self.context_kv(taps, positions)):
            cache.append(i, k, v)

    def forward_cached(self, block_embeds, block_positions, cache: ContextCache) -> torch.Tensor:
        """One block [b, B, H] at positions [b, B] attending to everything in the cache."""
        return self.blocks(block_embeds, block_positions, list(zip(cache.k, cache.v)), mask=None)


def anchored_block_mask(anchors: torch.Tensor, ctx_valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """Visibility [b, 1, A*B, T + A*B] for the training forward (True = may attend).

    A query in block j sees context positions strictly before its anchor (the anchor
    token itself is block slot 0, its target state is not known yet at inference time)
    and every slot of its own block (non-causal); blocks never see each other.
    """
    b, A = anchors.shape
    T = ctx_valid.shape[1]
    kv_pos = torch.arange(T, device=anchors.device)
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, A*B]
    sees_ctx = (kv_pos[None, None, :] < q_anchor[:, :, None]) & ctx_valid[:, None, :]  # [b, A*B, T]
    q_block = torch.arange(A * block_size, device=anchors.device) // block_size
    sees_block = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)  # [b, A*B, A*B]
    return torch.cat([sees_ctx, sees_block], dim=2).unsqueeze(1)


def anchored_block_block_mask(anchors: torch.Tensor, ctx_valid: torch.Tensor, block_size: int) -> BlockMask:
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
        return torch.where(in_ctx, sees_ctx, sees_block)

    return create_block_mask(visible, B=b, H=None, Q_LEN=A * block_size, KV_LEN=T + A * block_size,
                             device=anchors.device)


@functools.cache
def _compiled_flex_attention():
    """flex_attention compiled once (eager flex attention materialises the scores and is slow)."""
    return torch.compile(flex_attention, dynamic=True)
