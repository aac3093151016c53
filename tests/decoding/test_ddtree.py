"""DDTree construction against a brute-force reference: enumerate every prefix, score it,
sort by (-score, rank path), take the top `budget`."""

import itertools

import pytest
import torch

import dflash_train.decoding.ddtree as ddtree
from dflash_train.decoding.ddtree import DraftTree, build_tree, top_k_log_probs


def reference_order(logp64: torch.Tensor, tokens_of: list[list[int]]) -> list[tuple]:
    """All prefixes over ranks 0..R-1 as token paths, best first. logp64 [L, R] float64 per
    depth and rank; tokens_of[d][r] is the token of rank r at depth d + 1. Scores are rounded so that
    mathematically equal sums tie (float64 rounding must not break a tie the tree breaks by rank path)."""
    L, R = logp64.shape
    logp = logp64.tolist()
    scored = []
    for length in range(1, L + 1):
        for ranks in itertools.product(range(R), repeat=length):
            score = sum(logp[d][r] for d, r in enumerate(ranks))
            scored.append((-round(score, 9), ranks))
    scored.sort()
    return [tuple(tokens_of[d][r] for d, r in enumerate(ranks)) for _, ranks in scored]


def full_vocab_order(logits: torch.Tensor) -> tuple[list[tuple], dict[tuple, float]]:
    """Reference over the whole vocabulary (distinct logits): token paths best first, and
    each path's float64 log-prob."""
    logp64 = torch.log_softmax(logits.double(), dim=-1)          # [L, V]
    order = torch.argsort(logp64, dim=-1, descending=True)       # [L, V] rank -> token
    ranked = torch.gather(logp64, 1, order)                      # [L, V] by rank
    paths = reference_order(ranked, order.tolist())
    logp = logp64.tolist()
    scores = {p: sum(logp[d][t] for d, t in enumerate(p)) for p in paths}
    return paths, scores


def node_paths(tree: DraftTree) -> list[tuple]:
    """Token path of every non-root node, following parents (independent of depths/visibility)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = [()]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + (tokens[i - 1],))
    return paths[1:]


def check_tree(tree: DraftTree, expected: list[tuple], scores: dict[tuple, float] | None = None):
    """The tree holds exactly `expected` (token paths, in order) and its fields agree with them."""
    n = len(expected)
    assert tree.size == n and tree.parents.shape == (n + 1,) and tree.visibility.shape == (n + 1, n + 1)
    assert node_paths(tree) == expected
    index = {(): 0} | {p: i + 1 for i, p in enumerate(expected)}
    assert tree.tokens.tolist() == [p[-1] for p in expected]
    assert tree.depths.tolist() == [len(p) for p in expected]
    assert tree.parents.tolist() == [-1] + [index[p[:-1]] for p in expected]
    assert all(tree.parents[i] < i for i in range(1, n + 1))
    # ancestor-or-self: j is visible from i iff j's path is a prefix of i's (root = empty path)
    vis = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    for i, p in enumerate([()] + expected):
        vis[i, [index[p[:k]] for k in range(len(p) + 1)]] = True
    assert torch.equal(tree.visibility, vis)
    assert sum(len(c) for c in tree.children) == n
    for p in expected:
        assert tree.children[index[p[:-1]]][p[-1]] == index[p]
    lp = tree.log_probs
    assert lp.dtype == torch.float32 and bool((lp[1:] <= lp[:-1]).all())
    if scores is not None:
        torch.testing.assert_close(lp.double(),
                                   torch.tensor([scores[p] for p in expected], dtype=torch.float64),
                                   atol=1e-5, rtol=0)


def budgets_for(count: int) -> list[int]:
    """Every small budget plus a few up to past the number of prefixes."""
    return sorted(set(range(10)) | {count // 3, count // 2, count - 1, count, count + 1, count + 5})


@pytest.mark.parametrize("L", [1, 2, 3, 4])
@pytest.mark.parametrize("V", [2, 3, 5, 6])
def test_matches_brute_force(L, V):
    for seed in range(3):
        g = torch.Generator().manual_seed(1000 * L + 10 * V + seed)
        logits = 3 * torch.randn(L, V, generator=g)
        paths, scores = full_vocab_order(logits)
        assert len(paths) == sum(V ** d for d in range(1, L + 1))
        for budget in budgets_for(len(paths)):
            check_tree(build_tree(logits, budget), paths[:max(budget, 0)], scores)


def tied_order(logits: torch.Tensor, budget: int) -> list[tuple]:
    """Reference for tied logits, in rank space: which of two equal logits is rank 0 is
    topk's choice, so ranks map to tokens through the same top-K the tree uses."""
    K = min(budget, logits.shape[1])
    _, ids = top_k_log_probs(logits, K)                                             # [L, K]
    logp64 = torch.gather(torch.log_softmax(logits.double(), dim=-1), 1, ids)  # [L, K]
    return reference_order(logp64, ids.tolist())


