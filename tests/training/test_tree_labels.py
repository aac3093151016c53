"""Tree-distillation labels are exact: the target's logits at every node of trees packed behind a
sequence (one forward, ancestor-only mask) equal a separate target forward over the sequence up
to the anchor followed by the node's root-to-node path."""

import pytest
import torch

from dflash_train.decoding.ddtree import build_tree
from dflash_train.model.target import load_target
from dflash_train.training.tree_labels import packed_trees, tree_target_logits


def node_paths(tree):
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = [()]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + (tokens[i - 1],))
    return paths  # the root's () first


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tree_logits_equal_separate_path_forwards(arch, qwen3_random_target_dir, llama_target_dir):
    target = load_target(str(qwen3_random_target_dir if arch == "qwen3" else llama_target_dir))
    V = target.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (24,), generator=g)
    anchors = [3, 11, 23]  # the last: a tree after the whole sequence
    trees = [build_tree(torch.randn(4, V, generator=g), budget) for budget in (6, 12, 9)]
    got = tree_target_logits(target.model, ids, anchors, trees)
    for a, tree, logits in zip(anchors, trees, got):
        assert logits.shape == (tree.size + 1, V)
        for row, path in enumerate(node_paths(tree)):
            seq = torch.cat([ids[: a + 1], torch.tensor(path, dtype=torch.long)])[None]
            with torch.no_grad():
                ref = target.model(input_ids=seq).logits[0, -1]
            torch.testing.assert_close(logits[row], ref, rtol=1e-4, atol=1e-4)


def test_packing_keeps_the_sequence_causal_and_trees_apart():
    ids = torch.arange(10)
    trees = [build_tree(torch.randn(3, 20), 5), build_tree(torch.randn(3, 20), 4)]
    tokens, positions, visible, rows = packed_trees(ids, [2, 7], trees)
    T = 10
    assert (torch.equal(visible[:T, :T], torch.ones(T, T, dtype=torch.bool).tril())
            and not visible[:T, T:].any())
    first, second = rows[0][1:], rows[1][1:]
    assert not visible[first][:, second].any() and not visible[second][:, first].any()
    assert (not visible[first][:, 3:T].any() and visible[second][:, :8].all()
            and not visible[second][:, 8:T].any())
    assert positions[first].tolist() == (2 + trees[0].depths).tolist()
    with pytest.raises(ValueError, match="outside the sequence"):
        packed_trees(ids, [10], trees[:1])
