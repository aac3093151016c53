"""Time DDTree construction (`build_tree`) at the DFlash block shape, on CPU: the plain tree
from per-depth marginals and DSpark's and DFlash2's path-conditioned trees, in one run.

    .venv/bin/python benchmarks/tree_build.py [--threads N] [--official PATH [--official-only]]

L = 15 depths (block 16), V = 151936 (Qwen3 vocabulary), random float32 logits.
Per budget: one warm-up, then the median of RUNS runs of the whole `build_tree` and of
its three parts timed one by one:
  topk: log-softmax normaliser + top-K on the whole [L, V] tensor (torch); build_tree scores only
        the depths its search reads (4-6 of 15 here), so its total can be below this part
  heap: the best-first pops over numpy rows (Python)
  vis:  the [n+1, n+1] ancestor-or-self mask (numpy, one step per depth)
Path-conditioned (`dspark.MarkovScorer`, Qwen3-8B's shape: Markov rank 256, hidden 4096, random weights giving
a bias of about one logit): the whole `build_tree(logits, budget, scorer)` for the vanilla, gated and rnn
heads with the default 256 candidates per depth, timed in turn with the plain build (run i of each back to
back, so both see the same machine load), and the ratio of the two medians; the same for DFlash2's selector
tree (`dflash2.SelectorScorer`: rank 256, top-16 candidates per slot, one [L, K, K] table of edge scores per
block). For scale: the exact conditional tree needs a full-vocabulary [V, r] mat-vec per expanded node (about
`budget` of them); one is timed at the end.
--threads sets torch's intra-op threads: on a few busy cores a parallel op such as the
mask's zero fill can wait a whole scheduler slice (~4 ms) for a descheduled worker.

--official PATH adds the plain build against the official construction, `build_ddtree_tree` in
liranringel/ddtree's ddtree.py (git clone https://github.com/liranringel/ddtree; c96427a measured): at budgets
64, 256 and 1024 the two run alternately (who goes first swaps each round) for --rounds rounds on the same
logits; medians, their ratio (ours / official), the median of the per-round ratios, whether the trees are the
same (tokens, depths, parents, mask, child maps) and the tree's depth. Twice: on the random logits above
(trees of depth 3-4) and on the same with one token per depth at p ~0.9 (a confident drafter: trees of depth
15). The function is read out of the file with `ast` (the module itself imports transformers, loguru and the
repository's model package) and run with a CPU stand-in for its stage timer (`cuda_time` synchronises CUDA);
nothing of it is copied here. Writes --output (benchmarks/results/tree_build.json). --official-only skips the
other sections.
"""

import argparse
import ast
import hashlib
import heapq
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dflash_train.decoding.ddtree import best_first, build_tree, top_k_log_probs, visibility_mask
from dflash_train.evaluation.summary import hardware_record
from dflash_train.model.variants.dflash2 import CandidateSelector, SelectorScorer
from dflash_train.model.variants.dspark import MarkovHead, MarkovScorer, TREE_CANDIDATES

L, V = 15, 151936
RANK, HIDDEN = 256, 4096  # Qwen3-8B DSpark
BUDGETS = [16, 64, 256, 1024]
CONDITIONAL_BUDGETS = [16, 64, 256]
RUNS = 20
OFFICIAL_BUDGETS = [64, 256, 1024]
ROOT = Path(__file__).resolve().parents[1]


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
            lp, ii = list(logp.numpy()), list(ids.numpy())
            return best_first(lambda token, carry, depth: (lp[depth], ii[depth], None), -1, None, L, budget)

        parents = heap()[2]
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


def load_official(path: Path):
    """`build_ddtree_tree` out of the official ddtree.py, without importing its module."""
    tree = ast.parse(path.read_text())
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_ddtree_tree"]
    if not fn:
        sys.exit(f"error: {path} has no build_ddtree_tree (expected liranringel/ddtree's ddtree.py)")
    names = {"heapq": heapq, "time": time, "np": np, "torch": torch,
             "cuda_time": time.perf_counter,  # CPU: nothing to synchronise
             "empty_stage_times": lambda stages: {s: 0.0 for s in stages},
             "DDTREE_TREE_BUILD_STAGE_ORDER": ("tree_build_copy", "tree_build_heap", "tree_build_visibility")}
    exec(compile(ast.Module(body=fn, type_ignores=[]), str(path), "exec"), names)
    return names["build_ddtree_tree"]


def same_tree(ours, official) -> bool:
    tokens, depths, parents, child_maps, visibility, _ = official
    return (torch.equal(ours.tokens, tokens) and torch.equal(ours.depths, depths)
            and ours.parents.tolist() == parents and torch.equal(ours.visibility, visibility)
            and ours.children == child_maps)