@pytest.mark.parametrize("kind", ["uniform", "two_values"])
def test_ties_follow_rank_path(kind):
    for L, V, seed in [(1, 4, 0), (2, 3, 1), (3, 3, 2), (3, 4, 3), (4, 2, 4)]:
        g = torch.Generator().manual_seed(seed)
        if kind == "uniform":  # every prefix of one depth ties
            logits = torch.randn(L, 1, generator=g).expand(L, V).contiguous()
        else:  # two logit values per depth: prefixes tie when their per-depth values match
            pool = torch.randn(L, 2, generator=g)
            logits = torch.gather(pool, 1, torch.randint(0, 2, (L, V), generator=g))
        count = sum(V ** d for d in range(1, L + 1))
        for budget in budgets_for(count):
            check_tree(build_tree(logits, budget), tied_order(logits, budget)[:max(budget, 0)])


def test_uniform_tree_is_breadth_first():
    tree = build_tree(torch.zeros(2, 2), budget=6)
    # ranks (0), (1), (0,0), (0,1), (1,0), (1,1)
    assert tree.depths.tolist() == [1, 1, 2, 2, 2, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert sorted(tree.tokens[:2].tolist()) == [0, 1]


def test_budget_zero_is_root_only():
    for budget in [0, -3]:
        tree = build_tree(torch.randn(4, 7), budget)
        assert tree.size == 0 and tree.tokens.dtype == torch.long
        assert tree.parents.tolist() == [-1] and tree.visibility.tolist() == [[True]]
        assert tree.depths.numel() == 0 and tree.log_probs.numel() == 0 and tree.children == [{}]


def test_budget_past_all_prefixes():
    tree = build_tree(torch.randn(3, 3), budget=1000)
    assert tree.size == 3 + 9 + 27


def test_top_k_is_min_of_budget_and_vocab(monkeypatch):
    seen = []

    def recording(logits, k):
        seen.append(k)
        return top_k_log_probs(logits, k)

    monkeypatch.setattr(ddtree, "top_k_log_probs", recording)
    logits = torch.randn(3, 500)
    tree = build_tree(logits, budget=7)
    build_tree(logits[:, :4], budget=50)
    assert seen == [7, 4]
    top7 = torch.topk(logits, 7).indices
    for t, d in zip(tree.tokens.tolist(), tree.depths.tolist()):
        assert t in top7[d - 1].tolist()
    logp, ids = top_k_log_probs(logits, 7)
    assert logp.shape == ids.shape == (3, 7) and logp.dtype == torch.float32 and ids.dtype == torch.long
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1).gather(1, ids))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_input_matches_float32_upcast(dtype):
    logits = (4 * torch.randn(5, 64, generator=torch.Generator().manual_seed(7))).to(dtype)
    for budget in [1, 15, 100]:
        a, b = build_tree(logits, budget), build_tree(logits.float(), budget)
        for name in ["tokens", "depths", "parents", "visibility", "log_probs"]:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.children == b.children


