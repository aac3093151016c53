"""Time DDTree construction (`build_tree`) at the DFlash block shape, on CPU: the plain tree
from per-depth marginals and DSpark's and DFlash2's path-conditioned trees, in one run.

    .venv/bin/python benchmarks/tree_build.py [--threads N]

L = 15 depths (block 16), V = 151936 (Qwen3 vocabulary), random float32 logits.
Per budget: one warm-up, then the median of RUNS runs of the whole `build_tree` and of
its three parts timed one by one:
  topk: log-softmax normaliser + top-K on the [L, V] tensor (torch)
  heap: the device-to-host copy of the [L, K] lists and the best-first pops (Python)
  vis:  the [n+1, n+1] ancestor-or-self mask (torch, one step per depth)
Path-conditioned (`dspark.MarkovScorer`, Qwen3-8B's shape: Markov rank 256, hidden 4096, random
weights giving a bias of about one logit): the whole `build_tree(logits, budget, scorer)` for
the vanilla, gated and rnn heads with the default 256 candidates per depth, timed in turn with
the plain build (run i of each back to back, so both see the same machine load), and the ratio
of the two medians; the same for DFlash2's selector tree (`dflash2.SelectorScorer`: rank 256,
top-16 candidates per slot, one [L, K, K] table of edge scores per block). For scale: the exact conditional tree needs a full-vocabulary [V, r]
mat-vec per expanded node (about `budget` of them); one is timed at the end.
--threads sets torch's intra-op threads: on a few busy cores a parallel op such as the
mask's zero fill can wait a whole scheduler slice (~4 ms) for a descheduled worker.
"""

import argparse
import statistics
import time

import torch

from dflash_train.decoding.ddtree import best_first, build_tree, top_k_log_probs, visibility_mask
from dflash_train.model.variants.dflash2 import CandidateSelector, SelectorScorer
from dflash_train.model.variants.dspark import MarkovHead, MarkovScorer, TREE_CANDIDATES

L, V = 15, 151936
RANK, HIDDEN = 256, 4096  # Qwen3-8B DSpark
BUDGETS = [16, 64, 256, 1024]
CONDITIONAL_BUDGETS = [16, 64, 256]
RUNS = 20


def median_ms(fn, runs: int = RUNS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def plain_rows(logits: torch.Tensor) -> dict[int, float]:
    print(f"{'budget':>6} {'total ms':>9} {'topk ms':>8} {'heap ms':>8} {'vis ms':>7}")
    totals = {}
    for budget in BUDGETS:
        k = min(budget, V)
        logp, ids = top_k_log_probs(logits, k)

        def heap():
            lp, ii = torch.stack([logp.double(), ids.double()]).tolist()
            return best_first(lambda token, carry, depth: (lp[depth], ii[depth], None), -1, None, L, budget)

        parents = torch.tensor(heap()[2])
        totals[budget] = median_ms(lambda: build_tree(logits, budget))
        topk = median_ms(lambda: top_k_log_probs(logits, k))
        heap_ms = median_ms(heap)
        vis = median_ms(lambda: visibility_mask(parents, L))
        print(f"{budget:>6} {totals[budget]:>9.2f} {topk:>8.2f} {heap_ms:>8.2f} {vis:>7.2f}")
    return totals


def random_head(head_type: str) -> MarkovHead:
    head = MarkovHead(V, RANK, HIDDEN, head_type)
    with torch.no_grad():
        head.markov_w1.weight.normal_(0, 0.1)
        head.markov_w2.weight.normal_(0, 0.6)  # bias std ~ sqrt(256) * 0.1 * 0.6 ~ 1 logit
    return head.eval()


def paired_ms(plain, conditional) -> tuple[float, float]:
    """Medians of RUNS alternating runs of the two builds (after one warm-up of each)."""
    plain(), conditional()
    a, b = [], []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        plain()
        t1 = time.perf_counter()
        conditional()
        a.append(t1 - t0)
        b.append(time.perf_counter() - t1)
    return 1e3 * statistics.median(a), 1e3 * statistics.median(b)


def main():
    parser = argparse.ArgumentParser(description="Time DDTree construction on CPU.")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    logits = 4 * torch.randn(L, V)  # [L, V]
    hidden = torch.randn(L + 1, HIDDEN)  # [B, H]
    print(f"L={L} V={V} torch threads={torch.get_num_threads()} median of {RUNS}")
    print("\nplain DDTree (per-depth marginals)")
    plain_rows(logits)

    print(f"\npath-conditioned DDTree (MarkovScorer, rank {RANK}, hidden {HIDDEN}, {TREE_CANDIDATES} candidates "
          f"per depth), paired with the plain build: ms plain / ms conditional (ratio)")
    print(f"{'budget':>6} " + " ".join(f"{h:>24}" for h in ("vanilla", "gated", "rnn", "DFlash2 selector")))
    cells = {b: [] for b in CONDITIONAL_BUDGETS}
    with torch.no_grad():
        for head_type in ("vanilla", "gated", "rnn"):
            head = random_head(head_type)
            scorer = MarkovScorer(head, hidden, bonus=7)
            for budget in CONDITIONAL_BUDGETS:
                a, b = paired_ms(lambda: build_tree(logits, budget), lambda: build_tree(logits, budget, scorer))
                cells[budget].append(f"{a:6.2f} / {b:6.2f} ({b / a:4.2f}x)")
            if head_type == "vanilla":
                w2, u = head.markov_w2.weight, torch.randn(RANK)
                matvec = median_ms(lambda: w2 @ u)
            del head, scorer
        selector = CandidateSelector(V, HIDDEN, RANK, top_k=16)
        scorer = SelectorScorer(selector, hidden, bonus=7)
        for budget in CONDITIONAL_BUDGETS:
            a, b = paired_ms(lambda: build_tree(logits, budget), lambda: build_tree(logits, budget, scorer))
            cells[budget].append(f"{a:6.2f} / {b:6.2f} ({b / a:4.2f}x)")
    for budget in CONDITIONAL_BUDGETS:
        print(f"{budget:>6} " + " ".join(f"{c:>24}" for c in cells[budget]))
    print(f"\none full-vocabulary [V, r] mat-vec (what the exact tree needs per expanded node): {matvec:.2f} ms")


if __name__ == "__main__":
    main()
