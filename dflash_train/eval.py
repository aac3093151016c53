"""`dflash-eval`: acceptance and speed of a drafter under AR, the DFlash chain and DDTree at a sweep of budgets.

    dflash-eval --drafter runs/demo/final --budgets 4,16,64,256 --output runs/demo/eval
    dflash-eval --drafter D --target T --suite gsm8k --suite mt-bench --temperature 1.0 --repeats 3 --output R

Every prompt is decoded by every method back to back, in an order rotated from prompt to
prompt (`sweep_order`), so a change in machine load lands on all of them. For each suite and
method: tau (tokens per target forward, bonus included, macro-averaged over prompts as the
DDTree paper does), the acceptance-length histogram, the speedup over AR (the median of
per-prompt time ratios, with a bootstrap interval: dflash_train/speed.py), medians of tokens/s
and of the time per stage (prefill excluded), the speedup predicted at each --concurrency from a
cost curve measured here (dflash_train/costs.py), and at temperature 0 `lossless`: every chain
and DDTree output equals the AR greedy output token for token. Writes report.json, report.md
and PNG plots to --output.
"""

import json
import math
import platform
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
import transformers
from pydantic import Field
from tqdm.auto import tqdm

from dflash_train import speed
from dflash_train.checkpoint import check_matches_target, drafter_fingerprint, load_drafter, resolve_folder, trained_for
from dflash_train.costs import measure_costs, widths_for
from dflash_train.data import stop_token_ids
from dflash_train.ddtree import add_cells
from dflash_train.decode import STAGES, TREE_SCORES, decode
from dflash_train.errors import OneLineArgumentParser, UserError, cli_guard
from dflash_train.loops import find_loop
from dflash_train.outputs import require_free_output, write_atomically
from dflash_train.progress import BAR_INTERVAL
from dflash_train.report import write_report
from dflash_train.schema import Open, validated
from dflash_train.suites import DEFAULT_SUITE, Prompt, load_suite
from dflash_train.target import load_target, target_dtype


@dataclass
class Sample:
    """One prompt (all its turns) decoded by one method in one repeat of the sweep."""
    suite: int  # index into the suites
    prompt: int
    repeat: int
    method: str
    budget: int
    accept_lengths: list[int] = field(default_factory=list)  # per round, all turns
    outputs: list[list[int]] = field(default_factory=list)  # per turn: generated tokens
    stage_s: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))  # prefill excluded
    prefill_s: float = 0.0
    decoded: int = 0  # tokens produced by decode rounds (each turn's first token comes from its prefill)
    context_tokens: int = 0  # sum over decoded tokens of the context they were verified after
    spine: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # decode.DecodeResult.spine, summed
    confidence: list[list[float]] | None = None  # decode.DecodeResult.confidence, summed (DSpark chain)
    calibration: dict = field(default_factory=dict)  # decode.DecodeResult.calibration, summed (DDTree)

    @property
    def decode_s(self) -> float:
        return sum(self.stage_s.values())

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else float("nan")

    @property
    def tpot(self) -> float:
        """Decode seconds per decoded token (NaN when nothing was decoded)."""
        return self.decode_s / self.decoded if self.decoded else float("nan")


def sweep_order(prompt_counts: list[int], methods: list[tuple[str, int]], repeats: int) -> list[tuple]:
    """The run order: (repeat, suite, prompt, method) for every prompt of every suite in every
    repeat. Each prompt is decoded by all methods back to back, so a change in machine load
    lands on every method alike (and is cancelled by the per-prompt ratios); the methods' order
    rotates by one from prompt to prompt, so none always runs first or right after another."""
    order, k = [], 0
    for r in range(repeats):
        for s, n in enumerate(prompt_counts):
            for i in range(n):
                shift = k % len(methods)
                order += [(r, s, i, m) for m in methods[shift:] + methods[:shift]]
                k += 1
    return order