def test_masked_vocabulary_gives_no_nan():
    logits = torch.full((2, 5), float("-inf"))
    logits[:, :2] = torch.tensor([1.0, 0.0])
    tree = build_tree(logits, budget=30)  # 5 + 25 prefixes, only 2 + 4 with probability above 0
    assert tree.size == 6 and not tree.log_probs.isnan().any() and tree.log_probs.isfinite().all()
    # p = (0.73, 0.27) per depth: (0) .73, (0,0) .53, (1) .27, (0,1) = (1,0) .20, (1,1) .07
    assert tree.tokens[:6].tolist() == [0, 0, 1, 1, 0, 1] and tree.depths[:6].tolist() == [1, 2, 1, 2, 2, 2]


def test_rows_with_different_finite_counts_take_the_fewest():
    """K is the fewest finite logits of any row (2 here, not row 0's 3): depth 1 keeps only its top 2."""
    logits = torch.full((2, 6), float("-inf"))
    logits[0, :3] = torch.tensor([2.0, 1.0, 0.0])
    logits[1, 3:5] = torch.tensor([0.5, 0.0])
    tree = build_tree(logits, budget=30)
    assert node_paths(tree) == [(0,), (0, 3), (0, 4), (1,), (1, 3), (1, 4)]
    assert tree.log_probs.isfinite().all()


def test_full_vocabulary_logits_are_read_by_the_top_k_and_the_normaliser_only():
    """Nothing else passes over the [L, V] logits: counting a draft vocabulary's finite columns with
    a scan cost twice the top-K at V = 151,936 on every round of every full-vocabulary drafter."""
    from torch.overrides import TorchFunctionMode

    logits, seen = torch.randn(4, 300), set()

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, torch.Tensor) and a.shape == logits.shape for a in args):
                seen.add(func.__name__)
            return func(*args, **(kwargs or {}))

    with Record():
        tree = build_tree(logits, 20)
    assert (tree.size == 20
            and seen <= {"__get__", "__getitem__", "dim", "float", "topk", "sub", "exp_", "sum"}), seen


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    return (all(torch.equal(getattr(a, f), getattr(b, f)) for f in ["tokens", "depths", "parents",
                                                                    "visibility", "log_probs"])
            and (a.children, a.ranks, a.best_child) == (b.children, b.ranks, b.best_child))


def all_depths_tree(monkeypatch, logits, budget, **kw) -> DraftTree:
    """build_tree as it was: every depth scored in one call before the search."""
    with monkeypatch.context() as m:
        m.setattr(ddtree, "FIRST_DEPTHS", 10 ** 6)
        return build_tree(logits, budget, **kw)


def test_depths_scored_as_the_search_reads_them_give_the_same_tree(monkeypatch):
    """Depths are scored a block at a time when the search first reads one (MarginalRows): the tree is
    the one from every depth scored at once, field for field: shallow and deep trees, every L, ties,
    bf16, scattered vocabularies (uniform and uneven), token ids."""
    g = torch.Generator().manual_seed(11)
    deep = 0.3 * torch.randn(15, 500, generator=g)
    deep[:, 7] += 20  # a confident drafter: one token per depth, the tree reaches all 15
    masked = 4 * torch.randn(15, 800, generator=g)
    masked[:, 100:] = float("-inf")
    uneven = 4 * torch.randn(6, 300, generator=g)
    uneven[torch.rand(6, 300, generator=g) < 0.5] = float("-inf")
    cases = [4 * torch.randn(15, 3000, generator=g), deep, torch.randn(6, 40, generator=g).round(),
             (2 * torch.randn(15, 500, generator=g)).bfloat16(), torch.zeros(3, 9), masked, uneven]
    cases += [4 * torch.randn(L, 200, generator=g) for L in range(1, 10)]
    for logits in cases:
        for budget in [1, 2, 5, 64, 300, 1024]:
            assert same_tree(build_tree(logits, budget), all_depths_tree(monkeypatch, logits, budget)), \
                (logits.shape, budget)
    ids = torch.randperm(5000, generator=g)[:3000]
    assert same_tree(build_tree(cases[0], 64, token_ids=ids), all_depths_tree(monkeypatch, cases[0], 64,
                                                                               token_ids=ids))


