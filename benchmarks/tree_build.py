"""Time DDTree construction (`build_tree`) at the DFlash block shape, on CPU.

    .venv/bin/python benchmarks/tree_build.py [--threads N]

L = 15 depths (block 16), V = 151936 (Qwen3 vocabulary), random float32 logits.
Per budget: one warm-up, then the median of RUNS runs of the whole `build_tree` and of
its three parts timed one by one:
  topk: log-softmax normaliser + top-K on the [L, V] tensor (torch)
  heap: the device-to-host copy of the [L, K] lists and the best-first pops (Python)
  vis:  the [n+1, n+1] ancestor-or-self mask (torch, one step per depth)
--threads sets torch's intra-op threads: on a few busy cores a parallel op such as the
mask's zero fill can wait a whole scheduler slice (~4 ms) for a descheduled worker.
"""

import argparse
import statistics
import time

import torch

from dflash_train.ddtree import best_first, build_tree, top_k_log_probs, visibility_mask

L, V = 15, 151936
BUDGETS = [16, 64, 256, 1024]
RUNS = 20


def median_ms(fn) -> float:
    fn()  # warm-up
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description="Time DDTree construction on CPU.")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    logits = 4 * torch.randn(L, V)  # [L, V]
    print(f"L={L} V={V} torch threads={torch.get_num_threads()} median of {RUNS}")
    print(f"{'budget':>6} {'total ms':>9} {'topk ms':>8} {'heap ms':>8} {'vis ms':>7}")
    for budget in BUDGETS:
        k = min(budget, V)
        logp, ids = top_k_log_probs(logits, k)
        parents = torch.tensor(best_first(*torch.stack([logp.double(), ids.double()]).tolist(), budget)[2])
        total = median_ms(lambda: build_tree(logits, budget))
        topk = median_ms(lambda: top_k_log_probs(logits, k))
        heap = median_ms(lambda: best_first(*torch.stack([logp.double(), ids.double()]).tolist(), budget))
        vis = median_ms(lambda: visibility_mask(parents, L))
        print(f"{budget:>6} {total:>9.2f} {topk:>8.2f} {heap:>8.2f} {vis:>7.2f}")


if __name__ == "__main__":
    main()