def decode_prompt(target, drafter, prompt: Prompt, sample: Sample, args, stops, seed: int,
                  max_new_tokens: int) -> Sample:
    """All turns of one prompt with sample's method, recorded into `sample` (multi-turn: the
    target's own replies become the history)."""
    tok = target.tokenizer
    gen = torch.Generator().manual_seed(seed)  # the same for every method and repeat of this prompt
    messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        r = decode(target, drafter, ids, sample.method, sample.budget, args.temperature, max_new_tokens, stops, gen,
                   args.tree_scores)
        sample.spine = [a + b for a, b in zip(sample.spine, r.spine)]
        add_cells(sample.calibration, r.calibration)
        if r.confidence is not None:
            sample.confidence = r.confidence if sample.confidence is None else [
                [a + b for a, b in zip(x, y)] for x, y in zip(sample.confidence, r.confidence)]
        messages.append({"role": "assistant", "content": tok.decode(r.tokens, skip_special_tokens=True)})
        sample.accept_lengths += r.accept_lengths
        sample.outputs.append(r.tokens)
        n = len(r.tokens) - 1
        sample.decoded += n
        sample.context_tokens += n * ids.shape[1] + n * (n + 1) // 2
        sample.prefill_s += r.prefill_s
        for s in STAGES:
            sample.stage_s[s] += r.stage_s[s]
    return sample


def run_sweep(target, drafter, suites: list[list[Prompt]], order: list[tuple], args, stops, bar) -> list[Sample]:
    samples = []
    for r, s, i, (method, budget) in order:
        bar.set_postfix(repeat=r, method=f"{method}@{budget}" if method == "ddtree" else method)
        samples.append(decode_prompt(target, drafter, suites[s][i], Sample(s, i, r, method, budget), args, stops,
                                     args.seed * 100_003 + i, args.max_new_tokens))
        bar.update(1)
    return samples


def warm_up(target, drafter, prompt: Prompt, methods, args, stops) -> None:
    """Decode one prompt once per method, untimed: the first calls pay one-off costs
    (allocator growth, kernel selection) that would otherwise land on whichever method runs first."""
    for method, budget in methods:
        decode_prompt(target, drafter, prompt, Sample(0, 0, 0, method, budget), args, stops, 0,
                      min(args.max_new_tokens, 32))


def grid(samples: list[Sample], n_prompts: int, repeats: int, value) -> np.ndarray:
    """[n_prompts, repeats] of value(sample) for one suite and method."""
    out = np.full((n_prompts, repeats), np.nan)
    for x in samples:
        out[x.prompt, x.repeat] = value(x)
    return out


def ms_per_round(samples: list[Sample], n: int, R: int, seconds) -> np.ndarray:
    """[n, R]: 1000 x seconds(sample) / its rounds (NaN for a sample without rounds)."""
    return grid(samples, n, R, lambda x: 1e3 * seconds(x) / len(x.accept_lengths) if x.accept_lengths else np.nan)


def summarize(samples: list[Sample], ar: list[Sample], suite: str, n: int, args, block_size: int,
              draws: tuple) -> tuple[dict, np.ndarray]:
    """One report row (suite x method) and its resampled speedup over AR."""
    x0 = samples[0]
    rounds = sum(len(x.accept_lengths) for x in samples)
    hist = Counter(a for x in samples for a in x.accept_lengths)
    lossless = None
    if args.temperature == 0:
        ar_out = {(x.prompt, x.repeat): x.outputs for x in ar}
        lossless = all(x.outputs == ar_out[(x.prompt, x.repeat)] for x in samples)
    speedup = speed.paired_speedup(grid(ar, n, args.repeats, lambda x: x.tpot),
                                   grid(samples, n, args.repeats, lambda x: x.tpot), draws)
    per_round = {s: ms_per_round(samples, n, args.repeats, lambda x, s=s: x.stage_s[s]) for s in STAGES}
    median = lambda a: round(float(np.nanmedian(a)), 4) if not np.isnan(a).all() else None  # noqa: E731
    tps = grid(samples, n, args.repeats, lambda x: x.decoded / x.decode_s if x.decode_s else float("nan"))
    turns = sum(len(x.outputs) for x in samples)
    row = {
        "suite": suite, "method": x0.method, "budget": x0.budget, "verify_width": x0.budget + 1,
        "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "prompts": n,
        "repeats": args.repeats, "rounds": rounds,
        "tau": round(float(np.nanmean(grid(samples, n, args.repeats, lambda x: x.tau))), 4),
        "speedup": None if np.isnan(speedup[0]) else round(float(speedup[0]), 3),
        "speedup_interval": speed.interval(speedup),
        "tokens_per_s": None if np.isnan(tps).all() else round(float(np.nanmedian(tps)), 1),
        "lossless": lossless,
        "accept_hist": {str(k): hist.get(k, 0) for k in range(1, block_size + 1)},
        "stage_ms_per_round": {s: median(per_round[s]) for s in STAGES},
        "prefill_ms_per_turn": round(1000 * sum(x.prefill_s for x in samples) / max(turns, 1), 3),
        **spine_summary(samples),
        **loop_summary(samples),
    }
    return row, speedup


