"""Do dflash-eval's speedups survive a machine that gets busy halfway through?

    # ~6 min, 2 cores
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/eval_under_load.py --drafter runs/demo/final

Three sweeps over the same prompts, through dflash-eval's own functions (`sweep_order`,
`run_sweep`, `summarize`):
  quiet        the interleaved sweep, nothing started
  loaded       the interleaved sweep; halfway through (after half of its decodes) --hogs
               processes start multiplying matrices until the sweep ends
  old order    one method over all prompts, then the next (the order dflash-eval had before),
               loaded the same way; reported both with the old statistic (mean AR time per
               token / mean method time per token) and with the paired median
For each method it prints the quiet paired speedup and its 90% interval, the loaded ones, and
whether each loaded value lies inside the quiet interval; then the advice of each sweep.
The AR time per token before and after the load started shows how much the load slowed decoding.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from dflash_train.checkpoint.folders import load_drafter
from dflash_train.data.dataset import stop_token_ids
from dflash_train.evaluation import speed
from dflash_train.evaluation.run import EvalSettings
from dflash_train.evaluation.speed import verdict_text
from dflash_train.evaluation.suites import load_suite
from dflash_train.evaluation.summary import summarize
from dflash_train.evaluation.sweep import run_sweep, sweep_order, warm_up
from dflash_train.model.target import load_target

HOG = ("import numpy as np\na = np.random.rand(700, 700)\n"
       "while True:\n    a = a @ a\n    a /= np.abs(a).max()\n")


def start_hogs(n: int) -> list[subprocess.Popen]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, "-c", HOG], env=env) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for h in hogs:
        h.terminate()
    for h in hogs:
        h.wait()


def sweep(target, drafter, prompts, order, settings: EvalSettings, stops, hogs: int):
    """Run `order`; with hogs > 0, start them after half of it. -> (samples, index where load began)."""
    bar = tqdm(total=len(order), disable=True)
    half = len(order) // 2 if hogs else len(order)
    samples = run_sweep(target, drafter, [prompts], order[:half], settings, stops, bar)
    started = start_hogs(hogs) if hogs else []
    try:
        time.sleep(1.0 if hogs else 0.0)  # let the hogs reach full speed
        samples += run_sweep(target, drafter, [prompts], order[half:], settings, stops, bar)
    finally:
        stop_hogs(started)
    return samples, half


def rows_of(samples, methods, n, settings: EvalSettings, B):
    draws = speed.resample(n, settings.repeats)
    by = {m: [x for x in samples if (x.method, x.budget) == m] for m in methods}
    out, resampled = {}, {}
    for m in methods:
        out[m], resampled[m] = summarize(by[m], by[("ar", 0)], "tinychat", n, settings, B, draws)
    old = {m: np.mean([x.tpot for x in by[("ar", 0)]]) / np.mean([x.tpot for x in by[m]]) for m in methods}
    return out, speed.verdict(resampled), old


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default="runs/demo/final")
    p.add_argument("--suite", default="tinychat")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budgets", default="4,16,64")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--hogs", type=int, default=os.cpu_count(), help="CPU-heavy processes started halfway")
    args = p.parse_args(argv)
    settings = EvalSettings(drafter=args.drafter, output="", temperature=0.0, seed=0, repeats=args.repeats,
                            max_new_tokens=args.max_new_tokens)
    budgets = [int(b) for b in args.budgets.split(",")]

    drafter, meta = load_drafter(args.drafter)
    target = load_target(meta["target"]["name_or_path"])
    drafter.eval()
    stops = stop_token_ids(target.model, target.tokenizer)
    _, prompts = load_suite(args.suite, args.limit)
    n, B = len(prompts), drafter.config.block_size
    methods = [("ar", 0), ("dflash", B - 1)] + [("ddtree", b) for b in budgets]
    interleaved = sweep_order([n], methods, args.repeats)
    # the old order: each method over every prompt and repeat before the next method starts
    method_major = [(r, 0, i, m) for m in methods for r in range(args.repeats) for i in range(n)]
    print(f"{n} prompts x {args.repeats} repeats x {len(methods)} methods, max "
          f"{args.max_new_tokens} new tokens, torch {torch.__version__} with {torch.get_num_threads()} "
          f"thread(s), {os.cpu_count()} CPUs, {args.hogs} hog process(es) from halfway; load average before: "
          f"{Path('/proc/loadavg').read_text().split()[:3]}")
    warm_up(target, drafter, prompts[0], methods, settings, stops)

    runs = {}
    for name, order, hogs in [("quiet", interleaved, 0), ("loaded", interleaved, args.hogs),
                              ("old order", method_major, args.hogs)]:
        t0 = time.perf_counter()
        samples, half = sweep(target, drafter, prompts, order, settings, stops, hogs)
        ar = [(k, x.tpot) for k, x in enumerate(samples) if x.method == "ar"]
        before = np.median([t for k, t in ar if k < half]) if hogs else np.nan
        after = np.median([t for k, t in ar if k >= half] or [np.nan]) if hogs else np.nan
        runs[name] = rows_of(samples, methods, n, settings, B)
        print(f"{name}: {time.perf_counter() - t0:.0f} s" + (
            f"; AR ms/token before the load {1e3 * before:.2f}, after {1e3 * after:.2f}" if hogs else "")
            + (" (in the old order AR ran entirely before the load)" if name == "old order" else ""))

    quiet, _, _ = runs["quiet"]
    print(f"\n{'method':>7} {'budget':>6} | {'quiet (90% interval)':>22} | {'loaded':>7} {'in?':>4} | "
          f"{'old order paired':>16} {'in?':>4} | {'old order, old stat':>19} {'in?':>4}")
    for m in methods:
        q = quiet[m]
        lo, hi = q["speedup_interval"]
        inside = lambda x: "yes" if lo <= x <= hi else "NO"  # noqa: E731
        loaded = runs["loaded"][0][m]["speedup"]
        old_paired = runs["old order"][0][m]["speedup"]
        old_stat = runs["old order"][2][m]
        quiet_cell = f"{q['speedup']:.2f} ({lo:.2f}-{hi:.2f})"
        print(f"{m[0]:>7} {m[1]:>6} | {quiet_cell:>22} | {loaded:>7.2f} "
              f"{inside(loaded):>4} | {old_paired:>16.2f} {inside(old_paired):>4} | {old_stat:>19.2f} "
              f"{inside(old_stat):>4}")
    print()
    for name, (_, v, _) in runs.items():
        print(f"advice, {name}: {verdict_text(v)}")
    print(f"load average after: {Path('/proc/loadavg').read_text().split()[:3]}")


if __name__ == "__main__":
    main()
