"""The draft vocabulary against speculators' own builder, and its d2t/t2d checks."""

import random
from collections import Counter

import pytest
import torch

from dflash_train.core.errors import UserError
from dflash_train.model.vocab import build_draft_vocab, count_supervised, draft_vocab_from_tensors

speculators_vocab = pytest.importorskip("speculators.train.vocab_mapping")


@pytest.mark.parametrize("seen, size", [(300, 64), (40, 64), (64, 64)])
def test_d2t_and_t2d_equal_speculators_own_builder(seen, size):
    """Top-N by count with ties by id, padded with ids 0.. when fewer are seen: speculators' tensors
    exactly."""
    rng = random.Random(seen)
    counts = Counter({rng.randrange(1000): rng.randrange(1, 6) for _ in range(seen)})  # many ties
    d2t, t2d = speculators_vocab.build_vocab_mappings_from_distribution(dict(counts), size, 1000)
    ours = build_draft_vocab(counts, size, 1000)
    assert torch.equal(ours.d2t, d2t) and torch.equal(ours.t2d, t2d)
    assert draft_vocab_from_tensors(d2t, t2d, "x").kept.tolist() == ours.kept.tolist()


def test_stop_tokens_are_always_kept_and_maps_round_trip():
    counts = Counter({t: 100 - t for t in range(10, 60)})  # the stop tokens 2 and 999 never supervised
    vocab = build_draft_vocab(counts, 8, 1000, always=[2, 999])
    assert vocab.kept.tolist() == [2, 10, 11, 12, 13, 14, 15, 999]
    target = torch.tensor([[2, 13, 999, 500]])
    draft = vocab.to_draft(target)
    assert draft.tolist() == [[0, 4, 7, -100]]  # 500 is outside: the loss ignores it
    assert vocab.to_target(draft[:, :3]).tolist() == [[2, 13, 999]]
    covered = sum(counts[t] for t in range(10, 16))
    assert vocab.coverage(counts) == pytest.approx(covered / sum(counts.values()))


def test_supervised_tokens_only_are_counted():
    assert count_supervised([([5, 6, 6, 7], [0, 1, 1, 0]), ([6, 8], [1, 1])]) == Counter({6: 3, 8: 1})


@pytest.mark.parametrize("size", [1, 1000, 1001])
def test_a_size_outside_2_to_below_the_vocabulary_is_one_line(size):
    with pytest.raises(UserError, match=rf"draft_vocab_size {size} must be in 2..999"):
        build_draft_vocab(Counter({1: 1}), size, 1000)


def test_a_d2t_t2d_pair_that_disagrees_is_one_line():
    vocab = build_draft_vocab(Counter({t: 1 for t in range(20)}), 8, 100)
    t2d = vocab.t2d.clone()
    t2d[50] = True
    with pytest.raises(UserError, match="d2t and t2d disagree"):
        draft_vocab_from_tensors(vocab.d2t, t2d, "ckpt")
    with pytest.raises(UserError, match="ascending target ids"):
        swapped = vocab.kept[[1, 0, *range(2, 8)]]
        draft_vocab_from_tensors(swapped - torch.arange(8), vocab.t2d, "ckpt")
    with pytest.raises(UserError, match="d2t must be int64"):
        draft_vocab_from_tensors(vocab.d2t.int(), vocab.t2d, "ckpt")