def loop_summary(samples: list[Sample]) -> dict:
    """Replies (turns) with a repetition loop (dflash_train/loops.py) out of all, and tau over the
    samples none of whose replies loops: a loop is easy to draft, so it must not pass for a good
    drafter. Each sample is judged by its own replies (at temperature > 0 methods reply differently)."""
    looping = [sum(find_loop(t) is not None for t in x.outputs) for x in samples]
    clean = [x.tau for x, k in zip(samples, looping) if not k and x.accept_lengths]
    return {"replies": sum(len(x.outputs) for x in samples), "looping_replies": sum(looping),
            "tau_without_loops": round(float(np.mean(clean)), 4) if clean else None}


def spine_summary(samples: list[Sample]) -> dict:
    """Off-spine accuracy beside on-spine (ddtree.spine_counts, summed over the samples), and for a
    DSpark chain the confidence head's predicted vs measured acceptance per slot (over the rounds
    that reached the slot)."""
    on_hit, on_n, off_hit, off_n = (sum(c) for c in zip(*(x.spine for x in samples)))
    out = {"on_spine_acc": round(on_hit / on_n, 4) if on_n else None, "on_spine_nodes": on_n,
           "off_spine_acc": round(off_hit / off_n, 4) if off_n else None, "off_spine_nodes": off_n}
    conf = [x.confidence for x in samples if x.confidence is not None]
    if conf:
        predicted, reached, accepted = ([sum(v) for v in zip(*rows)] for rows in zip(*conf))
        out["confidence"] = {"predicted": [round(p / n, 4) if n else None for p, n in zip(predicted, reached)],
                             "measured": [round(a / n, 4) if n else None for a, n in zip(accepted, reached)],
                             "reached": [int(n) for n in reached]}
    cal = calibration_summary(samples)
    if cal:
        out["calibration"] = cal
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
    rows = [{"depth": d, "rank": r, "stated": round(c[0] / c[2], 4), "measured": round(c[1] / c[2], 4), "nodes": c[2]}
            for (d, r), c in sorted(cells.items())]
    return {"cells": rows, "nodes": nodes,
            "ece": round(sum(abs(c[0] - c[1]) for c in cells.values()) / nodes, 4),
            "stated": round(sum(c[0] for c in cells.values()) / nodes, 4),
            "measured": round(sum(c[1] for c in cells.values()) / nodes, 4)}


def predictions(by_method: dict, methods, n: int, args, draws: tuple, curves: speed.Curves,
                stages) -> tuple[dict, dict]:
    """Predicted speedup per method and concurrency -> ({method: {c: entry}}, {c: verdict}).
    stages(method, samples) -> {"draft", "host", "verify"}: [n, R] ms per round of one request."""
    R = args.repeats
    ar_stages = stages(("ar", 0), by_method[("ar", 0)])
    rows, verdicts = {m: {} for m in methods}, {}
    for c in args.concurrency:
        values = {}
        for m in methods:
            # tokens per round as the measured times count them (the first token of a turn comes from
            # its prefill; a round cut short by a stop token counts what it emitted), so that at one
            # request the prediction is exactly the measured per-prompt ratio
            tau = grid(by_method[m], n, R, lambda x: x.decoded / len(x.accept_lengths) if x.accept_lengths else np.nan)
            values[m] = speed.predicted_speedup(tau, stages(m, by_method[m]), ar_stages, m[0], m[1], c, curves, draws)
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
    key = (f"dspark-{config.markov_head_type}" if config.variant == "dspark" and config.markov_rank
           else "dflash2" if config.variant == "dflash2" and config.selector_rank else None)
    return (key if tree_scores == "conditional" else None), key


