"""dflash-eval's report from its samples: one row per suite and method, the verdicts and predictions.

Per row: tau, the acceptance-length histogram, the paired speedup over AR with its bootstrap
interval (speed.py), tokens/s and stage medians, lossless at temperature 0, replies with a
repetition loop, on/off-spine accuracy and the tree's calibration; then the speedup predicted at
each concurrency from the cost curve measured here (costs.py), or on another device from a
benchmarks/gpu_costs.py JSON.
"""

import platform
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import transformers

from dflash_train.core.errors import UserError
from dflash_train.decoding.ddtree import add_cells
from dflash_train.decoding.decode import STAGES
from dflash_train.evaluation import speed
from dflash_train.evaluation.loops import find_loop
from dflash_train.evaluation.sweep import Sample
from dflash_train.model.variants import VARIANTS

if TYPE_CHECKING:  # run.py imports this module
    from dflash_train.evaluation.run import EvalSettings


def grid(samples: list[Sample], n_prompts: int, repeats: int, value) -> np.ndarray:
    """[n_prompts, repeats] of value(sample) for one suite and method."""
    out = np.full((n_prompts, repeats), np.nan)
    for x in samples:
        out[x.prompt, x.repeat] = value(x)
    return out


def ms_per_round(samples: list[Sample], n: int, R: int, seconds) -> np.ndarray:
    """[n, R]: 1000 x seconds(sample) / its rounds (NaN for a sample without rounds)."""
    return grid(samples, n, R,
                lambda x: 1e3 * seconds(x) / len(x.accept_lengths) if x.accept_lengths else np.nan)


def summarize(samples: list[Sample], ar: list[Sample], suite: str, n: int, settings: "EvalSettings",
              block_size: int, draws: tuple) -> tuple[dict, np.ndarray]:
    """One report row (suite x method) and its resampled speedup over AR."""
    s, R = settings, settings.repeats
    x0 = samples[0]
    rounds = sum(len(x.accept_lengths) for x in samples)
    hist = Counter(a for x in samples for a in x.accept_lengths)
    lossless = None
    if s.temperature == 0:
        ar_out = {(x.prompt, x.repeat): x.outputs for x in ar}
        lossless = all(x.outputs == ar_out[(x.prompt, x.repeat)] for x in samples)
    speedup = speed.paired_speedup(grid(ar, n, R, lambda x: x.tpot), grid(samples, n, R, lambda x: x.tpot),
                                   draws)
    per_round = {st: ms_per_round(samples, n, R, lambda x, st=st: x.stage_s[st]) for st in STAGES}
    median = lambda a: round(float(np.nanmedian(a)), 4) if not np.isnan(a).all() else None  # noqa: E731
    tps = grid(samples, n, R, lambda x: x.decoded / x.decode_s if x.decode_s else float("nan"))
    turns = sum(len(x.outputs) for x in samples)
    row = {
        "suite": suite, "method": x0.method, "budget": x0.budget, "verify_width": x0.budget + 1,
        "temperature": s.temperature, "max_new_tokens": s.max_new_tokens, "prompts": n,
        "repeats": R, "rounds": rounds,
        "tau": round(float(np.nanmean(grid(samples, n, R, lambda x: x.tau))), 4),
        "speedup": None if np.isnan(speedup[0]) else round(float(speedup[0]), 3),
        "speedup_interval": speed.interval(speedup),
        "tokens_per_s": None if np.isnan(tps).all() else round(float(np.nanmedian(tps)), 1),
        "lossless": lossless,
        "accept_hist": {str(k): hist.get(k, 0) for k in range(1, block_size + 1)},
        "stage_ms_per_round": {st: median(per_round[st]) for st in STAGES},
        "prefill_ms_per_turn": round(1000 * sum(x.prefill_s for x in samples) / max(turns, 1), 3),
        **spine_summary(samples),
        **loop_summary(samples),
    }
    return row, speedup


def loop_summary(samples: list[Sample]) -> dict:
    """Replies (turns) with a repetition loop (dflash_train/evaluation/loops.py) out of all, and tau over the
    samples none of whose replies loops: a loop is easy to draft, so it must not pass for a good
    drafter. Each sample is judged by its own replies (at temperature > 0 methods reply differently)."""
    looping = [sum(find_loop(t) is not None for t in x.outputs) for x in samples]
    clean = [x.tau for x, k in zip(samples, looping) if not k and x.accept_lengths]
    return {"replies": sum(len(x.outputs) for x in samples), "looping_replies": sum(looping),
            "tau_without_loops": round(float(np.mean(clean)), 4) if clean else None}


