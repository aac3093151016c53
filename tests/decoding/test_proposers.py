"""decoding/proposers.py: what each method proposes, against the drafter's block drafted by hand (its
context built in one go from the taps, one forward on [bonus, MASK x (B-1)])."""

import pytest
import torch

from dflash_train.checkpoint.folders import load_drafter
from dflash_train.decoding.ddtree import build_tree
from dflash_train.decoding.proposers import PROPOSERS, ChainProposer, TreeProposer
from dflash_train.model.drafter import ContextCache


class Clock:
    def __init__(self):
        self.laps = []

    def lap(self, name):
        self.laps.append(name)


@pytest.fixture(scope="module")
def drafter(fresh_drafter_dir):
    return load_drafter(fresh_drafter_dir)[0].eval()


def hidden_states(n_layers: int, t: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A stand-in for the target's output_hidden_states: n_layers + 1 tensors [1, t, H]."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, t, width, generator=g) for _ in range(n_layers + 1))


def by_hand(drafter, target, taps: torch.Tensor, bonus: int):
    """The block's hidden [B, H] and full-vocabulary logits [B-1, V] after context taps [1, t, nH] at
    positions 0..t-1: the reference the proposers are checked against."""
    ctx = ContextCache(drafter.config.num_hidden_layers)
    t, B = taps.shape[1], drafter.config.block_size
    drafter.extend_context(ctx, taps, torch.arange(t)[None])
    block = torch.tensor([[bonus] + [drafter.config.mask_token_id] * (B - 1)])
    hidden = drafter.forward_cached(target.embed(block), torch.arange(t, t + B)[None], ctx)[0]
    return hidden, target.lm_head(hidden[1:])


def taps_of(states, layer_ids) -> torch.Tensor:
    return torch.cat([states[k + 1] for k in layer_ids], dim=-1)


@torch.no_grad()
def test_the_chain_is_the_argmax_of_each_slot_and_extend_keeps_only_the_accepted_rows(drafter, tiny_target):
    """A DFlash chain is every slot's argmax; after extend with rows [0, 2] of a 4-row verify forward the
    next block is drafted from the prompt's taps and those two rows at the next two positions."""
    L, H, ids = tiny_target.model.config.num_hidden_layers, tiny_target.embed.weight.shape[1], \
        drafter.config.target_layer_ids
    prompt, verify = hidden_states(L, 9, H, seed=1), hidden_states(L, 4, H, seed=2)
    proposer = ChainProposer(tiny_target, drafter)
    proposer.begin(None, prompt)
    clock = Clock()
    tree = proposer.propose(17, 9, clock, 5)
    _, logits = by_hand(drafter, tiny_target, taps_of(prompt, ids), 17)
    assert tree.tokens.tolist() == logits.argmax(-1).tolist() and clock.laps == ["draft"]
    assert tree.parents.tolist() == list(range(-1, drafter.config.block_size - 1))  # a chain

    proposer.extend(verify, [0, 2], 9)
    tree = proposer.propose(23, 11, clock, 17)
    both = torch.cat([taps_of(prompt, ids), taps_of(verify, ids)[:, [0, 2]]], dim=1)  # [1, 11, nH]
    _, logits = by_hand(drafter, tiny_target, both, 23)
    assert tree.tokens.tolist() == logits.argmax(-1).tolist()
    _, skipped = by_hand(drafter, tiny_target, torch.cat([taps_of(prompt, ids), taps_of(verify, ids)[:, :2]],
                                                         dim=1), 23)
    assert not torch.allclose(logits, skipped)  # the rows taken matter: the check above could fail


@torch.no_grad()
@pytest.mark.parametrize("budget", [1, 8, 40])
def test_a_tree_is_the_best_first_tree_of_the_drafted_block(drafter, tiny_target, budget):
    L, H = tiny_target.model.config.num_hidden_layers, tiny_target.embed.weight.shape[1]
    prompt = hidden_states(L, 7, H, seed=3)
    proposer = PROPOSERS["ddtree"](tiny_target, drafter, budget, "marginal")
    assert isinstance(proposer, TreeProposer) and proposer.conditional is False
    proposer.begin(None, prompt)
    tree = proposer.propose(31, 7, Clock(), 2)
    _, logits = by_hand(drafter, tiny_target, taps_of(prompt, drafter.config.target_layer_ids), 31)
    ref = build_tree(logits, budget)
    assert tree.size == budget == ref.size
    assert tree.tokens.tolist() == ref.tokens.tolist() and tree.parents.tolist() == ref.parents.tolist()
    torch.testing.assert_close(tree.log_probs, ref.log_probs, rtol=1e-5, atol=1e-5)
    assert PROPOSERS["ddtree"](tiny_target, drafter, budget, "conditional").conditional is True


def test_ar_proposes_the_root_alone_and_reads_no_drafter():
    proposer = PROPOSERS["ar"](None, None, 0, "conditional")  # nothing to draft with: none is read
    assert proposer.uses_drafter is False
    proposer.begin(None, None)
    tree = proposer.propose(5, 3, Clock(), 1)
    assert tree.size == 0 and tree.parents.tolist() == [-1]