def device_costs_model(device_costs: dict, n: int, R: int, scores: tuple = (None, None)) -> tuple[speed.Curves, object]:
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
    scored = device_costs.get("tree_build_ms_by_scores", {}).get(tree_key) or device_costs.get("tree_build_ms_by_budget", {})
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

    def stages(m, xs):
        method, budget = m
        host = walk if method == "dflash" else 0.0
        if method == "ddtree" and tree:
            host = float(speed.at_width([b for b, _ in tree], np.array([ms for _, ms in tree]), budget))
        full = lambda v: np.full((n, R), v)  # noqa: E731
        return {"draft": full(draft), "host": full(host),
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


# A budget-b tree is verified in one forward of width b+1: [b+1, vocab] logits and a
# [b+1, context+b+1] mask, and the cost curve is measured up to width 1024 at most. Beyond 4096 nodes the
# allocator, not the tree, decides; 256 requests already put a 64-node tree at width 16,640.
MAX_BUDGET = 4096
MAX_CONCURRENCY = 256


def parse_budgets(text: str) -> list[int]:
    """DDTree budgets; 0 means plain decoding, which always runs (as AR) and is not a tree."""
    try:
        budgets = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise UserError(f"--budgets must be comma-separated integers, got '{text}'") from None
    if not budgets or budgets[0] < 0:
        raise UserError(f"--budgets must be non-negative integers, got '{text}'")
    if budgets[-1] > MAX_BUDGET:
        raise UserError(f"--budgets {budgets[-1]} is above the limit of {MAX_BUDGET} tree nodes (one verify forward "
                        f"holds [budget+1, vocab] logits and a [budget+1, context+budget+1] mask)")
    return [b for b in budgets if b > 0]


def parse_concurrency(text: str) -> list[int]:
    try:
        levels = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        raise UserError(f"--concurrency must be comma-separated integers, got '{text}'") from None
    if not levels or levels[0] < 1:
        raise UserError(f"--concurrency must be integers >= 1, got '{text}'")
    if levels[-1] > MAX_CONCURRENCY:
        raise UserError(f"--concurrency {levels[-1]} is above the limit of {MAX_CONCURRENCY} requests (the cost "
                        "curve runs the drafter on that many contexts at once)")
    return levels


def resolve_device(text: str) -> torch.device:
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UserError(f"--device '{text}' is not a device (auto, cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device '{text}' is not supported (auto, cpu, cuda or cuda:N)")
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise UserError(f"--device {text}: this torch build ({torch.__version__}) has no CUDA support")
        if not torch.cuda.is_available():
            raise UserError(f"--device {text}: torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


Ms = Annotated[float, Field(gt=0, allow_inf_nan=False)]  # a measured time: positive and finite


class DeviceCosts(Open):
    """A benchmarks/gpu_costs.py JSON (the fields the predictions read)."""
    verify_ms_by_width: Annotated[dict[Annotated[int, Field(ge=1)], Ms], Field(min_length=1)]
    draft_ms: Ms
    draft_ms_by_batch: dict[Annotated[int, Field(ge=1)], Ms] = {}
    tree_build_ms_by_budget: dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=0, allow_inf_nan=False)]] = {}
    device: str | None = None


def read_device_costs(path: str | None) -> dict | None:
    """A benchmarks/gpu_costs.py JSON (verify ms by width, draft ms, ... on another device), read
    once and checked against DeviceCosts before anything loads: a negative, zero or NaN time would
    otherwise recommend a budget, or crash after the whole eval."""
    if path is None:
        return None
    where = f"--verify-times '{path}' is not a costs JSON from benchmarks/gpu_costs.py"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{where} ({type(e).__name__})") from None
    validated(DeviceCosts, data, where)
    return data