def spine_summary(samples: list[Sample]) -> dict:
    """Off-spine accuracy beside on-spine (ddtree.spine_counts, summed over the samples), and for a
    DSpark chain the confidence head's predicted vs measured acceptance per slot (over the rounds
    that reached the slot); for an XPress chain the Jacobi passes per round."""
    on_hit, on_n, off_hit, off_n = (sum(c) for c in zip(*(x.spine for x in samples)))
    out = {"on_spine_acc": round(on_hit / on_n, 4) if on_n else None, "on_spine_nodes": on_n,
           "off_spine_acc": round(off_hit / off_n, 4) if off_n else None, "off_spine_nodes": off_n}
    conf = [x.confidence for x in samples if x.confidence is not None]
    if conf:
        predicted, reached, accepted = ([sum(v) for v in zip(*rows)] for rows in zip(*conf))
        out["confidence"] = {"predicted": [round(p / n, 4) if n else None
                                           for p, n in zip(predicted, reached)],
                             "measured": [round(a / n, 4) if n else None for a, n in zip(accepted, reached)],
                             "reached": [int(n) for n in reached]}
    cal = calibration_summary(samples)
    if cal:
        out["calibration"] = cal
    passes = [p for x in samples for p in x.jacobi_passes]
    if passes:  # an XPress chain: the Jacobi passes it ran per round (it stops at a fixed point)
        out["jacobi_passes"] = {"mean": round(float(np.mean(passes)), 3), "max": max(passes),
                                "rounds": len(passes)}
    return out


def calibration_summary(samples: list[Sample]) -> dict | None:
    """The tree's stated probability against the target's verdict (ddtree.calibration_counts,
    summed over samples), per (depth, rank) cell, and the calibration error: the mean over judged
    nodes of |stated - hit rate| of their cell (expected calibration error with (depth, rank) as
    the bins). None for methods without a tree."""
    cells = {}
    for x in samples:
        add_cells(cells, x.calibration)
    if not cells:
        return None
    nodes = sum(c[2] for c in cells.values())
    rows = [{"depth": d, "rank": r, "stated": round(c[0] / c[2], 4), "measured": round(c[1] / c[2], 4),
             "nodes": c[2]}
            for (d, r), c in sorted(cells.items())]
    return {"cells": rows, "nodes": nodes,
            "ece": round(sum(abs(c[0] - c[1]) for c in cells.values()) / nodes, 4),
            "stated": round(sum(c[0] for c in cells.values()) / nodes, 4),
            "measured": round(sum(c[1] for c in cells.values()) / nodes, 4)}


def predictions(by_method: dict, methods, n: int, settings: "EvalSettings", draws: tuple,
                curves: speed.Curves, stages) -> tuple[dict, dict]:
    """Predicted speedup per method and concurrency -> ({method: {c: entry}}, {c: verdict}).
    stages(method, samples) -> {"draft", "host", "verify"}: [n, R] ms per round of one request."""
    R = settings.repeats
    ar_stages = stages(("ar", 0), by_method[("ar", 0)])
    rows, verdicts = {m: {} for m in methods}, {}
    for c in settings.concurrency:
        values = {}
        for m in methods:
            # tokens per round as the measured times count them (the first token of a turn comes from
            # its prefill; a round cut short by a stop token counts what it emitted), so that at one
            # request the prediction is exactly the measured per-prompt ratio
            tau = grid(by_method[m], n, R,
                       lambda x: x.decoded / len(x.accept_lengths) if x.accept_lengths else np.nan)
            values[m] = speed.predicted_speedup(tau, stages(m, by_method[m]), ar_stages, m[0], m[1], c,
                                                curves, draws)
            beyond = curves.extrapolated(c, m[1] + 1)  # axes read beyond the measured cost grid
            rows[m][str(c)] = {"speedup": None if np.isnan(values[m][0]) else round(float(values[m][0]), 3),
                               "interval": speed.interval(values[m]), "verify_width": c * (m[1] + 1),
                               "extrapolated": bool(beyond), "extrapolated_axes": beyond}
        verdicts[str(c)] = speed.verdict(values)
    return rows, verdicts


