"""DDTree: the draft tree built from one DFlash block pass, for tree-verified speculative decoding.

This file holds the tree: its construction (paper Alg. 1, best-first), the DFlash chain as
a degenerate tree, the tree attention mask and the accept walk. The decoding loop that
verifies trees with the target lives in `dflash_train/decoding/decode.py`.

The drafter gives one marginal q_d per depth d = 1..L (block slots 1..B-1). A prefix u
has q(u) = prod_d q_d(u_d), and E[accepted] = sum over tree nodes of q(u), so the best tree
of `budget` non-root nodes is the top-`budget` prefixes by q(u) (prefix-closed, since a
prefix never scores below its extensions). Only the top K = min(budget, V) tokens per depth
can appear: a node of rank r needs its r higher-ranked siblings in the tree before it.

Best-first search pops prefixes in order of decreasing q(u) with a heap that holds, for
each popped node, at most its next sibling and its first child: O(budget log budget).
Ties in q(u) go to the lexicographically smaller rank path (ranks from depth 1 down).

The path-conditioned tree (DSpark drafters) is the same search with q_d(u_d | u_<d): each
node's children are ranked by the drafter's next-slot distribution given that node's path
(`dspark.MarkovScorer`), so siblings' subtrees differ. Scores stay products of per-step
probabilities, so the same argument gives the top-`budget` prefixes, prefix-closed.

Numbering: index 0 is the root (the bonus token, not drafted); node i of `tokens` is
index i + 1. Nodes are numbered in pop order, so log-probs are non-increasing with the
index and every parent index is below its children's.
"""

import heapq
import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor      # [n] long, token of each non-root node, in pop order
    depths: torch.Tensor      # [n] long, depth of each node; root children are at depth 1
    parents: torch.Tensor     # [n+1] long, parent index in [root + nodes] numbering; parents[0] == -1
    visibility: torch.Tensor  # [n+1, n+1] bool, visibility[i, j]: j is i or an ancestor of i
    log_probs: torch.Tensor   # [n] float32, path log-prob: sum of per-depth log-probs along the path
    children: list[dict[int, int]]  # [n+1] per index: token -> child index (for the accept walk)
    ranks: list[int]          # [n] rank of each node among its parent's children
                              # (0: the drafter's argmax there)
    best_child: list[int]     # [n+1] per index: the drafter's argmax child token, in the tree or not
                              # (-1: none known)

    @property
    def size(self) -> int:
        """n, the number of non-root nodes (the verify width is n + 1)."""
        return self.tokens.shape[0]