def test_a_shallow_tree_scores_only_the_depths_it_reaches(monkeypatch):
    """Random logits at a large vocabulary give shallow trees: the top-K and normaliser run on the depths
    the search reads (the tree's and the one below its deepest), in blocks of 4, 2 and the rest, not
    on all 15; a confident drafter's tree reaches all 15. Row blocks give one call's bits."""
    g, rows = torch.Generator().manual_seed(3), []
    real = ddtree.top_k_log_probs
    monkeypatch.setattr(ddtree, "top_k_log_probs",
                        lambda logits, k: rows.append(logits.shape[0]) or real(logits, k))
    shallow = 4 * torch.randn(15, 20000, generator=g)
    for budget in [64, 256, 1024]:
        rows.clear()
        depth = int(build_tree(shallow, budget).depths.max())
        assert (sum(rows) == min(b for b in (4, 6, 15) if b >= depth + 1) and rows[0] == 4), (budget, depth,
                                                                                              rows)
        assert budget == 1024 or sum(rows) < 15
    deep = 0.3 * torch.randn(15, 20000, generator=g)
    deep[:, 0] += 20
    rows.clear()
    assert build_tree(deep, 64).depths.max() == 15 and rows == [4, 2, 9]
    logp, ids = real(shallow, 64)
    blocks = [real(shallow[a:b], 64) for a, b in [(0, 4), (4, 6), (6, 15)]]
    assert (torch.equal(torch.cat([b[0] for b in blocks]),
                        logp) and torch.equal(torch.cat([b[1] for b in blocks]), ids))


