"""What each decoding method proposes for the target to verify: AR the root alone, DFlash the drafter's
greedy chain, DDTree a best-first tree of the drafter's block. The decode loop (decode.py) asks a
method only this (`Proposer`); what a drafter drafts is its variant's (model/variants: `chain`, `scorer`).

    proposer = PROPOSERS[method](target, drafter, budget, tree_scores)
    proposer.begin(result, hidden_states)              # after prefill: the prompt's taps
    tree = proposer.propose(bonus, start, clock, before)   # laps "draft"; the loop laps "tree"
    proposer.observe(result, tree, accepted, posterior)   # spine, calibration, confidence
    proposer.extend(hidden_states, accepted, start)    # the accepted tokens' taps
"""

from typing import Protocol

import torch

from dflash_train.decoding.ddtree import (DraftTree, add_cells, build_tree, calibration_counts, chain_tree,
                                          root_only_tree, spine_counts)
from dflash_train.model.drafter import ContextCache, DFlashDrafter
from dflash_train.model.target import Target, taps_from_hidden_states


class Proposer(Protocol):
    uses_drafter: bool  # the target's verify forward returns its hidden states (the drafter's taps)

    def begin(self, result, hidden_states) -> None:
        """The target has read the prompt (hidden_states: its output_hidden_states, or None)."""

    def propose(self, bonus: int, start: int, clock, before: int) -> DraftTree:
        """The tree after the bonus token at position `start` (`before`: the token before it); laps the
        clock's "draft" if it drafts."""

    def observe(self, result, tree: DraftTree, accepted: list[int], posterior: list[int]) -> None:
        """Diagnostics of one verified round into the DecodeResult."""

    def extend(self, hidden_states, accepted: list[int], start: int) -> None:
        """The accepted nodes (rows of the verify forward) now follow position `start`."""


def draft_hidden(drafter: DFlashDrafter, target: Target, ctx: ContextCache, bonus: int,
                 start: int) -> torch.Tensor:
    """One drafter pass on [bonus, MASK x (B-1)] at positions start..start+B-1 -> hidden [B, H]."""
    B, device = drafter.config.block_size, target.embed.weight.device
    block = torch.full((1, B), drafter.config.mask_token_id, device=device)
    block[0, 0] = bonus
    positions = torch.arange(start, start + B, device=device)[None]
    return drafter.forward_cached(target.embed(block), positions, ctx)[0]  # [B, H]


