"""Tree-distillation labels: the frozen target's next-token logits at every node of drafted trees,
for several anchors of one training sequence, in one target forward.

A drafter is trained on the data's tokens: the spine. The tree it is decoded with offers siblings
too, and after one is accepted its conditional scores are what decide the next depth; no dataset
holds the target's distribution there. The target can give it: pack each anchor's tree behind the
sequence, let every tree node see the sequence up to its anchor and its own ancestors (the mask
decoding verifies with, ddtree.tree_attention_mask), and read the logits at every node.

    logits = tree_target_logits(target.model, ids, anchors, trees)
    logits[i]   # [n_i + 1, V]: row 0 after the anchor's own token (the root), row j after node j

Conventions as in decoding: anchor a's root is the sequence's token at a (the bonus token of a
decoding round), a node at depth d sits at position a + d, siblings share a position.
"""

import torch

from dflash_train.decoding.ddtree import DraftTree


def packed_trees(ids: torch.Tensor, anchors: list[int], trees: list[DraftTree]):
    """ids [T] long; anchors (positions in ids, each the root of its tree) -> (tokens [T + N],
    positions [T + N], visible [T + N, T + N] bool, rows: per tree the rows of its root and nodes).
    N is the trees' total size. The sequence rows are causal and see no tree row."""
    T = ids.shape[0]
    total = T + sum(t.size for t in trees)
    visible = torch.zeros(total, total, dtype=torch.bool)
    visible[:T, :T] = torch.ones(T, T, dtype=torch.bool).tril()
    tokens, positions, rows, off = [ids.cpu()], [torch.arange(T)], [], T
    for a, tree in zip(anchors, trees):
        if not 0 <= a < T:
            raise ValueError(f"anchor {a} is outside the sequence of {T} tokens")
        n = tree.size
        nodes = slice(off, off + n)
        visible[nodes, : a + 1] = True                      # the sequence up to the root
        visible[nodes, nodes] = tree.visibility[1:, 1:]     # the node's ancestors and itself
        tokens.append(tree.tokens)
        positions.append(a + tree.depths)
        rows.append(torch.cat([torch.tensor([a]), torch.arange(off, off + n)]))
        off += n
    return torch.cat(tokens), torch.cat(positions), visible, rows


@torch.no_grad()
def tree_target_logits(model, ids: torch.Tensor, anchors: list[int],
                       trees: list[DraftTree]) -> list[torch.Tensor]:
    """The target's logits at each tree's root and nodes (see the module docstring), one forward
    of width T + N with an additive [1, 1, T+N, T+N] mask. Cost: one target pass over the
    sequence and the nodes, and attention over (T + N)^2 pairs, so keep N near T (a few anchors
    of a small budget)."""
    device = next(model.parameters()).device
    tokens, positions, visible, rows = packed_trees(ids, anchors, trees)
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    out = model(input_ids=tokens[None].to(device), position_ids=positions[None].to(device),
                attention_mask=mask[None, None].to(device), use_cache=False)
    logits = out.logits[0]
    return [logits[r.to(device)] for r in rows]
