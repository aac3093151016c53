"""Speculative decoding with a DFlash drafter: plain AR, the DFlash chain and DDTree, one loop.

Every round: the drafter drafts a block after the bonus token (DFlash/DDTree), a tree is
built (root only for AR, a path for the chain, best-first for DDTree), the target verifies
[bonus + tree nodes] in ONE forward with an ancestor-only mask, the accept walk follows the
target's own choices, and the accepted rows are compacted in the target's KV cache while
their tapped hidden states extend the drafter's context cache. So all three methods are
measured by the same code, and each round is one target forward.

    result = decode(target, drafter, prompt_ids, method="ddtree", budget=64)

A DFlash2 drafter drafts its chain as vLLM walks its candidate selector (`dflash2.selector_chain`:
each slot re-ranks its unary top-K given the token drafted before it).
"""

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dflash_train.ddtree import DraftTree, accept_walk, build_tree, chain_tree, root_only_tree, tree_attention_mask
from dflash_train.dflash2 import selector_chain
from dflash_train.model import ContextCache, DFlashDrafter
from dflash_train.target import Target, taps_from_hidden_states

METHODS = ("ar", "dflash", "ddtree")
STAGES = ("draft", "tree", "verify", "commit")


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens, the prompt excluded
    accept_lengths: list[int] = field(default_factory=list)  # per round: tokens emitted (accepted + bonus)
    stage_s: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))  # prefill excluded
    prefill_s: float = 0.0

    @property
    def tau(self) -> float:
        """Tokens per target forward (bonus included), this prompt."""
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def decode_s(self) -> float:
        return sum(self.stage_s.values())


class _Clock:
    """Adds wall time per stage; synchronises CUDA so GPU work lands in the right stage."""

    def __init__(self, stage_s: dict, device: torch.device):
        self.stage_s, self.cuda = stage_s, device.type == "cuda"
        self.t = time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.stage_s[stage] += now - self.t
        self.t = now


def choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """logits [n, V] -> one token per row: argmax at temperature 0, else an independent sample."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def draft_hidden(drafter: DFlashDrafter, target: Target, ctx: ContextCache, bonus: int, start: int) -> torch.Tensor:
    """One drafter pass on [bonus, MASK x (B-1)] at positions start..start+B-1 -> hidden [B, H]."""
    B, device = drafter.config.block_size, target.embed.weight.device
    block = torch.full((1, B), drafter.config.mask_token_id, device=device)
    block[0, 0] = bonus
    positions = torch.arange(start, start + B, device=device)[None]
    return drafter.forward_cached(target.embed(block), positions, ctx)[0]  # [B, H]


def draft_block(drafter: DFlashDrafter, target: Target, ctx: ContextCache, bonus: int, start: int) -> torch.Tensor:
    """The block's (unary) logits [B-1, V] (slots 1..B-1)."""
    return target.lm_head(draft_hidden(drafter, target, ctx, bonus, start)[1:])


def verify(target: Target, cache: DynamicCache, tree: DraftTree, bonus: int, start: int, want_taps: bool):
    """One target forward over [bonus + tree nodes]; positions start + depth (siblings share
    one). Returns logits [n+1, V] and the hidden states (or None)."""
    device = target.embed.weight.device
    ids = torch.cat([torch.tensor([bonus]), tree.tokens]).to(device)[None]  # [1, n+1]
    positions = (start + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])).to(device)[None]
    mask = tree_attention_mask(tree, start, target.model.dtype, device)
    out = target.model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                       use_cache=True, output_hidden_states=want_taps)
    return out.logits[0], out.hidden_states


def commit(cache: DynamicCache, start: int, accepted: list[int]) -> None:
    """Keep only the accepted rows of this round in the target's KV cache, contiguous from
    `start` (their positions start + depth are consecutive along a path, so RoPE stays right)."""
    idx = start + torch.tensor(accepted, device=cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys[:, :, start : start + len(accepted)] = layer.keys[:, :, idx]
        layer.values[:, :, start : start + len(accepted)] = layer.values[:, :, idx]
    removed = cache.get_seq_length() - (start + len(accepted))
    if removed:
        cache.crop(-removed)  # a negative count removes that many trailing tokens


@torch.no_grad()
def decode(target: Target, drafter: DFlashDrafter | None, prompt_ids: torch.Tensor, method: str = "ddtree",
           budget: int = 64, temperature: float = 0.0, max_new_tokens: int = 128,
           stop_ids: set[int] = frozenset(), generator: torch.Generator | None = None) -> DecodeResult:
    """Generate up to max_new_tokens after prompt_ids [1, P] (stopping after a stop token)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    device = target.embed.weight.device
    use_drafter = method != "ar"
    layer_ids = drafter.config.target_layer_ids if use_drafter else []

    # Prefill: the target reads the prompt and picks the first token (the first bonus).
    t0 = time.perf_counter()
    cache = DynamicCache(config=target.model.config)
    prompt_ids = prompt_ids.to(device)
    out = target.model(input_ids=prompt_ids, past_key_values=cache, use_cache=True, output_hidden_states=use_drafter)
    bonus = int(choose(out.logits[0, -1:], temperature, generator)[0])
    start = prompt_ids.shape[1]  # = tokens in the target cache = the bonus token's position
    ctx = ContextCache(drafter.config.num_hidden_layers) if use_drafter else None
    if use_drafter:
        drafter.extend_context(ctx, taps_from_hidden_states(out.hidden_states, layer_ids),
                               torch.arange(start, device=device)[None])
    result = DecodeResult(tokens=[bonus], prefill_s=time.perf_counter() - t0)
    clock = _Clock(result.stage_s, device)

    while len(result.tokens) < max_new_tokens and bonus not in stop_ids:
        if method == "ar":
            tree = root_only_tree()
        else:
            hidden = draft_hidden(drafter, target, ctx, bonus, start)  # [B, H]
            draft_logits = target.lm_head(hidden[1:])  # [B-1, V]
            if method == "dflash" and drafter.candidate_selector is not None:  # DFlash2: the selector walk
                chain = selector_chain(drafter.candidate_selector, hidden[1:], draft_logits, bonus)
            elif method == "dflash":
                chain = draft_logits.argmax(-1)
            clock.lap("draft")
            tree = build_tree(draft_logits, budget) if method == "ddtree" else chain_tree(chain)
        clock.lap("tree")

        logits, hidden_states = verify(target, cache, tree, bonus, start, use_drafter)
        posterior = choose(logits, temperature, generator).tolist()  # the target's pick after each node
        accepted, bonus = accept_walk(tree, posterior)
        clock.lap("verify")

        commit(cache, start, accepted)
        if use_drafter:
            rows = torch.tensor(accepted, device=device)
            taps = taps_from_hidden_states(hidden_states, layer_ids)[:, rows]  # [1, len(accepted), n*H]
            drafter.extend_context(ctx, taps, (start + torch.arange(len(accepted), device=device))[None])
        start += len(accepted)
        emitted = [int(tree.tokens[i - 1]) for i in accepted[1:]] + [bonus]
        result.accept_lengths.append(len(emitted))
        for tok in emitted:  # stop exactly at a stop token or at max_new_tokens
            result.tokens.append(tok)
            if tok in stop_ids or len(result.tokens) >= max_new_tokens:
                bonus = tok
                break
        clock.lap("commit")
    return result
