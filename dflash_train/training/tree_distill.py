"""Tree distillation: train the drafter's scores at every node of the tree it drafts.

A drafter is trained on the data's tokens (the spine). The tree it is decoded with also offers
siblings, and once the target accepts one, the drafter's next-slot scores given that sibling are
what build the next depth; no dataset holds the target's distribution there, so those scores are
untrained (measured off the spine on SmolLM2: right 0-11% of the time). Here the target supplies it.

Recipe section `tree_distill` (weight 0: off). Every `every` optimizer steps, for up to `anchors`
blocks of one sequence of the step's first micro-batch, the drafter's own tree of `budget` nodes is
built from its current scores (detached; the same scorer validation and decoding use), the frozen
target is run once over the sequence and the packed trees with the ancestor-only mask
(tree_target_logits), and at the root and every node above the last depth the
drafter's distribution for the next slot given that node's path is pulled toward the target's:

    loss_tree = mean over nodes n of KL(p_target(. | path n) || q_drafter(. | path n))

q is the variant's, as the decoder's tree scores a node's children (Variant.node_log_probs; h_t: the
block's final states, slot t; a node at depth d carrying token x, the root carrying the bonus token at
depth 0). Plain DFlash's is the marginal q = softmax(lm_head(h_{d+1})), one q per depth whatever x; a
variant's may span a support of its own (then p is restricted to it and renormalised).

What it trains: the variant's conditional head only. The block's
states h are detached: the backbone's scores are the same for every sibling at a depth, so the KL's
gradient there would pull the spine's marginal toward the average of the target's distributions
after each sibling; the base loss keeps the backbone on the spine. So a DFlash drafter (no
conditional head) has nothing to distil (the recipe check refuses it). The target runs under no_grad.

The target's labels come from one forward: each anchor's tree is packed behind the sequence, every
node sees the sequence up to its anchor and its own ancestors (the mask decoding verifies with,
ddtree.tree_attention_mask), and the logits are read at every node:

    logits = tree_target_logits(target.model, ids, anchors, trees)
    logits[i]   # [n_i + 1, V]: row 0 after the anchor's own token (the root), row j after node j

Conventions as in decoding: anchor a's root is the sequence's token at a (the bonus token of a
decoding round), a node at depth d sits at position a + d, siblings share a position.

Cost of a distilled step: one target forward over T + anchors * budget tokens (attention over its
square), `anchors` tree builds (as validation's) and [anchors * (budget + 1), V] drafter logits.
"""

import torch

from dflash_train.decoding.ddtree import DraftTree, build_tree


def pick_blocks(valid: torch.Tensor, anchors: int, step: int) -> tuple[int, list[int]]:
    """valid [b, A, K] (the micro-batch's slots) -> (row, block indices in it): the first row from
    step mod b on with a valid block (its first slot supervised), and up to `anchors` of its valid
    blocks, evenly spaced. Deterministic in the step, so a resumed run distils the same blocks.
    (-1, []) when no block is valid."""
    b = valid.shape[0]
    for i in range(b):
        row = (step + i) % b
        ok = valid[row, :, 0].nonzero().flatten().tolist()
        if ok:
            n = min(anchors, len(ok))
            return row, [ok[j * len(ok) // n] for j in range(n)]
    return -1, []


def node_log_probs(model, lm_head, hidden: torch.Tensor, tree: DraftTree, bonus: int):
    """The drafter's next-slot log-probabilities at the root and every node above the last depth
    (Variant.node_log_probs). hidden [B, H] (the block's final states), lm_head: the target's frozen
    head -> (rows [m] the nodes' indices in [root + nodes] numbering, support [m, S] long or None (the
    full vocabulary), logq [m, S] float32)."""
    L = hidden.shape[0] - 1
    tokens = torch.cat([torch.tensor([bonus]), tree.tokens]).to(hidden.device)  # [n+1]
    depths = torch.cat([torch.tensor([0]), tree.depths]).to(hidden.device)
    rows = (depths < L).nonzero().flatten()  # nodes with a next slot: root first, parents before children
    parents = tree.parents.to(hidden.device)[rows]
    # the parents renumbered into rows (a node's parent is above the last depth, so among them)
    index = torch.full((tree.size + 1,), -1, dtype=torch.long, device=rows.device)
    index[rows] = torch.arange(len(rows), device=rows.device)
    parents = torch.where(parents >= 0, index[parents.clamp(min=0)], -1)
    support, logq = model.variant.node_log_probs(model, lm_head, hidden, tokens[rows], depths[rows], parents)
    return rows, support, logq


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


def tree_distillation_loss(model, target, ids: torch.Tensor, block_hidden: torch.Tensor, anchors: list[int],
                           budget: int, conditional=None) -> tuple[torch.Tensor, dict]:
    """One sequence's blocks. model: the unwrapped drafter; target: dflash_train.model.target.Target;
    ids [T] (the sequence, no padding); block_hidden [n, B, H] (those blocks' final states; read
    detached); anchors: their positions in ids (slot 0 = the token there); conditional: (hidden [B, H],
    bonus) -> the tree's scorer (validate.cpu_tree_scorer), None for the marginal tree.
    -> (mean KL over the nodes, with grad in the conditional head; {"nodes": m, "agree": how many nodes'
    argmax q is the target's argmax}).

    The trees are built from detached scores: which branches are offered is the decoder's choice,
    not something to differentiate through."""
    lm_head, block_hidden = target.lm_head, block_hidden.detach()  # the head's term (module docstring)
    trees, bonus = [], ids[anchors].tolist()
    with torch.no_grad():
        for h, x in zip(block_hidden, bonus):
            scorer = None if conditional is None else conditional(h.detach().to("cpu", torch.float32), x)
            trees.append(build_tree(lm_head(h[1:]).float(), budget, scorer))
        p_logits = tree_target_logits(target.model, ids, anchors, trees)  # per tree [n+1, V]
    kl, nodes, agree = 0.0, 0, 0
    for h, tree, x, p in zip(block_hidden, trees, bonus, p_logits):
        rows, support, logq = node_log_probs(model, lm_head, h, tree, x)
        p = p[rows].float()
        logp = torch.log_softmax(p if support is None else p.gather(-1, support), dim=-1)
        kl = kl + (logp.exp() * (logp - logq)).sum()
        nodes += len(rows)
        agree += int((logq.argmax(-1) == logp.argmax(-1)).sum())
    return kl / max(nodes, 1), {"nodes": nodes, "agree": agree}
