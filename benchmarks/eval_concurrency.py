"""Check dflash-eval's concurrency cost model against a directly timed batched verify forward.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/eval_concurrency.py   # ~4 min on 2 shared cores
    PYTHONPATH=. python benchmarks/eval_concurrency.py --requests 4,16 --contexts 128,512 --budgets 0,16,64 \\
        --json r.json

At greedy decoding a request's acceptance does not depend on the other requests in its batch,
so what the prediction must get right is the cost side. dflash-eval predicts the verify forward
of N requests x (budget + 1) tokens as ONE request's forward of width N x (budget + 1), read
off the curve it measures (`dflash_train.evaluation.costs.measure_costs`, one KV cache of `context` tokens).
Here N requests get their own KV caches (prefilled separately, contexts spread around
`context` by --spread), which are right-padded to the longest and stacked into one batch;
one forward verifies [N, budget + 1] tree tokens with a 4D mask (each row sees its own prefix,
not the padding, and its tree ancestors). Its logits are checked against each request's own
`decode.verify`, then it is timed against the curve, in alternating blocks so that both see the
same machine load. Two predictions from the same timing blocks: before (issue 20) the curve at
width N x (budget + 1) after one context, width only; after, `speed.Curves.verify_at`: the
curve plus the context axis `measure_costs` now measures at N x the mean context, less the
attention pairs N separate requests do not compute. Prints both, direct ms, and direct /
predicted; --json writes every number (per-run times, per-round curves) with the command.
The prediction reads N contexts of the mean, as dflash-eval does; this batch pads every row to the
longest (pad %), which a paged-attention server does not: `after_padded_ms` (JSON only) is the
same model given N contexts of the longest, a diagnostic of how much of a miss is the padding.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import torch
from transformers import DynamicCache

from dflash_train.decoding.ddtree import build_tree, root_only_tree
from dflash_train.decoding.decode import choose, verify
from dflash_train.evaluation.costs import measure_costs
from dflash_train.evaluation.speed import Curves, at_width
from dflash_train.evaluation.summary import hardware_record
from dflash_train.model.drafter import DFlashDrafter
from dflash_train.model.target import load_target
from dflash_train.training.build import drafter_config_for
from dflash_train.training.config import ModelConfig


def prefill(target, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=target.model.config)
    target.model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


def batched_cache(target, caches: list[DynamicCache], lengths: list[int]) -> DynamicCache:
    """Stack per-request caches [1, kvh, P_i, d] into one [N, kvh, P_max, d], zero-padded on the right."""
    P = max(lengths)
    batch = DynamicCache(config=target.model.config)
    for layer in range(len(caches[0].layers)):
        ks, vs = [], []
        for c, n in zip(caches, lengths):
            k, v = c.layers[layer].keys, c.layers[layer].values
            pad = (0, 0, 0, P - n)
            ks.append(torch.nn.functional.pad(k, pad))
            vs.append(torch.nn.functional.pad(v, pad))
        batch.update(torch.cat(ks), torch.cat(vs), layer)
    return batch


def batched_inputs(tree, bonus: list[int], lengths: list[int], dtype):
    """ids, positions [N, n+1] and additive mask [N, 1, n+1, P_max + n+1] for one tree per request."""
    N, n1, P = len(lengths), tree.size + 1, max(lengths)
    ids = torch.cat([torch.tensor(bonus)[:, None], tree.tokens.expand(N, -1)], dim=1)
    depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])
    positions = torch.tensor(lengths)[:, None] + depth[None]
    visible = torch.zeros(N, n1, P + n1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        visible[i, :, :n] = True  # its own prefix; the padding n..P stays hidden
    visible[:, :, P:] = tree.visibility
    mask = torch.zeros(N, 1, n1, P + n1, dtype=dtype).masked_fill_(~visible[:, None], torch.finfo(dtype).min)
    return ids, positions, mask


def batched_forward(target, cache, ids, positions, mask) -> torch.Tensor:
    out = target.model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                       use_cache=True, output_hidden_states=True)
    choose(out.logits.flatten(0, 1), 0.0, None).tolist()  # the picks reach the host, as in a round
    return out.logits


def median_ms(fn, reset, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
        reset()
    return times


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="data/tiny-target")
    p.add_argument("--requests", default="4", help="requests per batched forward, comma-separated")
    p.add_argument("--budgets", default="0,4,16,64,256", help="tree budgets (0 = AR, one token per request)")
    p.add_argument("--contexts", default="64,256,1024", help="mean context per request, comma-separated")
    p.add_argument("--spread", type=float, default=0.25, help="contexts vary by +-spread around the mean")
    p.add_argument("--blocks", type=int, default=4, help="alternating blocks of (curve, direct) timing")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per block")
    p.add_argument("--json", type=Path, help="write every number here")
    args = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit, dirty = git("rev-parse", "HEAD"), bool(git("status", "--porcelain"))  # the code this run timed
    requests, budgets, contexts = ints(args.requests), ints(args.budgets), ints(args.contexts)

    target = load_target(args.target)
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config_for(target, ModelConfig(num_layers=2, block_size=8))).eval()
    V, L = target.model.config.vocab_size, drafter.config.block_size - 1
    logits = torch.randn(L, V, generator=torch.Generator().manual_seed(1))
    trees = {b: root_only_tree() if b == 0 else build_tree(logits, b) for b in budgets}
    print(f"target {args.target}, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"curve = one request's verify forward at each width after `context` tokens")
    print(f"{'context':>7} {'N':>3} {'budget':>6} {'width':>6} {'before ms':>9} "
          f"{'after ms':>9} {'direct ms':>9} {'d/before':>8} {'d/after':>8} {'pad %':>6} "
          f"{'max |dlogit|':>12}")
    cells = []
    for context in contexts:
        for N in requests:
            lengths = [round(context * (1 - args.spread + 2 * args.spread * i / max(N - 1, 1)))
                       for i in range(N)]
            g = torch.Generator().manual_seed(context + N)
            prompts = [torch.randint(0, V, (1, n), generator=g) for n in lengths]
            caches = [prefill(target, x) for x in prompts]
            bonus = [int(x[0, -1]) for x in prompts]
            batch = batched_cache(target, caches, lengths)
            P = max(lengths)
            direct, worst = {b: [] for b in budgets}, {}
            for b in budgets:  # correctness first: each row equals that request's own verify
                ids, positions, mask = batched_inputs(trees[b], bonus, lengths, target.model.dtype)
                got = batched_forward(target, batch, ids, positions, mask)
                batch.crop(-(b + 1))
                worst[b] = 0.0
                for i in range(N):
                    ref, _ = verify(target, caches[i], trees[b], bonus[i], lengths[i], want_taps=True)
                    caches[i].crop(-(b + 1))
                    worst[b] = max(worst[b], float((got[i] - ref).abs().max()))
            curve_rounds, context_rounds, mean = [], [], round(sum(lengths) / N)
            for _ in range(args.blocks):  # curve and direct in alternating blocks: the same machine load
                costs = measure_costs(target, drafter, mean, [1], rounds=args.repeats, contexts=[N * mean])
                curve_rounds += costs["verify_ms"]
                context_rounds += costs["context_verify_ms"]
                for b in budgets:
                    ids, positions, mask = batched_inputs(trees[b], bonus, lengths, target.model.dtype)
                    direct[b] += median_ms(lambda: batched_forward(target, batch, ids, positions, mask),
                                           lambda: batch.crop(-(b + 1)), args.repeats)
            curve = np.median(np.asarray(curve_rounds), axis=0)  # [W], median over rounds
            curves = Curves(costs["widths"], curve[None], [1], np.ones((1, 1)), mean, costs["contexts"],
                            costs["context_widths"], np.median(np.asarray(context_rounds), axis=0)[None])
            for b in budgets:
                width = N * (b + 1)
                before = float(at_width(costs["widths"], curve, width))
                after = float(curves.verify_at(N, b + 1)[0])
                after_padded = float(curves.verify_at(N, b + 1, P)[0])
                d = statistics.median(direct[b])
                pad = 100 * (1 - sum(lengths) / (N * P))
                flag = "*" if width > max(costs["widths"]) else " "
                print(f"{context:>7} {N:>3} {b:>6} {width:>5}{flag} {before:>9.2f} {after:>9.2f} {d:>9.2f} "
                      f"{d / before:>8.2f} {d / after:>8.2f} {pad:>6.1f} {worst[b]:>12.2e}", flush=True)
                cells.append({"context": context, "requests": N, "budget": b, "width": width,
                              "lengths": lengths, "predicted_before_ms": before, "predicted_after_ms": after,
                              "predicted_after_padded_ms": after_padded, "direct_ms": d,
                              "direct_over_before": d / before, "direct_over_after": d / after,
                              "extrapolated_axes": curves.extrapolated(N, b + 1), "pad_percent": pad,
                              "max_abs_dlogit": worst[b], "direct_runs_ms": direct[b]})
            cells[-1]["costs"] = {"context": mean, "widths": costs["widths"],
                                  "verify_ms_rounds": curve_rounds, "contexts": costs["contexts"],
                                  "context_widths": costs["context_widths"],
                                  "context_verify_ms_rounds": context_rounds,
                                  "per_pair_ms": float(curves.per_pair_ms()[0])}
    print("* beyond the widest measured width (1024): extrapolated as dflash-eval does")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join(["benchmarks/eval_concurrency.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "commit": commit + ("+dirty" if dirty else ""), "machine": hardware_record(torch.device("cpu")),
            "load_average": os.getloadavg(), "cells": cells}, indent=1) + "\n")


if __name__ == "__main__":
    main()