def parse_args(argv):
    p = OneLineArgumentParser(prog="dflash-eval", description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True, help="drafter folder (from training, or an export)")
    p.add_argument("--target", default=None, help="target folder or Hub id (default: the one the drafter names)")
    p.add_argument("--target-revision", default=None)
    p.add_argument("--suite", action="append", default=None,
                   help=f"suite name, NAME=local_file or a messages .jsonl (repeatable; default {DEFAULT_SUITE})")
    p.add_argument("--budgets", default="4,16,64,256", help="DDTree budgets (non-root nodes); 0 = plain decoding")
    p.add_argument("--tree-scores", default="conditional", choices=TREE_SCORES,
                   help="a DSpark or DFlash2 drafter's DDTree: path-conditioned (default; DFlash2: by its selector) "
                        "or from the backbone's marginals")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=128, help="per assistant turn")
    p.add_argument("--limit", type=int, default=None, help="prompts per suite (default: the suite's samples)")
    p.add_argument("--repeats", type=int, default=1, help="times the whole interleaved sweep runs (timing samples)")
    p.add_argument("--concurrency", default="1,4,16",
                   help="requests sharing one verify forward, for the predicted speedups")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--target-dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="target and drafter weights: auto = bf16 on a GPU that has it, else fp32; bf16 on a CPU "
                        "with AVX-512 BF16 verifies ~1.7x faster, but a tree's verify forward rounds differently "
                        "from AR's, so at temperature 0 outputs can part at near-ties: lossless is exact in fp32")
    p.add_argument("--verify-times", default=None,
                   help="costs JSON from benchmarks/gpu_costs.py: also predict speedups on that device")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--output", required=True, help="report folder")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    args = p.parse_args(argv)
    if not math.isfinite(args.temperature) or args.temperature < 0:
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.max_new_tokens < 2:
        p.error("--max-new-tokens must be >= 2 (the first token comes from the prefill; rounds decode the rest)")
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    args.budgets = parse_budgets(args.budgets)
    args.concurrency = parse_concurrency(args.concurrency)
    args.device = resolve_device(args.device)
    return args


@cli_guard
def main(argv=None):
    args = parse_args(argv)
    out = Path(args.output)
    require_free_output(out, args.overwrite, "eval", [("--drafter", args.drafter), ("--target", args.target),
                                                      ("--verify-times", args.verify_times)])
    device_costs = read_device_costs(args.verify_times)
    suites = [load_suite(s, args.limit) for s in (args.suite or [DEFAULT_SUITE])]  # before the target: cheap

    drafter, meta = load_drafter(args.drafter)
    fingerprint = drafter_fingerprint(drafter)  # of the drafter as stored, before any cast or move
    device = args.device
    dtype = target_dtype(args.target_dtype, device)
    target_id = args.target or meta["target"]["name_or_path"]
    target = load_target(target_id, revision=args.target_revision or (None if args.target else meta["target"]["revision"]),
                         dtype=dtype, device=device, trust_remote_code=args.trust_remote_code)
    check_matches_target(drafter.config, target)
    drafter.to(device=device, dtype=dtype).eval()
    stops = stop_token_ids(target.model, target.tokenizer)
    B = drafter.config.block_size

    methods = [("ar", 0), ("dflash", B - 1)] + [("ddtree", b) for b in args.budgets]
    order = sweep_order([len(p) for _, p in suites], methods, args.repeats)
    warm_up(target, drafter, suites[0][1][0], methods, args, stops)
    bar = tqdm(total=len(order), desc="eval", dynamic_ncols=True, mininterval=BAR_INTERVAL)
    samples = run_sweep(target, drafter, [p for _, p in suites], order, args, stops, bar)
    bar.close()

    # The cost curve at the mean context the AR verify forwards saw.
    ar = [x for x in samples if x.method == "ar"]
    context = max(1, round(sum(x.context_tokens for x in ar) / max(sum(x.decoded for x in ar), 1)))
    widths, context_widths = widths_for(max(args.concurrency) * max(b + 1 for _, b in methods))
    costs = measure_costs(target, drafter, context, args.concurrency, widths=widths,
                          contexts=[c * context for c in args.concurrency], context_widths=context_widths)
    args.scores = scorer_key(drafter.config, args.tree_scores)  # which scored costs --verify-times reads
    report = build_report(args, argv, suites, methods, samples, costs, device_costs, B)
    report.update({"drafter": str(args.drafter), "drafter_fingerprint": fingerprint, "target": target_id,
                   "target_revision": target.revision, "block_size": B,
                   "target_layer_ids": drafter.config.target_layer_ids,
                   "hardware": hardware_record(device) | {"dtype": str(dtype).removeprefix("torch.")},
                   "variant": drafter.config.variant, "markov_rank": drafter.config.markov_rank,
                   "markov_head_type": drafter.config.markov_head_type, "selector_rank": drafter.config.selector_rank,
                   "selector_top_k": drafter.config.selector_top_k, "tree_scores": args.tree_scores,
                   "trained_for": trained_for(resolve_folder(args.drafter))})
    write_atomically(out, lambda tmp: write_report(tmp, report), "eval")
    print((out / "report.md").read_text())


