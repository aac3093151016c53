"""DDTree: the draft tree built from one DFlash block pass, for tree-verified speculative decoding.

This file holds the tree: its construction (paper Alg. 1, best-first), the DFlash chain as
a degenerate tree, the tree attention mask and the accept walk. The decoding loop that
verifies trees with the target lives in `dflash_train/decode.py`.

The drafter gives one marginal q_d per depth d = 1..L (block slots 1..B-1). A prefix u
has q(u) = prod_d q_d(u_d), and E[accepted] = sum over tree nodes of q(u), so the best tree
of `budget` non-root nodes is the top-`budget` prefixes by q(u) (prefix-closed, since a
prefix never scores below its extensions). Only the top K = min(budget, V) tokens per depth
can appear: a node of rank r needs its r higher-ranked siblings in the tree before it.

Best-first search pops prefixes in order of decreasing q(u) with a heap that holds, for
each popped node, at most its next sibling and its first child: O(budget log budget).
Ties in q(u) go to the lexicographically smaller rank path (ranks from depth 1 down).

Numbering: index 0 is the root (the bonus token, not drafted); node i of `tokens` is
index i + 1. Nodes are numbered in pop order, so log-probs are non-increasing with the
index and every parent index is below its children's.
"""

import heapq
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor      # [n] long, token of each non-root node, in pop order
    depths: torch.Tensor      # [n] long, depth of each node; root children are at depth 1
    parents: torch.Tensor     # [n+1] long, parent index in [root + nodes] numbering; parents[0] == -1
    visibility: torch.Tensor  # [n+1, n+1] bool, visibility[i, j]: j is i or an ancestor of i
    log_probs: torch.Tensor   # [n] float32, path log-prob: sum of per-depth log-probs along the path
    children: list[dict[int, int]]  # [n+1] per index: token -> child index (for the accept walk)

    @property
    def size(self) -> int:
        """n, the number of non-root nodes (the verify width is n + 1)."""
        return self.tokens.shape[0]


def top_k_log_probs(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_logits [L, V] -> (logp [L, k] float32, ids [L, k] long), best first per depth.
    The normaliser is over the full vocabulary, so logp are true log-probs, not top-k renormalised."""
    logits = draft_logits.float()
    values, ids = torch.topk(logits, k, dim=-1)                     # [L, k], [L, k]
    logp = values - torch.logsumexp(logits, dim=-1, keepdim=True)  # [L, k]
    return logp, ids


def best_first(logp: list[list[float]], ids: list[list[float]], budget: int):
    """Pop the top-`budget` prefixes from per-depth top-K lists (logp[d-1][r], ids[d-1][r],
    ids as ints or integral floats).
    Returns Python lists: tokens, depths, parents (with the root's -1 first), log_probs, children.

    A heap entry is (-logw, rank path, parent index); the rank path's last entry is the
    rank at its own depth, its length the depth. The rank path after -logw breaks ties
    (and makes every key unique, so the comparison never reaches the parent index)."""
    L, K = len(logp), len(logp[0])
    tokens, depths, parents = [], [], [-1]
    path_logw = [0.0]  # [1 + popped] path log-prob per index; the root's is 0
    children: list[dict[int, int]] = [{}]
    heap = [(-logp[0][0], (0,), 0)]
    while heap and len(tokens) < budget:
        neg_logw, ranks, parent = heapq.heappop(heap)
        d, r = len(ranks), ranks[-1]
        idx = len(tokens) + 1
        token = int(ids[d - 1][r])
        tokens.append(token)
        depths.append(d)
        parents.append(parent)
        path_logw.append(-neg_logw)
        children.append({})
        children[parent][token] = idx
        # Both pushes extend a popped path by one term (parent's sum + this depth's logp)
        # rather than the reference's `logw - logp[r] + logp[r+1]`: the same value, but a
        # plain left-to-right sum, so equal per-depth log-probs give bit-equal keys and
        # ties fall to the rank path instead of rounding noise (and -inf stays -inf, not nan).
        if r + 1 < K:  # next sibling: same parent, rank r + 1
            heapq.heappush(heap, (-(path_logw[parent] + logp[d - 1][r + 1]), ranks[:-1] + (r + 1,), parent))
        if d < L:      # first child: depth d + 1, rank 0
            heapq.heappush(heap, (-(path_logw[idx] + logp[d][0]), ranks + (0,), idx))
    return tokens, depths, parents, path_logw[1:], children


def visibility_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [n+1] long (parents[0] == -1) -> [n+1, n+1] bool ancestor-or-self mask.
    Walks every node up one level per step, all nodes at once: max_depth + 1 vectorised
    steps instead of one Python step per node. The root is its own parent for the walk."""
    m = parents.shape[0]
    up = parents.clamp(min=0)                  # [n+1], root -> root
    rows = torch.arange(m)                     # [n+1]
    vis = torch.zeros(m, m, dtype=torch.bool)  # [n+1, n+1]
    cur = rows
    for _ in range(max_depth + 1):  # a node at depth d reaches the root after d steps
        vis[rows, cur] = True
        cur = up[cur]
    return vis


def root_only_tree() -> DraftTree:
    """The tree with no drafted nodes: verification checks the bonus token alone."""
    return DraftTree(tokens=torch.zeros(0, dtype=torch.long), depths=torch.zeros(0, dtype=torch.long),
                     parents=torch.tensor([-1]), visibility=torch.ones(1, 1, dtype=torch.bool),
                     log_probs=torch.zeros(0), children=[{}])


def build_tree(draft_logits: torch.Tensor, budget: int) -> DraftTree:
    """draft_logits [L, V] (any float dtype and device; row d-1 is depth d) -> the best
    DDTree of `budget` non-root nodes (fewer if there are fewer than `budget` prefixes).
    Returned tensors are on CPU."""
    if draft_logits.dim() != 2:
        raise ValueError(f"draft_logits must be [L, V], got shape {tuple(draft_logits.shape)}")
    if budget <= 0:
        return root_only_tree()
    L, V = draft_logits.shape
    logp, ids = top_k_log_probs(draft_logits, min(budget, V))  # [L, K], [L, K]
    # One device-to-host copy: ids ride along as float64 (exact below 2**53) and only
    # the popped ones are turned back into ints, so Python touches O(budget) entries.
    logp_list, ids_list = torch.stack([logp.double(), ids.double()]).tolist()
    tokens, depths, parents, log_probs, children = best_first(logp_list, ids_list, budget)
    parents_t = torch.tensor(parents, dtype=torch.long)  # [n+1]
    return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long), depths=torch.tensor(depths, dtype=torch.long),
                     parents=parents_t, visibility=visibility_mask(parents_t, max(depths)),
                     log_probs=torch.tensor(log_probs, dtype=torch.float32), children=children)


def chain_tree(tokens: torch.Tensor) -> DraftTree:
    """The DFlash chain as a tree: tokens [L] (argmax per block slot), each the child of the last."""
    n = tokens.shape[0]
    toks = tokens.tolist()
    parents = torch.arange(-1, n)  # [n+1]: root -1, node i+1 -> i
    children = [{toks[i]: i + 1} for i in range(n)] + [{}]
    return DraftTree(tokens=tokens.to("cpu", torch.long), depths=torch.arange(1, n + 1), parents=parents,
                     visibility=torch.ones(n + 1, n + 1, dtype=torch.bool).tril(),
                     log_probs=torch.zeros(n), children=children)


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
