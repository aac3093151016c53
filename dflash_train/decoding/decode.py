"""Speculative decoding with a DFlash drafter: plain AR, the DFlash chain and DDTree, one loop.

Every round: the drafter drafts a block after the bonus token (DFlash/DDTree), a tree is
built (root only for AR, a path for the chain, best-first for DDTree), the target verifies
[bonus + tree nodes] in ONE forward with an ancestor-only mask, the accept walk follows the
target's own choices, and the accepted rows are compacted in the target's KV cache while
their tapped hidden states extend the drafter's context cache. So all three methods are
measured by the same code, and each round is one target forward.

    result = decode(target, drafter, prompt_ids, method="ddtree", budget=64)

What each method proposes is its `Proposer` (proposers.py); what a drafter drafts is its variant's
(model/variants/): a DSpark drafter's chain carries the Markov bias of its own drafted tokens and
its DDTree is path-conditioned (`dspark.MarkovScorer`); a DFlash2 drafter's chain walks its
candidate selector as vLLM does and its DDTree ranks each node's children by the selector
(`dflash2.SelectorScorer`). With tree_scores="marginal" either tree is built from the backbone's
(unary) marginals alone.
"""

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dflash_train.decoding.ddtree import DraftTree, accept_walk, tree_attention_mask
from dflash_train.decoding.proposers import PROPOSERS, Proposer
from dflash_train.model.drafter import DFlashDrafter
from dflash_train.model.sampling import sample_rows, tempered_probs
from dflash_train.model.target import Target

METHODS = tuple(PROPOSERS)  # ar, dflash, ddtree
# DSpark's / DFlash2's DDTree: path-conditioned, or from the marginals
TREE_SCORES = ("conditional", "marginal")
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
    # per round, the Jacobi passes an XPress chain ran (None for other drafters and methods)
    jacobi_passes: list[int] | None = None

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
    return sample_rows(tempered_probs(logits, temperature).cpu(), generator).to(logits.device)


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


def prefill(target: Target, proposer: Proposer, prompt_ids: torch.Tensor, result: DecodeResult,
            temperature: float, generator: torch.Generator | None) -> tuple[DynamicCache, int, int]:
    """The target reads the prompt [1, P] and picks the first token (the first bonus); the proposer takes
    the prompt's taps. -> (the target's KV cache, bonus, start = P: the bonus token's position)."""
    t0 = time.perf_counter()
    cache = DynamicCache(config=target.model.config)
    prompt_ids = prompt_ids.to(target.embed.weight.device)
    out = target.model(input_ids=prompt_ids, past_key_values=cache, use_cache=True,
                       output_hidden_states=proposer.uses_drafter)
    bonus = int(choose(out.logits[0, -1:], temperature, generator)[0])
    proposer.begin(result, out.hidden_states)
    result.tokens.append(bonus)
    result.prefill_s = time.perf_counter() - t0
    return cache, bonus, prompt_ids.shape[1]


def emit(result: DecodeResult, tree: DraftTree, accepted: list[int], bonus: int, stop_ids: set[int],
         max_new_tokens: int) -> int:
    """Append the round's accepted tokens and its bonus token to result.tokens, stopping exactly at a stop
    token or at max_new_tokens. -> the last token appended (the next round's bonus)."""
    emitted = [int(tree.tokens[i - 1]) for i in accepted[1:]] + [bonus]
    result.accept_lengths.append(len(emitted))
    for tok in emitted:
        result.tokens.append(tok)
        if tok in stop_ids or len(result.tokens) >= max_new_tokens:
            return tok
    return bonus


@torch.no_grad()
def decode(target: Target, drafter: DFlashDrafter | None, prompt_ids: torch.Tensor, method: str = "ddtree",
           budget: int = 64, temperature: float = 0.0, max_new_tokens: int = 128,
           stop_ids: set[int] = frozenset(), generator: torch.Generator | None = None,
           tree_scores: str = "conditional") -> DecodeResult:
    """Generate up to max_new_tokens after prompt_ids [1, P] (stopping after a stop token).
    tree_scores: how a DSpark or DFlash2 drafter's DDTree is scored (TREE_SCORES); DFlash has marginals
    only."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if tree_scores not in TREE_SCORES:
        raise ValueError(f"tree_scores must be one of {TREE_SCORES}, got {tree_scores!r}")
    proposer = PROPOSERS[method](target, drafter, budget, tree_scores)
    result = DecodeResult(tokens=[])
    cache, bonus, start = prefill(target, proposer, prompt_ids, result, temperature, generator)
    clock = _Clock(result.stage_s, target.embed.weight.device)

    while len(result.tokens) < max_new_tokens and bonus not in stop_ids:
        # the token before the bonus token (XPress's refiner reads it): the bonus is result.tokens[-1]
        before = result.tokens[-2] if len(result.tokens) > 1 else int(prompt_ids[0, -1])
        tree = proposer.propose(bonus, start, clock, before)
        clock.lap("tree")
        logits, hidden_states = verify(target, cache, tree, bonus, start, proposer.uses_drafter)
        posterior = choose(logits, temperature, generator).tolist()  # the target's pick after each node
        accepted, bonus = accept_walk(tree, posterior)
        clock.lap("verify")
        proposer.observe(result, tree, accepted, posterior)
        commit(cache, start, accepted)
        proposer.extend(hidden_states, accepted, start)
        start += len(accepted)
        bonus = emit(result, tree, accepted, bonus, stop_ids, max_new_tokens)
        clock.lap("commit")
    return result