def draft_block(drafter: DFlashDrafter, target: Target, ctx: ContextCache, bonus: int,
                start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> the block's hidden states [B, H] and the backbone's logits of slots 1..B-1 [B-1, N] (DFlash2:
    the unary logits), over the draft vocabulary (index i is target id drafter.draft_vocab.kept[i]) or,
    without one, the full vocabulary (N = V, index == target id)."""
    hidden = draft_hidden(drafter, target, ctx, bonus, start)
    return hidden, drafter.logits_head(target.lm_head)(hidden[1:])


class RootOnlyProposer:
    """AR: the root alone, so each round verifies the bonus token and emits the target's next one."""
    uses_drafter = False

    def begin(self, result, hidden_states) -> None:
        pass

    def propose(self, bonus: int, start: int, clock, before: int) -> DraftTree:
        return root_only_tree()

    def observe(self, result, tree, accepted, posterior) -> None:
        pass

    def extend(self, hidden_states, accepted, start) -> None:
        pass


class BlockProposer:
    """One drafter pass per round on [bonus, MASK x (B-1)], against the drafter's context: the fused taps
    of the prompt and of every accepted token (a ContextCache).

    A drafter with a draft vocabulary drafts in it: its logits stay [B-1, N] and the chain's tokens and the
    tree's nodes are mapped to target ids through `kept` (d2t), instead of scattering every round's logits
    into the target's V-wide vocabulary (SmolLM2: 16,384 -> 49,152 columns, ~1 ms, and a tree search 3x
    as wide). The same tokens and scores: the scattered columns were -inf."""
    uses_drafter = True

    def __init__(self, target: Target, drafter: DFlashDrafter):
        self.target, self.drafter, self.variant = target, drafter, drafter.variant
        self.layer_ids, self.device = drafter.config.target_layer_ids, target.embed.weight.device
        self.ctx = ContextCache(drafter.config.num_hidden_layers)
        # [N] target id of each draft index (None: the full vocabulary, draft index == target id)
        vocab = drafter.draft_vocab
        self.kept = None if vocab is None else vocab.kept.to(self.device)

    def begin(self, result, hidden_states) -> None:
        taps = taps_from_hidden_states(hidden_states, self.layer_ids)  # [1, P, n*H]
        self.drafter.extend_context(self.ctx, taps, torch.arange(taps.shape[1], device=self.device)[None])

    def draft(self, bonus: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> hidden [B, H], logits [B-1, N] in draft space (draft_block)."""
        return draft_block(self.drafter, self.target, self.ctx, bonus, start)

    def observe(self, result, tree, accepted, posterior) -> None:
        # does the best child under each accepted node name the target's next token?
        counts = spine_counts(tree, accepted[1:], [posterior[i] for i in accepted[1:]])
        result.spine = [a + c for a, c in zip(result.spine, counts)]

    def extend(self, hidden_states, accepted, start) -> None:
        rows = torch.tensor(accepted, device=self.device)
        taps = taps_from_hidden_states(hidden_states, self.layer_ids)[:, rows]  # [1, a, nH]
        positions = start + torch.arange(len(accepted), device=self.device)
        self.drafter.extend_context(self.ctx, taps, positions[None])


class ChainProposer(BlockProposer):
    """DFlash: the variant's greedy chain of the block, verified as one path. A chain that states each
    slot's acceptance (DSpark's confidence head) is tabulated in result.confidence: per drafted slot
    [predicted sum, rounds that reached the slot, rounds that accepted it]; an iterative chain's passes
    (XPress's Jacobi passes) per round in result.jacobi_passes."""

    def begin(self, result, hidden_states) -> None:
        super().begin(result, hidden_states)
        if self.variant.states_confidence(self.drafter):
            result.confidence = [[0.0] * (self.drafter.config.block_size - 1) for _ in range(3)]

    def propose(self, bonus: int, start: int, clock, before: int) -> DraftTree:
        hidden, base_logits = self.draft(bonus, start)
        self.round = self.variant.chain(self.drafter, hidden, base_logits, bonus, before)  # kept for observe
        clock.lap("draft")
        tokens = self.round.tokens if self.kept is None else self.kept[self.round.tokens]
        return chain_tree(tokens)

    def observe(self, result, tree, accepted, posterior) -> None:
        super().observe(result, tree, accepted, posterior)
        if self.round.passes is not None:
            result.jacobi_passes = (result.jacobi_passes or []) + [self.round.passes]
        if self.round.confidence is None:
            return
        a = len(accepted) - 1  # slots 1..a accepted, slot a+1 rejected, later ones never reached
        for k, p in enumerate(torch.sigmoid(self.round.confidence.float()).tolist()[: a + 1]):
            result.confidence[0][k] += p
            result.confidence[1][k] += 1
            result.confidence[2][k] += k < a


class TreeProposer(BlockProposer):
    """DDTree: the best-first tree of `budget` nodes over the block's slot distributions, path-conditioned
    by the variant's scorer (DSpark, DFlash2) unless `conditional` is False (tree_scores="marginal").
    Each round's calibration cells (ddtree.calibration_counts) are summed in result.calibration."""

    def __init__(self, target: Target, drafter: DFlashDrafter, budget: int, conditional: bool):
        super().__init__(target, drafter)
        self.budget, self.conditional = budget, conditional

    def propose(self, bonus: int, start: int, clock, before: int) -> DraftTree:
        hidden, base_logits = self.draft(bonus, start)
        clock.lap("draft")
        scorer = self.variant.scorer(self.drafter, hidden, bonus, before) if self.conditional else None
        # a scorer names its nodes' target ids itself (XPress's over a draft vocabulary)
        return build_tree(base_logits, self.budget, scorer, token_ids=None if scorer else self.kept)

    def observe(self, result, tree, accepted, posterior) -> None:
        super().observe(result, tree, accepted, posterior)
        add_cells(result.calibration, calibration_counts(tree, accepted, posterior))


# method -> its proposer for one decode, from (target, drafter, budget, tree_scores): each takes what it reads
PROPOSERS = {
    "ar": lambda target, drafter, budget, tree_scores: RootOnlyProposer(),
    "dflash": lambda target, drafter, budget, tree_scores: ChainProposer(target, drafter),
    "ddtree": lambda target, drafter, budget, tree_scores: TreeProposer(target, drafter, budget,
                                                                        tree_scores == "conditional"),
}