def test_log_normaliser_is_logsumexp_bit_for_bit():
    """The normaliser takes each row's max from the top-K instead of a pass of its own: the same bits as
    torch.logsumexp, on finite rows, rows with -inf, a row all -inf, a row with +inf and one with NaN."""
    g = torch.Generator().manual_seed(5)
    for L, V in [(3, 7), (15, 151936), (4, 1001)]:
        logits = 8 * torch.randn(L, V, generator=g)
        logits[0, ::3] = float("-inf")
        if L > 3:
            logits[1] = float("-inf")
            logits[2, 5] = float("inf")
            logits[3, 0] = float("nan")
        peak = torch.topk(logits, 2, dim=-1).values[:, :1]
        ours, torchs = ddtree.log_normaliser(logits, peak), torch.logsumexp(logits, -1, keepdim=True)
        assert (torch.equal(ours.isnan(), torchs.isnan()) and torch.equal(ours.nan_to_num(),
                                                                          torchs.nan_to_num()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_input_gives_cpu_tree():
    logits = torch.randn(15, 1000)
    a, b = build_tree(logits.cuda(), 64), build_tree(logits, 64)
    assert (a.tokens.device.type == "cpu" and torch.equal(a.tokens, b.tokens)
            and torch.equal(a.parents, b.parents))


# --- the path-conditioned tree (DSpark): the same brute force under conditional scores ---------

def markov_reference(head, base: torch.Tensor, hidden: torch.Tensor, bonus: int, candidates: int):
    """The distribution dspark.MarkovScorer documents, recomputed in float64 with the head's own
    `step`: cond_logp(path)[v] = log p(token v at depth len(path)+1 | the path's tokens), and the
    candidate tokens of each depth (the backbone's top-M, the only tokens a tree node may carry)."""
    import copy

    head = copy.deepcopy(head).double()
    base, hidden = base.double(), hidden.double()
    cand = torch.topk(base, min(candidates, base.shape[1]), dim=-1).indices  # [L, M]

    def cond_logp(path: tuple) -> list[float]:
        d = len(path)
        prevs = [bonus, bonus, *path]  # the previous token of block slots 0, 1, ..., d + 1
        state = torch.zeros(head.rank, dtype=torch.float64) if head.head_type == "rnn" else None
        for slot in range(d + 2):
            u, state = head.step(state, head.markov_w1.weight[prevs[slot]], hidden[slot])
        z = base[d].clone()
        z[cand[d]] += head.markov_w2.weight[cand[d]] @ u  # the bias on the candidate columns only
        return torch.log_softmax(z, -1).tolist()  # normalised over the whole vocabulary

    return cond_logp, cand.tolist()


def conditional_order(cond_logp, cand: list[list[int]]) -> tuple[list[tuple], dict[tuple, float]]:
    """Every path of candidate tokens up to depth L, best first by (score, rank path), where a
    token's rank is its place among its parent's children (by the parent's conditional log-prob)."""
    scored, scores = [], {}
    frontier = [((), 0.0, ())]
    for d in range(len(cand)):
        nxt = []
        for path, score, ranks in frontier:
            logp = cond_logp(path)
            for r, v in enumerate(sorted(cand[d], key=lambda v: -logp[v])):
                p, s = path + (v,), score + logp[v]
                scores[p] = s
                scored.append((-round(s, 9), ranks + (r,), p))
                nxt.append((p, s, ranks + (r,)))
        frontier = nxt
    scored.sort()
    return [p for _, _, p in scored], scores


def random_markov_scorer(head_type: str, L: int, V: int, candidates: int, seed: int):
    from dflash_train.model.variants.dspark import MarkovHead, MarkovScorer

    g = torch.Generator().manual_seed(seed)
    H, r = 8, 4
    head = MarkovHead(V, r, H, head_type)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g))  # biases of the base logits' size
    base, hidden = 2 * torch.randn(L, V, generator=g), torch.randn(L + 1, H, generator=g)
    bonus = int(torch.randint(0, V, (1,), generator=g))
    return head, base, hidden, bonus, MarkovScorer(head, hidden, bonus, candidates)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("L, V, candidates",
                         [(2, 4, 2), (2, 4, 4), (3, 5, 1), (3, 5, 3), (3, 5, 99), (2, 30, 6)])
def test_conditional_tree_matches_brute_force(head_type, L, V, candidates):
    """The path-conditioned tree holds the top-`budget` prefixes under the conditional scores the
    builder documents (the Markov bias on the backbone's top-`candidates` tokens per depth, the
    exact conditional distribution once candidates >= V), for every budget."""
    head, base, hidden, bonus, scorer = random_markov_scorer(head_type, L, V, candidates,
                                                             seed=L * 100 + V + candidates)
    cond_logp, cand = markov_reference(head, base, hidden, bonus, candidates)
    paths, scores = conditional_order(cond_logp, cand)
    M = min(candidates, V)
    assert len(paths) == sum(M ** d for d in range(1, L + 1))
    marginal = full_vocab_order(base)[1]
    assert max(abs(scores[p] - marginal[p]) for p in paths) > 0.1  # the scores really are conditional
    for budget in budgets_for(len(paths)):
        tree = build_tree(base, budget, scorer)
        check_tree(tree, paths[:max(budget, 0)], scores)
        if budget > 0:  # each node's best child is its conditional argmax among the candidates
            for i, p in enumerate(node_paths(tree), start=1):
                if len(p) < L:
                    logp = cond_logp(p)
                    assert tree.best_child[i] == max(cand[len(p)], key=lambda v: logp[v])