def confident(logits: torch.Tensor) -> torch.Tensor:
    """The same logits with one token per depth raised to 22 (probability ~0.9): trees reach all L depths,
    as a confident drafter's do, where random logits' reach 3-4."""
    g = torch.Generator().manual_seed(1)
    out = logits.clone()
    out[torch.arange(L), torch.randint(V, (L,), generator=g)] = 22.0
    return out


def official_rows(logits: torch.Tensor, official, rounds: int) -> dict:
    """Ours against the official build, alternating (who goes first swaps each round)."""
    builds = {"ours": build_tree, "official": official}
    print(f"{'budget':>6} {'ours ms':>8} {'official ms':>12} {'ratio':>6} {'paired':>7} same tree, depth")
    rows = {}
    for budget in OFFICIAL_BUDGETS:
        tree = build_tree(logits, budget)
        same = same_tree(tree, official(logits, budget))  # also the warm-up
        raw = {name: [] for name in builds}
        for r in range(rounds):
            for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
                t0 = time.perf_counter()
                builds[name](logits, budget)
                raw[name].append(1e3 * (time.perf_counter() - t0))
        med = {name: statistics.median(raw[name]) for name in builds}
        paired = statistics.median(a / b for a, b in zip(raw["ours"], raw["official"]))
        depth = int(tree.depths.max())
        rows[str(budget)] = {"ours_ms": round(med["ours"], 3), "official_ms": round(med["official"], 3),
                             "ratio": round(med["ours"] / med["official"], 3),
                             "paired_ratio": round(paired, 3), "same_tree": same, "tree_depth": depth,
                             "raw_ms": {k: [round(t, 3) for t in v] for k, v in raw.items()}}
        print(f"{budget:>6} {med['ours']:>8.2f} {med['official']:>12.2f} "
              f"{med['ours'] / med['official']:>5.2f}x {paired:>6.2f}x {same}, {depth}", flush=True)
    return rows


def write_official(args, rows: dict) -> None:
    """rows: per logits set ("random", "confident"), per budget."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    out = {"command": "python " + " ".join(sys.argv), "commit": commit,
           "machine": hardware_record(torch.device("cpu")) | {"numpy": np.__version__,
                                                            "load_average_1m_after": os.getloadavg()[0]},
           "official": {"file": str(args.official),
                        "sha256": hashlib.sha256(args.official.read_bytes()).hexdigest()},
           "L": L, "V": V, "rounds": args.rounds,
           "logits": {"random": "4 * torch.randn(L, V), seed 0, float32 (the issue's and "
                                "the other sections')",
                      "confident": "random with one token per depth set to 22 (generator seed 1): p ~0.9"},
           "budgets": rows}
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.output}")


def main():
    parser = argparse.ArgumentParser(description="Time DDTree construction on CPU.")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--official", type=Path, default=None, help="liranringel/ddtree's ddtree.py")
    parser.add_argument("--official-only", action="store_true", help="only the comparison with --official")
    parser.add_argument("--rounds", type=int, default=31,
                        help="alternating rounds against the official build")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "tree_build.json"))
    args = parser.parse_args()
    if args.official_only and args.official is None:
        sys.exit("error: --official-only needs --official PATH")
    if args.official is not None and not args.official.is_file():
        sys.exit(f"error: --official {args.official}: no such file")
    official = load_official(args.official) if args.official is not None else None
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    logits = 4 * torch.randn(L, V)  # [L, V]
    hidden = torch.randn(L + 1, HIDDEN)  # [B, H]
    print(f"L={L} V={V} torch threads={torch.get_num_threads()} median of {RUNS}")
    if official is not None:
        rows = {}
        for name, x in [("random", logits), ("confident", confident(logits))]:
            print(f"\nplain DDTree against the official build_ddtree_tree, {name} logits, "
                  f"{args.rounds} alternating "
                  "rounds")
            rows[name] = official_rows(x, official, args.rounds)
        write_official(args, rows)
        if args.official_only:
            return
    print("\nplain DDTree (per-depth marginals)")
    plain_rows(logits)

    print(f"\npath-conditioned DDTree (MarkovScorer, rank {RANK}, hidden {HIDDEN}, "
          f"{TREE_CANDIDATES} candidates per depth), paired with the plain build: ms plain / ms "
          f"conditional (ratio)")
    print(f"{'budget':>6} " + " ".join(f"{h:>24}" for h in ("vanilla", "gated", "rnn", "DFlash2 selector")))
    cells = {b: [] for b in CONDITIONAL_BUDGETS}
    with torch.no_grad():
        for head_type in ("vanilla", "gated", "rnn"):
            head = random_head(head_type)
            scorer = MarkovScorer(head, hidden, bonus=7)
            for budget in CONDITIONAL_BUDGETS:
                a, b = paired_ms(lambda: build_tree(logits, budget),
                                 lambda: build_tree(logits, budget, scorer))
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
    print(f"\none full-vocabulary [V, r] mat-vec (what the exact tree needs per expanded "
          f"node): {matvec:.2f} ms")


if __name__ == "__main__":
    main()
