"""Speculative decoding with a DFlash drafter: plain AR, the DFlash chain and DDTree, one loop.

Every round: the drafter drafts a block after the bonus token (DFlash/DDTree), a tree is
built (root only for AR, a path for the chain, best-first for DDTree), the target verifies
[bonus + tree nodes] in ONE forward with an ancestor-only mask, the accept walk follows the
target's own choices, and the accepted rows are compacted in the target's KV cache while
their tapped hidden states extend the drafter's context cache. So all three methods are
measured by the same code, and each round is one target forward.

    result = decode(target, drafter, prompt_ids, method="ddtree", budget=64)

A DSpark drafter drafts its chain with the Markov bias fed by its own drafted tokens
(`dspark.markov_chain`), and its DDTree is path-conditioned (`dspark.MarkovScorer`), or built
from the backbone's marginals alone with tree_scores="marginal".
A DFlash2 drafter drafts its chain as vLLM walks its candidate selector (`dflash2.selector_chain`:
each slot re-ranks its unary top-K given the token drafted before it), and its DDTree ranks each
node's children by the selector given that node's token (`dflash2.SelectorScorer`), or is built
from the unary marginals alone with tree_scores="marginal".
"""

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dflash_train.decoding.ddtree import (DraftTree, accept_walk, add_cells, build_tree, calibration_counts, chain_tree,
                                          root_only_tree, spine_counts, tree_attention_mask)
from dflash_train.model.drafter import ContextCache, DFlashDrafter
from dflash_train.model.target import Target, taps_from_hidden_states
from dflash_train.model.variants.dflash2 import SelectorScorer, selector_chain
from dflash_train.model.variants.dspark import MarkovScorer, markov_chain

METHODS = ("ar", "dflash", "ddtree")
TREE_SCORES = ("conditional", "marginal")  # DSpark's / DFlash2's DDTree: path-conditioned, or from the marginals
STAGES = ("draft", "tree", "verify", "commit")


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens, the prompt excluded
    accept_lengths: list[int] = field(default_factory=list)  # per round: tokens emitted (accepted + bonus)
    stage_s: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))  # prefill excluded
    prefill_s: float = 0.0
    # ddtree.spine_counts summed over rounds: on-spine hits, nodes, off-spine hits, nodes
    spine: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    # DSpark's confidence head along the chain, per drafted slot: [predicted sum, rounds that
    # reached the slot, rounds that accepted it] (None without a confidence head or off the chain)
    confidence: list[list[float]] | None = None
    # ddtree.calibration_counts summed over rounds (DDTree only): {(depth, rank): [stated sum, hits, nodes]}
    calibration: dict = field(default_factory=dict)

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


def tree_scorer(drafter: DFlashDrafter, hidden: torch.Tensor, bonus: int, tree_scores: str):
    """The conditional scorer of this block's DDTree (hidden [B, H]), or None for the tree from the
    marginals: DFlash, or tree_scores="marginal"."""
    if tree_scores != "conditional":
        return None
    if drafter.markov_head is not None:
        return MarkovScorer(drafter.markov_head, hidden, bonus)
    if drafter.candidate_selector is not None:
        return SelectorScorer(drafter.candidate_selector, hidden, bonus)
    return None


def draft_block(drafter: DFlashDrafter, target: Target, ctx: ContextCache, bonus: int, start: int) -> torch.Tensor:
    """The backbone's block logits [B-1, V] (slots 1..B-1; -inf outside a draft vocabulary)."""
    return drafter.full_logits(draft_hidden(drafter, target, ctx, bonus, start)[1:], target.lm_head)


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
           stop_ids: set[int] = frozenset(), generator: torch.Generator | None = None,
           tree_scores: str = "conditional") -> DecodeResult:
    """Generate up to max_new_tokens after prompt_ids [1, P] (stopping after a stop token).
    tree_scores: how a DSpark or DFlash2 drafter's DDTree is scored (TREE_SCORES); DFlash has marginals only."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if tree_scores not in TREE_SCORES:
        raise ValueError(f"tree_scores must be one of {TREE_SCORES}, got {tree_scores!r}")
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
    dspark = use_drafter and drafter.config.variant == "dspark"
    calibrate = dspark and method == "dflash" and drafter.confidence_head is not None
    if calibrate:
        result.confidence = [[0.0] * (drafter.config.block_size - 1) for _ in range(3)]
    clock = _Clock(result.stage_s, device)

    while len(result.tokens) < max_new_tokens and bonus not in stop_ids:
        confidence = None
        if method == "ar":
            tree = root_only_tree()
        else:
            hidden = draft_hidden(drafter, target, ctx, bonus, start)  # [B, H]
            # [B-1, V], the backbone's (DFlash2: the unary logits); -inf outside a draft vocabulary
            base_logits = drafter.full_logits(hidden[1:], target.lm_head)
            if method == "dflash" and dspark:  # the Markov chain: each slot biased by the token drafted before it
                chain, _, confidence = markov_chain(drafter, hidden, base_logits, bonus)
            elif method == "dflash" and drafter.candidate_selector is not None:  # DFlash2: the selector walk
                chain = selector_chain(drafter.candidate_selector, hidden[1:], base_logits, bonus)
            elif method == "dflash":
                chain = base_logits.argmax(-1)
            clock.lap("draft")
            if method == "dflash":
                tree = chain_tree(chain)
            else:
                tree = build_tree(base_logits, budget, tree_scorer(drafter, hidden, bonus, tree_scores))
        clock.lap("tree")

        logits, hidden_states = verify(target, cache, tree, bonus, start, use_drafter)
        posterior = choose(logits, temperature, generator).tolist()  # the target's pick after each node
        accepted, bonus = accept_walk(tree, posterior)
        clock.lap("verify")
        if use_drafter:  # diagnostics: does the best child under each accepted node name the target's next token?
            counts = spine_counts(tree, accepted[1:], [posterior[i] for i in accepted[1:]])
            result.spine = [a + c for a, c in zip(result.spine, counts)]
            if method == "ddtree":
                add_cells(result.calibration, calibration_counts(tree, accepted, posterior))
        if confidence is not None:  # slots 1..a accepted, slot a+1 rejected, later ones never reached
            a = len(accepted) - 1
            for k, p in enumerate(torch.sigmoid(confidence.float()).tolist()[: a + 1]):
                result.confidence[0][k] += p
                result.confidence[1][k] += 1
                result.confidence[2][k] += k < a

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