def measured_stages(n: int, R: int):
    """Per-sample stage times from this eval's own decoding (ms per round); host = tree + commit."""
    return lambda m, xs: {"draft": ms_per_round(xs, n, R, lambda x: x.stage_s["draft"]),
                          "host": ms_per_round(xs, n, R, lambda x: x.stage_s["tree"] + x.stage_s["commit"]),
                          "verify": ms_per_round(xs, n, R, lambda x: x.stage_s["verify"])}


def scorer_key(config, tree_scores: str) -> tuple[str | None, str | None]:
    """Which of gpu_costs.py's scored costs a drafter decodes with: (its DDTree's, its chain's
    walk), e.g. ("dspark-gated", "dspark-gated"); None: the plain tree, argmax chain."""
    key = VARIANTS[config.variant].cost_key(config)
    return (key if tree_scores == "conditional" else None), key


def device_costs_model(device_costs: dict, n: int, R: int,
                       scores: tuple = (None, None)) -> tuple[speed.Curves, object]:
    """Curves and stage times on the device of a benchmarks/gpu_costs.py JSON: its verify curve
    (with its context axis when the file has verify_ms_by_context), its draft time (drafting grows
    in proportion to the requests unless the file has draft_ms_by_batch), its tree build by
    budget; commit is not in it. scores (scorer_key): a DSpark or DFlash2 drafter's trees cost its
    path-conditioned build and its chain the per-round walk, host work of every request, when the
    file has them (tree_build_ms_by_scores, chain_walk_ms_by_scores); otherwise the plain build."""
    vt = sorted((int(w), float(ms)) for w, ms in device_costs["verify_ms_by_width"].items())
    dt = sorted((int(c), float(ms)) for c, ms in device_costs.get("draft_ms_by_batch", {}).items()) or [
        (1, float(device_costs["draft_ms"]))]
    tree_key, chain_key = scores
    scored = (device_costs.get("tree_build_ms_by_scores", {}).get(tree_key)
              or device_costs.get("tree_build_ms_by_budget", {}))
    tree = sorted((int(b), float(ms)) for b, ms in scored.items())
    walk = float(device_costs.get("chain_walk_ms_by_scores", {}).get(chain_key, 0.0))
    by_context = {int(t): {int(w): float(ms) for w, ms in row.items()}
                  for t, row in device_costs.get("verify_ms_by_context", {}).items()}
    extra = {}
    if by_context:
        cw = sorted(set.intersection(*(set(row) for row in by_context.values())))
        ts = sorted(by_context)
        extra = {"context": int(device_costs["context"]), "contexts": ts, "context_widths": cw,
                 "context_ms": np.array([[[by_context[t][w] for w in cw] for t in ts]])}
    curves = speed.Curves([w for w, _ in vt], np.array([[ms for _, ms in vt]]),
                          [c for c, _ in dt], np.array([[ms for _, ms in dt]]), **extra)
    draft = float(speed.at_width(curves.batches, curves.draft_ms, 1)[0])

    def tree_ms(budget: int) -> float:  # the tree build at this budget; 0 when the file has none
        if not tree:
            return 0.0
        return float(speed.at_width([b for b, _ in tree], np.array([ms for _, ms in tree]), budget))

    # host work per round of one request, by method: AR none, the chain its walk, DDTree its tree build
    host_ms = {"ar": lambda budget: 0.0, "dflash": lambda budget: walk, "ddtree": tree_ms}

    def stages(m, xs):
        method, budget = m
        full = lambda v: np.full((n, R), v)  # noqa: E731
        return {"draft": full(draft), "host": full(host_ms[method](budget)),
                "verify": full(float(speed.at_width(curves.widths, curves.verify_ms, budget + 1)[0]))}

    return curves, stages