def build_report(args, argv, suites, methods, samples: list[Sample], costs: dict, device_costs: dict | None,
                 block_size: int) -> dict:
    """Rows per suite and method (acceptance, paired speedup, medians), the verdicts, the predictions."""
    results, advice = [], {}
    curves = speed.Curves.from_rounds(costs)  # resampled over the cost rounds
    for s, (name, prompts) in enumerate(suites):
        n = len(prompts)
        draws = speed.resample(n, args.repeats)
        by_method = {m: [x for x in samples if x.suite == s and (x.method, x.budget) == m] for m in methods}
        if not any(x.accept_lengths for x in by_method[("ar", 0)]):
            raise UserError(f"suite '{name}': every reply ended at its first token, so no decoding round was timed")
        rows, measured = {}, {}
        for m in methods:
            rows[m], measured[m] = summarize(by_method[m], by_method[("ar", 0)], name, n, args, block_size, draws)
        predicted, by_concurrency = predictions(by_method, methods, n, args, draws, curves,
                                                measured_stages(n, args.repeats))
        for m in methods:
            rows[m]["predicted"] = predicted[m]
        advice[name] = {"measured": speed.verdict(measured), "concurrency": by_concurrency}
        if device_costs:
            dev_rows, dev_verdicts = predictions(by_method, methods, n, args, draws,
                                                 *device_costs_model(device_costs, n, args.repeats,
                                                                     getattr(args, "scores", (None, None))))
            for m in methods:
                rows[m]["predicted_on_device"] = dev_rows[m]
            advice[name]["device"] = {"name": device_costs.get("device"), "concurrency": dev_verdicts}
        results += list(rows.values())
    verify_ms = np.asarray(costs["verify_ms"])
    draft_ms = np.asarray(costs["draft_ms"])
    return {
        "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "budgets": args.budgets,
        "repeats": args.repeats, "concurrency": args.concurrency,
        "speed": {"order": "interleaved: every prompt decoded by every method back to back, order rotated per "
                           "prompt",
                  "speedup": "median over prompts and repeats of AR's decode time per token / the method's on the "
                             "same prompt and repeat",
                  "interval": f"90% percentile bootstrap, prompts then their repeats resampled ({speed.RESAMPLES} "
                              "resamples, seed 0)"},
        "costs": {"context": costs["context"], "rounds": len(costs["verify_ms"]),
                  "verify_ms_by_width": {str(w): round(float(v), 4)
                                         for w, v in zip(costs["widths"], np.median(verify_ms, axis=0))},
                  "draft_ms_by_batch": {str(c): round(float(v), 4)
                                        for c, v in zip(costs["batches"], np.median(draft_ms, axis=0))},
                  **cost_grid(costs, curves),
                  "device_costs": {"name": device_costs.get("device"), "file": str(args.verify_times),
                                   "scores": dict(zip(["tree", "chain"], getattr(args, "scores", (None, None)))),
                                   "context_axis": bool(device_costs.get("verify_ms_by_context"))}
                  if device_costs else None},
        "results": results, "advice": advice,
        "command": "dflash-eval " + " ".join(sys.argv[1:] if argv is None else argv),
    }


if __name__ == "__main__":
    sys.exit(main())