@pytest.mark.parametrize("candidates", [1, 3, 7, 40])
def test_conditional_tree_without_bias_is_the_plain_tree(candidates):
    """With W2 = 0 the conditional distribution is the backbone's marginal whatever the parent:
    whenever the candidates cover the top-K (K = min(budget, V)), the tree is today's DDTree."""
    for head_type in ["vanilla", "gated", "rnn"]:
        head, base, hidden, bonus, scorer = random_markov_scorer(head_type, 4, 40, candidates,
                                                                 seed=candidates)
        with torch.no_grad():
            head.markov_w2.weight.zero_()
        for budget in [b for b in [1, 3, 5, 7, 30, 120] if min(b, 40) <= candidates]:
            a, b = build_tree(base, budget, scorer), build_tree(base, budget)
            for name in ["tokens", "depths", "parents", "visibility"]:
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=1e-5)
            assert a.children == b.children and a.ranks == b.ranks and a.best_child == b.best_child


def test_spine_counts():
    """Spine diagnostics on a hand-checked tree: V = 3, two depths, marginals (token 0 best at
    depth 1, then token 1; token 2 best at depth 2)."""
    from dflash_train.decoding.ddtree import spine_counts

    logits = torch.tensor([[3.0, 2.0, -5.0], [-5.0, 0.0, 3.0]])
    tree = build_tree(logits, budget=6)
    # pop order: (0), (0,2), (1), (1,2), (0,1), (1,1)
    assert node_paths(tree) == [(0,), (0, 2), (1,), (1, 2), (0, 1), (1, 1)]
    assert tree.ranks == [0, 0, 1, 0, 1, 1] and tree.best_child == [0, 2, -1, 2, -1, -1, -1]
    assert spine_counts(tree, [1, 2], [2, 7]) == [1, 1, 0, 0]  # on the spine, best child 2 is right
    assert spine_counts(tree, [3, 4], [2, 0]) == [0, 0, 1, 1]  # off it (token 1 is rank 1), right again
    assert spine_counts(tree, [3], [1]) == [0, 0, 0, 1]        # ... and wrong
    assert spine_counts(tree, [3], [None]) == [0, 0, 0, 0]     # no known next token
    chain = ddtree.chain_tree(torch.tensor([4, 5]))
    assert chain.ranks == [0, 0] and chain.best_child == [4, 5, -1]
    assert spine_counts(chain, [1, 2], [5, 9]) == [1, 1, 0, 0]


def test_calibration_counts_against_float64():
    """Every child of an accepted node is judged once: its stated probability is its depth's
    float64 softmax (a marginal tree), its rank its rank there, a hit when it carries the
    target's pick under its parent."""
    torch.manual_seed(3)
    L, V = 3, 6
    logits = torch.randn(L, V)
    tree = build_tree(logits, 12)
    paths = [()] + node_paths(tree)
    index = {p: i for i, p in enumerate(paths)}
    logp64 = torch.log_softmax(logits.double(), dim=-1)
    rank_of = torch.argsort(torch.argsort(logits, dim=-1, descending=True), dim=-1)  # [L, V] token -> rank
    # the target picks the rank-1 token under the root, then the argmax child, then a token not in the tree
    first = paths[tree.children[0][int(torch.argsort(logits[0], descending=True)[1])]]
    second = first + (int(logits[1].argmax()),)
    accepted = [0, index[first], index[second]]
    posterior = [0] * len(paths)
    posterior[0], posterior[index[first]] = first[0], second[-1]
    posterior[index[second]] = next(t for t in range(V) if t not in tree.children[index[second]])
    expected = {}
    for parent in accepted:
        for path in paths:
            if len(path) == len(paths[parent]) + 1 and path[:-1] == paths[parent]:
                d, tok = len(path), path[-1]
                cell = expected.setdefault((d, min(int(rank_of[d - 1, tok]), ddtree.RANK_CAP)), [0.0, 0, 0])
                cell[0] += float(logp64[d - 1, tok].exp())
                cell[1] += int(tok == posterior[parent])
                cell[2] += 1
    got = ddtree.calibration_counts(tree, accepted, posterior)
    assert set(got) == set(expected) and sum(c[1] for c in got.values()) == 2  # two accepted nodes
    for key, (p, hits, n) in expected.items():
        assert got[key][1:] == [hits, n], key
        assert got[key][0] == pytest.approx(p, rel=1e-5), key