def cost_grid(costs: dict, curves: speed.Curves) -> dict:
    """The report's record of which (width, context) verify costs were measured and how the
    predictions read the rest."""
    measured = [[w, costs["context"]] for w in costs["widths"]]
    by_context = {}
    if costs.get("contexts"):
        med = np.median(np.asarray(costs["context_verify_ms"]), axis=0)  # [K, D]
        by_context = {str(t): {str(w): round(float(v), 4) for w, v in zip(costs["context_widths"], row)}
                      for t, row in zip(costs["contexts"], med)}
        measured += [[w, t] for t in costs["contexts"] for w in costs["context_widths"]]
    return {"verify_ms_by_context": by_context, "measured_grid": measured,
            "per_pair_ms": round(float(curves.per_pair_ms()[0]), 8),
            "model": "N requests of width w after P tokens each = one request of width N w after N P tokens "
                     "(the width curve plus the measured extra cost of the longer context, linear in width "
                     "between and beyond the measured context widths) less per_pair_ms x the attention "
                     "pairs N separate requests do not compute; a prediction whose width or total context "
                     "lies beyond measured_grid is marked extrapolated, with the axes in extrapolated_axes"
                     if by_context else "verify cost by width only (no context axis measured)"}


def hardware_record(device: torch.device) -> dict:
    rec = {"torch": torch.__version__, "transformers": transformers.__version__, "device_type": device.type,
           "python": platform.python_version(), "cpu": _cpu_model(), "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        rec.update({"device": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                    "driver": _nvidia_driver(), "gpu_count": torch.cuda.device_count()})
    else:
        rec["device"] = rec["cpu"]
    return rec


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def build_report(settings: "EvalSettings", suites, methods, samples: list[Sample], costs: dict,
                 device_costs: dict | None, block_size: int, scores: tuple[str | None, str | None]) -> dict:
    """Rows per suite and method (acceptance, paired speedup, medians), the verdicts, the predictions.
    scores (scorer_key): which scored costs of device_costs the drafter's trees and chain pay."""
    s = settings
    results, advice = [], {}
    curves = speed.Curves.from_rounds(costs)  # resampled over the cost rounds
    for k, (name, prompts) in enumerate(suites):
        n = len(prompts)
        draws = speed.resample(n, s.repeats)
        by_method = {m: [x for x in samples if x.suite == k and (x.method, x.budget) == m] for m in methods}
        if not any(x.accept_lengths for x in by_method[("ar", 0)]):
            raise UserError(f"suite '{name}': every reply ended at its first token, so no decoding round was "
                            "timed")
        rows, measured = {}, {}
        for m in methods:
            rows[m], measured[m] = summarize(by_method[m], by_method[("ar", 0)], name, n, s, block_size,
                                             draws)
        predicted, by_concurrency = predictions(by_method, methods, n, s, draws, curves,
                                                measured_stages(n, s.repeats))
        for m in methods:
            rows[m]["predicted"] = predicted[m]
        advice[name] = {"measured": speed.verdict(measured), "concurrency": by_concurrency}
        if device_costs:
            dev_rows, dev_verdicts = predictions(by_method, methods, n, s, draws,
                                                 *device_costs_model(device_costs, n, s.repeats, scores))
            for m in methods:
                rows[m]["predicted_on_device"] = dev_rows[m]
            advice[name]["device"] = {"name": device_costs.get("device"), "concurrency": dev_verdicts}
        results += list(rows.values())
    verify_ms = np.asarray(costs["verify_ms"])
    draft_ms = np.asarray(costs["draft_ms"])
    return {
        "temperature": s.temperature, "max_new_tokens": s.max_new_tokens, "budgets": s.budgets,
        "repeats": s.repeats, "concurrency": s.concurrency,
        "speed": {"order": "interleaved: every prompt decoded by every method back to back, order rotated "
                           "per prompt",
                  "speedup": "median over prompts and repeats of AR's decode time per token / the method's "
                             "on the same prompt and repeat",
                  "interval": "90% percentile bootstrap, prompts then their repeats resampled "
                              f"({speed.RESAMPLES} resamples, seed 0)"},
        "costs": {"context": costs["context"], "rounds": len(costs["verify_ms"]),
                  "verify_ms_by_width": {str(w): round(float(v), 4)
                                         for w, v in zip(costs["widths"], np.median(verify_ms, axis=0))},
                  "draft_ms_by_batch": {str(c): round(float(v), 4)
                                        for c, v in zip(costs["batches"], np.median(draft_ms, axis=0))},
                  **cost_grid(costs, curves),
                  "device_costs": {"name": device_costs.get("device"), "file": str(s.verify_times),
                                   "scores": dict(zip(["tree", "chain"], scores)),
                                   "context_axis": bool(device_costs.get("verify_ms_by_context"))}
                  if device_costs else None},
        "results": results, "advice": advice,
        "command": "dflash-eval " + " ".join(sys.argv[1:] if s.argv is None else s.argv),
    }
