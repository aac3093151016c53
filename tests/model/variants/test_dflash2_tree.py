"""The DFlash2 selector as the draft tree's conditional scorer: the tree holds exactly the top-`budget`
prefixes under the selector's conditional scores (brute-force enumeration, scores from speculators'
own CandidateSelector), and its spine is the greedy selector walk."""

import itertools

import pytest
import torch

from dflash_train.decoding.ddtree import build_tree
from dflash_train.model.variants import dflash2

V, H, R = 64, 16, 8


def random_selector(top_k: int, seed: int) -> dflash2.CandidateSelector:
    torch.manual_seed(seed)
    sel = dflash2.CandidateSelector(V, H, rank=R, top_k=top_k)
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_(0, 0.8)  # large: the selector re-ranks candidates
    return sel


def brute_force(sel, hidden, unary, bonus):
    """Every prefix over the slots' unary top-K candidates with its conditional log-probability,
    from speculators' CandidateSelector.select (scores) and the unary candidate mass."""
    from speculators.models.dflash2.model_definitions import CandidateSelector

    ref = CandidateSelector(vocab_size=V, hidden_size=H, rank=R, top_k=sel.top_k)
    ref.load_state_dict(sel.state_dict())
    L = unary.shape[0]
    cands = [ref.select(unary[t], hidden[t], torch.tensor(0))[0].tolist() for t in range(L)]
    log_mass = [torch.logsumexp(unary[t][cands[t]], 0) - torch.logsumexp(unary[t], 0) for t in range(L)]

    def step(t, before, token):
        ids, scores = ref.select(unary[t], hidden[t], torch.tensor(before))
        return float(log_mass[t] + torch.log_softmax(scores.double(), 0)[ids.tolist().index(token)])

    prefixes = {}
    for d in range(1, L + 1):
        for path in itertools.product(*cands[:d]):
            before, logq = bonus, 0.0
            for t, tok in enumerate(path):
                logq += step(t, before, tok)
                before = tok
            prefixes[path] = logq
    return prefixes


def tree_paths(tree):
    paths = {}
    for i in range(1, tree.size + 1):
        path, node = [], i
        while node > 0:
            path.append(int(tree.tokens[node - 1]))
            node = int(tree.parents[node])
        paths[tuple(reversed(path))] = float(tree.log_probs[i - 1])
    return paths


@pytest.mark.parametrize("top_k, L, seed", [(3, 3, 0), (4, 3, 1), (2, 4, 2)])
@torch.no_grad()
def test_selector_tree_is_the_top_prefixes_under_conditional_scores(top_k, L, seed):
    sel = random_selector(top_k, seed)
    hidden, unary = torch.randn(L, H), torch.randn(L, V) * 3
    bonus = 7
    prefixes = brute_force(sel, hidden, unary, bonus)
    block = torch.cat([torch.randn(1, H), hidden])  # the scorer takes the whole block; slot 0 is not read
    ranked = sorted(prefixes.items(), key=lambda kv: -kv[1])
    for budget in [1, 2, 5, 9, len(prefixes), len(prefixes) + 5]:
        tree = build_tree(unary, budget, dflash2.SelectorScorer(sel, block, bonus))
        paths = tree_paths(tree)
        assert len(paths) == min(budget, len(prefixes))
        assert set(paths) == {p for p, _ in ranked[: len(paths)]}, budget  # no ties with random scores
        for p, logq in paths.items():
            assert logq == pytest.approx(prefixes[p], abs=1e-5)


@torch.no_grad()
def test_rank_zero_path_is_the_selector_chain_and_children_differ_by_parent():
    sel = random_selector(4, 3)
    L = 5
    hidden, unary = torch.randn(L, H), torch.randn(L, V) * 3
    bonus = 11
    tree = build_tree(unary, 200, dflash2.SelectorScorer(sel, torch.cat([torch.randn(1, H), hidden]), bonus))
    chain = dflash2.selector_chain(sel, hidden, unary, bonus).tolist()
    node, spine = 0, []
    for tok in chain:  # the chain's path is in the tree, every step the best child
        node = tree.children[node][tok]
        spine.append(node)
        assert tree.ranks[node - 1] == 0
    assert [int(tree.tokens[i - 1]) for i in spine] == chain
    # path conditioning: siblings at depth 1 rank their children differently (the marginal tree never does)
    orders = {tuple(sorted(tree.children[c], key=tree.children[c].get)) for c in tree.children[0].values()
              if len(tree.children[c]) == 4}
    assert len(orders) > 1
    plain = build_tree(unary, 200)  # from the marginals: every parent's children in slot 2's unary order
    marginal = unary[1].topk(V).indices.tolist()
    for c in plain.children[0].values():
        kids = sorted(plain.children[c], key=plain.children[c].get)
        assert kids == marginal[: len(kids)]