def top_k_log_probs(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_logits [L, V] -> (logp [L, k] float32, ids [L, k] long), best first per depth.
    The normaliser is over the full vocabulary, so logp are true log-probs, not top-k renormalised."""
    logits = draft_logits.float()
    values, ids = torch.topk(logits, k, dim=-1)  # [L, k], [L, k]
    peak = values[:, :1] if k > 0 else logits.amax(-1, keepdim=True)  # [L, 1] each row's max
    logp = values - log_normaliser(logits, peak)  # [L, k]
    return logp, ids


def log_normaliser(logits: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(logits, -1, keepdim=True), bit for bit, given each row's max (peak [L, 1],
    the top-K's first value): torch's own steps (an infinite max shifts by 0, as there), less its
    pass over the [L, V] logits to find the max and one [L, V] temporary (exp in place)."""
    shift = peak.nan_to_num(nan=math.nan, posinf=0.0, neginf=0.0)  # [L, 1], one op for torch's masked_fill
    return torch.sub(logits, shift).exp_().sum(-1, keepdim=True).log_().add_(shift)  # [L, 1]


def best_first(expand, root_token: int, root_carry, L: int, budget: int):
    """Pop the top-`budget` prefixes, best first.

    expand(token, carry, depth) gives the children of a node at `depth` carrying `token`:
    (logp row, ids row, the carry its children share), best first: lists or numpy rows, read an
    entry at a time through float() and int() (exact: float32 -> float64 adds no rounding).
    DFlash's marginals ignore token and carry (one row per depth); a conditional
    scorer (dspark.MarkovScorer) scores each node's children given its path. A node is
    expanded when it is popped (to push its first child), so every tree node above depth L
    knows its best child. Scores are sums of per-step log-probs, so a prefix never scores
    above its parent or its better-ranked siblings and the popped set is prefix-closed.
    Returns Python lists: tokens, depths, parents (with the root's -1 first), log_probs,
    children, ranks, best_child.

    A heap entry is (-logw, rank path, parent index); the rank path's last entry is the
    rank at its own depth, its length the depth. The rank path after -logw breaks ties
    (and makes every key unique, so the comparison never reaches the parent index)."""
    tokens, depths, parents, ranks = [], [], [-1], []
    path_logw = [0.0]  # [1 + popped] path log-prob per index; the root's is 0
    children: list[dict[int, int]] = [{}]
    rows = [expand(root_token, root_carry, 0)]  # per index: its children's (logp, ids, carry)
    best_child = [int(rows[0][1][0])]
    heap = [(-float(rows[0][0][0]), (0,), 0)]
    pop, push = heapq.heappop, heapq.heappush  # local names: this loop runs `budget` times per round
    for idx in range(1, budget + 1):
        if not heap:
            break
        neg_logw, rank_path, parent = pop(heap)
        d, r = len(rank_path), rank_path[-1]
        logp, ids, carry = rows[parent]
        token, logw = int(ids[r]), -neg_logw
        tokens.append(token)
        depths.append(d)
        parents.append(parent)
        ranks.append(r)
        path_logw.append(logw)
        children.append({})
        children[parent][token] = idx
        # Both pushes extend a popped path by one term (parent's sum + this depth's logp)
        # rather than the reference's `logw - logp[r] + logp[r+1]`: the same value, but a
        # plain left-to-right sum, so equal per-depth log-probs give bit-equal keys and
        # ties fall to the rank path instead of rounding noise (and -inf stays -inf, not nan).
        if r + 1 < len(logp):  # next sibling: same parent, rank r + 1
            push(heap, (-(path_logw[parent] + float(logp[r + 1])), rank_path[:-1] + (r + 1,), parent))
        if d < L:              # first child: depth d + 1, rank 0
            row = expand(token, carry, d)
            rows.append(row)
            best_child.append(int(row[1][0]))
            push(heap, (-(logw + float(row[0][0])), rank_path + (0,), idx))
        else:
            rows.append(None)
            best_child.append(-1)
    return tokens, depths, parents, path_logw[1:], children, ranks, best_child


def visibility_mask(parents: list[int], max_depth: int) -> torch.Tensor:
    """parents [n+1] (parents[0] == -1) -> [n+1, n+1] bool ancestor-or-self mask.
    Walks every node up one level per step, all nodes at once: max_depth + 1 vectorised
    steps instead of one Python step per node. The root is its own parent for the walk.
    In numpy: its small-array indexing costs half torch's here."""
    up = np.array(parents)                   # [n+1]
    up[0] = 0                                # root -> root
    m = up.shape[0]
    rows = np.arange(m)                      # [n+1]
    vis = np.zeros((m, m), dtype=np.bool_)  # [n+1, n+1]
    cur = rows
    for _ in range(max_depth + 1):  # a node at depth d reaches the root after d steps
        vis[rows, cur] = True
        cur = up[cur]
    return torch.from_numpy(vis)


def root_only_tree() -> DraftTree:
    """The tree with no drafted nodes: verification checks the bonus token alone."""
    return DraftTree(tokens=torch.zeros(0, dtype=torch.long), depths=torch.zeros(0, dtype=torch.long),
                     parents=torch.tensor([-1]), visibility=torch.ones(1, 1, dtype=torch.bool),
                     log_probs=torch.zeros(0), children=[{}], ranks=[], best_child=[-1])


def build_tree(draft_logits: torch.Tensor, budget: int, scorer=None,
               token_ids: torch.Tensor | None = None) -> DraftTree:
    """draft_logits [L, V] (any float dtype and device; row d-1 is depth d) -> the best
    DDTree of `budget` non-root nodes (fewer if there are fewer than `budget` prefixes; in a marginal
    tree a token whose logit is -inf, outside a draft vocabulary, is never a node).

    token_ids [V] long: the token id of each column (a draft vocabulary's kept target ids, so
    logits [L, N] in draft space give a tree of target ids); None: column j is token j.

    scorer None: DDTree from the per-depth marginals (a node's children are the top-K of its
    depth's distribution, whoever the parent is). A conditional scorer (dspark.MarkovScorer,
    built from the drafter's heads) ranks each node's children by the drafter's next-slot
    distribution given the node's path; draft_logits are then the backbone's logits it
    conditions, over the full vocabulary (the variants with scorers have no draft vocabulary, so
    nothing is counted: K = min(budget, V)). Returned tensors are on CPU."""
    if draft_logits.dim() != 2:
        raise ValueError(f"draft_logits must be [L, V], got shape {tuple(draft_logits.shape)}")
    if token_ids is not None and (scorer is not None or token_ids.shape != draft_logits.shape[1:]):
        raise ValueError(f"token_ids {tuple(token_ids.shape)} must name each of the {draft_logits.shape[1]} "
                         "columns of draft_logits, and only marginal trees take them")
    if budget <= 0:
        return root_only_tree()
    L, V = draft_logits.shape
    if scorer is None:
        found = marginal_search(draft_logits, min(budget, V), budget, token_ids)
    else:
        expand, root_token, root_carry = scorer.expander(draft_logits, min(budget, V))
        found = best_first(expand, root_token, root_carry, L, budget)
    tokens, depths, parents, log_probs, children, ranks, best_child = found
    return DraftTree(tokens=as_tensor(tokens, np.int64), depths=as_tensor(depths, np.int64),
                     parents=as_tensor(parents, np.int64), visibility=visibility_mask(parents, max(depths)),
                     log_probs=as_tensor(log_probs, np.float32), children=children, ranks=ranks,
                     best_child=best_child)


def marginal_search(draft_logits: torch.Tensor, K: int, budget: int, token_ids: torch.Tensor | None):
    """best_first over the per-depth marginals (a node's children are its depth's top-K, whoever the
    parent), depths scored as the search first reads them (MarginalRows). token_ids as in build_tree."""
    rows = MarginalRows(draft_logits, K, token_ids)
    if rows.finite:
        found = best_first(rows.expand, -1, None, draft_logits.shape[0], budget)
        if rows.finite:
            return found
    # A draft vocabulary scattered into [L, V] leaves -inf outside it, and those tokens are never
    # nodes: K drops to the fewest finite logits of a row, counted over all L rows as before. A row's
    # finite logits come first in its top-K, so counting them there gives that number whenever it is
    # below K, with no pass over all L x V logits (which cost twice the top-K); logits in draft space
    # are all finite and never get here. (One difference: a row never scored cannot lower K, where
    # before it could; only logits whose rows mask different tokens tell, and every draft
    # vocabulary masks the same ones in every row.)
    fewest = max(1, int(torch.isfinite(top_k_log_probs(draft_logits, K)[0]).sum(-1).min()))
    if fewest < K:
        return marginal_search(draft_logits, fewest, budget, token_ids)  # the top-K of counting first
    # a row all -inf: K = 1, as before
    return best_first(rows.expand, -1, None, draft_logits.shape[0], budget)


# Depths scored before the search starts; the next block is 2 more, then the rest. Random logits at
# V = 151,936 (tree_build.py) give trees of depth 3-4 of 15 at budgets 64-1024, which read 4-6 rows;
# a confident drafter's reach all 15, at two more top-K calls on fewer rows each (~0.1 ms).
FIRST_DEPTHS = 4


class MarginalRows:
    """The marginals' rows for best_first, scored (top-K and normaliser over V) a block of depths at
    a time when the search first reads one: a popped node at depth d reads the row of depth d + 1
    only, so the rows below the tree's deepest node plus one are never scored (most of them for a
    shallow tree). Blocks give one call's bits, both being per row; none is a single row, whose sum
    torch may split across threads. Rows stay numpy: best_first reads ~2 entries per popped node,
    where turning whole rows into Python lists cost ~1 ms at 15 x 1024 (a confident drafter's
    tree at budget 1024). finite: every scored top-K log-prob is finite."""

    def __init__(self, draft_logits: torch.Tensor, K: int, token_ids: torch.Tensor | None):
        self.logits, self.K, self.token_ids = draft_logits, K, token_ids
        self.logp: list[np.ndarray] = []  # per scored depth [K] float32, best first
        self.ids: list[np.ndarray] = []  # [K] int64
        self.finite = True
        L = draft_logits.shape[0]
        self.score(L if L <= FIRST_DEPTHS + 1 else FIRST_DEPTHS)

    def score(self, end: int) -> None:
        """Score the depths from the next unscored one to `end` (exclusive, rows of draft_logits)."""
        logp, ids = top_k_log_probs(self.logits[len(self.logp):end], self.K)  # [n, K], [n, K]
        if self.token_ids is not None:
            ids = self.token_ids[ids]  # columns -> token ids
        rows = logp.detach().cpu().numpy()
        self.finite = self.finite and all(map(math.isfinite, rows[:, -1].tolist()))  # -inf sorts last
        self.logp += list(rows)
        self.ids += list(ids.cpu().numpy())

    def expand(self, token, carry, depth):
        if depth == len(self.logp):  # the first node at depth `depth` was popped
            L, n = self.logits.shape[0], len(self.logp)
            self.score(n + 2 if n == FIRST_DEPTHS and n + 4 <= L else L)  # (never a block of one row)
        return self.logp[depth], self.ids[depth], None


def as_tensor(values: list, dtype) -> torch.Tensor:
    """torch.tensor(values) through numpy, which reads a Python list ~3x faster (float32: the same
    round-to-nearest from the Python floats)."""
    return torch.from_numpy(np.array(values, dtype=dtype))


def chain_tree(tokens: torch.Tensor) -> DraftTree:
    """The DFlash chain as a tree: tokens [L] (argmax per block slot), each the child of the last."""
    n = tokens.shape[0]
    toks = tokens.tolist()
    parents = torch.arange(-1, n)  # [n+1]: root -1, node i+1 -> i
    children = [{toks[i]: i + 1} for i in range(n)] + [{}]
    return DraftTree(tokens=tokens.to("cpu", torch.long), depths=torch.arange(1, n + 1), parents=parents,
                     visibility=torch.ones(n + 1, n + 1, dtype=torch.bool).tril(),
                     log_probs=torch.zeros(n), children=children, ranks=[0] * n, best_child=toks + [-1])


RANK_CAP = 3  # calibration cells pool ranks 3 and beyond


def calibration_counts(tree: DraftTree, accepted: list[int], posterior: list[int]) -> dict:
    """The drafter's stated probability against what the target did, at every node the target
    actually judged: each child of an accepted node (the root included). Its stated probability is
    the drafter's score for it given its parent, exp(log_prob(child) - log_prob(parent)): the
    marginal at its depth for DFlash, the path-conditioned one for DSpark / DFlash2. It is a hit
    when it carries the target's pick there (posterior[parent]: the argmax at temperature 0, a
    sample otherwise, so the hit rate estimates the target's probability of that token).
    Returns {(depth, min(rank, RANK_CAP)): [sum of stated probabilities, hits, nodes]}."""
    lp = [0.0] + tree.log_probs.tolist()  # [n+1], the root's path log-prob is 0
    cells = {}
    for parent in accepted:
        for tok, child in tree.children[parent].items():
            cell = cells.setdefault((int(tree.depths[child - 1]), min(tree.ranks[child - 1], RANK_CAP)),
                                    [0.0, 0, 0])
            cell[0] += math.exp(lp[child] - lp[parent])
            cell[1] += int(tok == posterior[parent])
            cell[2] += 1
    return cells


def add_cells(into: dict, cells: dict) -> dict:
    """Sum calibration cells (calibration_counts' {(depth, rank): [stated, hits, nodes]}) into `into`."""
    for key, cell in cells.items():
        into[key] = [a + b for a, b in zip(into.get(key, (0.0, 0, 0)), cell)]
    return into


def tree_attention_mask(tree: DraftTree, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, n+1, past+n+1] for verifying [root + nodes] after `past` cached
    tokens: every row sees the whole prefix, and inside the tree only its ancestors and itself."""
    n1 = tree.size + 1
    visible = torch.cat([torch.ones(n1, past, dtype=torch.bool), tree.visibility], dim=1).to(device)
    mask = torch.zeros(n1, past + n1, dtype=dtype, device=device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[None, None]


def accept_walk(tree: DraftTree, posterior: list[int]) -> tuple[list[int], int]:
    """Follow the target's own choices down the tree.

    posterior[i] is the token the target picks after node i (argmax at temperature 0, one
    independent sample from its distribution otherwise). Starting at the root, step to the
    child carrying that token while there is one. Every emitted token is thus a token the
    target itself chose given the accepted path so far, so the output distribution is the
    target's exactly (the drafter only decides which guesses get checked).
    Returns the accepted indices (root first) and the next bonus token.
    """
    accepted, cur = [0], 0
    while posterior[cur] in tree.children[cur]:
        cur = tree.children[cur][posterior[cur]]
        accepted.append(cur)
    return accepted, posterior[cur]


def spine_counts(tree: DraftTree, path: list[int], next_tokens: list[int | None]) -> list[int]:
    """Does the drafter's best child under an accepted node name the target's next token?
    path: the accepted node indices below the root, in depth order; next_tokens[i]: the
    target's token after path[i] (None: unknown). A node is on the spine when it and all its
    ancestors are rank 0 (the drafter's argmax path), off the spine when it is itself not the
    drafter's argmax under its parent. Nodes at the last depth have no next slot.
    Returns summable counts [on-spine hits, on-spine nodes, off-spine hits, off-spine nodes]."""
    counts, on_spine = [0, 0, 0, 0], True
    for node, nxt in zip(path, next_tokens):
        rank = tree.ranks[node - 1]
        on_spine = on_spine and rank == 0
        if nxt is None or tree.best_child[node] < 0 or not (on_spine or rank > 0):
            continue
        at = 0 if on_spine else 2
        counts[at] += int(tree.best_child[node] == nxt)
        counts[at + 1] += 1
    return counts
