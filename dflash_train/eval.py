"""`dflash-eval`: acceptance of a drafter under AR, the DFlash chain and DDTree at a sweep of budgets.

    dflash-eval --drafter runs/demo/final --budgets 0,4,16,64,256 --output runs/demo/eval
    dflash-eval --drafter D --target T --suite gsm8k --suite mt-bench --temperature 1.0 --output R

For each suite and method: tau (tokens per target forward, bonus included, macro-averaged over
prompts as the DDTree paper does), the acceptance-length histogram, tokens/s and time per
stage (prefill excluded), and at temperature 0 `lossless`: every chain and DDTree output equals
the AR greedy output token for token. Writes report.json, report.md and PNG plots to --output.
"""

import json
import platform
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

from dflash_train.checkpoint import check_matches_target, load_drafter, require_free_output, write_atomically
from dflash_train.data import stop_token_ids
from dflash_train.decode import STAGES, TREE_SCORES, decode
from dflash_train.errors import OneLineArgumentParser, UserError, cli_guard
from dflash_train.progress import BAR_INTERVAL
from dflash_train.report import advise_budget, write_report
from dflash_train.suites import DEFAULT_SUITE, Prompt, load_suite
from dflash_train.target import load_target


@dataclass
class Run:
    """One suite x method x budget over all prompts."""
    suite: str
    method: str
    budget: int
    taus: list[float] = field(default_factory=list)  # per prompt
    tpots: list[float] = field(default_factory=list)  # per prompt: decode seconds per generated token
    hist: Counter = field(default_factory=Counter)  # accept length -> rounds
    outputs: list[list[list[int]]] = field(default_factory=list)  # per prompt, per turn: tokens
    stage_s: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    prefill_s: float = 0.0
    decoded_tokens: int = 0  # tokens produced by decode rounds (the prefill's first token excluded)
    spine: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # decode.DecodeResult.spine, summed
    confidence: list[list[float]] | None = None  # decode.DecodeResult.confidence, summed (DSpark chain)


def run_prompts(target, drafter, prompts: list[Prompt], suite: str, method: str, budget: int, args, stops, bar) -> Run:
    run = Run(suite, method, budget)
    tok = target.tokenizer
    for i, prompt in enumerate(prompts):
        gen = torch.Generator().manual_seed(args.seed * 100_003 + i)
        messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
        lengths, outputs, decode_s, decoded = [], [], 0.0, 0
        for turn in prompt.turns:  # multi-turn: the target's own replies become the history
            messages.append({"role": "user", "content": turn})
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)["input_ids"]
            r = decode(target, drafter, ids, method, budget, args.temperature, args.max_new_tokens, stops, gen,
                       args.tree_scores)
            run.spine = [a + b for a, b in zip(run.spine, r.spine)]
            if r.confidence is not None:
                run.confidence = r.confidence if run.confidence is None else [
                    [a + b for a, b in zip(x, y)] for x, y in zip(run.confidence, r.confidence)]
            messages.append({"role": "assistant", "content": tok.decode(r.tokens, skip_special_tokens=True)})
            lengths += r.accept_lengths
            outputs.append(r.tokens)
            decode_s, decoded = decode_s + r.decode_s, decoded + len(r.tokens) - 1
            run.prefill_s += r.prefill_s
            for s in STAGES:
                run.stage_s[s] += r.stage_s[s]
        run.taus.append(sum(lengths) / max(len(lengths), 1))
        run.tpots.append(decode_s / max(decoded, 1))
        run.hist.update(lengths)
        run.outputs.append(outputs)
        run.decoded_tokens += decoded
        bar.update(1)
    return run


def summarize(run: Run, ar: Run, args, block_size: int) -> dict:
    rounds = sum(run.hist.values())
    decode_s = sum(run.stage_s.values())
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    lossless = None
    if args.temperature == 0:
        lossless = run.outputs == ar.outputs
    return {
        "suite": run.suite, "method": run.method, "budget": run.budget,
        "verify_width": run.budget + 1, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
        "prompts": len(run.taus), "rounds": rounds, "tau": round(mean(run.taus), 4),
        "tokens_per_s": round(run.decoded_tokens / decode_s, 2) if decode_s else None,
        "speedup": round(mean(ar.tpots) / mean(run.tpots), 3) if run.tpots and mean(run.tpots) else None,
        "lossless": lossless,
        "accept_hist": {str(k): run.hist.get(k, 0) for k in range(1, block_size + 1)},
        "stage_ms_per_round": {s: round(1000 * run.stage_s[s] / max(rounds, 1), 4) for s in STAGES},
        "prefill_ms_per_turn": round(1000 * run.prefill_s / max(sum(len(o) for o in run.outputs), 1), 3),
        **spine_summary(run),
    }


def spine_summary(run: Run) -> dict:
    """Off-spine accuracy beside on-spine (ddtree.spine_counts), and for a DSpark chain the
    confidence head's predicted vs measured acceptance per slot (rounds that reached the slot)."""
    on_hit, on_n, off_hit, off_n = run.spine
    out = {"on_spine_acc": round(on_hit / on_n, 4) if on_n else None, "on_spine_nodes": on_n,
           "off_spine_acc": round(off_hit / off_n, 4) if off_n else None, "off_spine_nodes": off_n}
    if run.confidence is not None:
        predicted, reached, accepted = run.confidence
        out["confidence"] = {"predicted": [round(p / n, 4) if n else None for p, n in zip(predicted, reached)],
                             "measured": [round(a / n, 4) if n else None for a, n in zip(accepted, reached)],
                             "reached": [int(n) for n in reached]}
    return out


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


def parse_budgets(text: str) -> list[int]:
    try:
        budgets = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise UserError(f"--budgets must be comma-separated integers, got '{text}'") from None
    if not budgets or budgets[0] < 0:
        raise UserError(f"--budgets must be non-negative integers, got '{text}'")
    return budgets


def parse_args(argv):
    p = OneLineArgumentParser(prog="dflash-eval", description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True, help="drafter folder (from training, or an export)")
    p.add_argument("--target", default=None, help="target folder or Hub id (default: the one the drafter names)")
    p.add_argument("--target-revision", default=None)
    p.add_argument("--suite", action="append", default=None,
                   help=f"suite name, NAME=local_file or a messages .jsonl (repeatable; default {DEFAULT_SUITE})")
    p.add_argument("--budgets", default="0,4,16,64,256", help="DDTree budgets (non-root nodes)")
    p.add_argument("--tree-scores", default="conditional", choices=TREE_SCORES,
                   help="a DSpark drafter's DDTree: path-conditioned (default) or from the backbone's marginals")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=128, help="per assistant turn")
    p.add_argument("--limit", type=int, default=None, help="prompts per suite (default: the suite's samples)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--verify-times", default=None,
                   help="costs JSON from benchmarks/gpu_costs.py: also predict the best budget on that device")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--output", required=True, help="report folder")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    args = p.parse_args(argv)
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    return args


@cli_guard
def main(argv=None):
    args = parse_args(argv)
    budgets = parse_budgets(args.budgets)
    out = Path(args.output)
    require_free_output(out, args.overwrite)
    device_costs = None
    if args.verify_times:
        try:
            device_costs = json.loads(Path(args.verify_times).read_text())
            device_costs["verify_ms_by_width"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--verify-times '{args.verify_times}' is not a costs JSON with verify_ms_by_width") from e

    drafter, meta = load_drafter(args.drafter)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_id = args.target or meta["target"]["name_or_path"]
    target = load_target(target_id, revision=args.target_revision or (None if args.target else meta["target"]["revision"]),
                         dtype=dtype, device=device, trust_remote_code=args.trust_remote_code)
    check_matches_target(drafter.config, target)
    drafter.to(device=device, dtype=dtype).eval()
    stops = stop_token_ids(target.model, target.tokenizer)
    suites = [load_suite(s, args.limit) for s in (args.suite or [DEFAULT_SUITE])]
    B = drafter.config.block_size

    plan = [("ar", 0), ("dflash", B - 1)] + [("ddtree", b) for b in budgets]
    bar = tqdm(total=len(plan) * sum(len(p) for _, p in suites), desc="eval", dynamic_ncols=True,
               mininterval=BAR_INTERVAL)
    results = []
    for name, prompts in suites:
        ar = None
        for method, budget in plan:
            bar.set_postfix(suite=name, method=f"{method}@{budget}" if method == "ddtree" else method)
            run = run_prompts(target, drafter, prompts, name, method, budget, args, stops, bar)
            ar = ar or run
            results.append(summarize(run, ar, args, B))
    bar.close()

    report = {
        "drafter": str(args.drafter), "target": target_id, "target_revision": target.revision,
        "block_size": B, "target_layer_ids": drafter.config.target_layer_ids,
        "variant": drafter.config.variant, "markov_rank": drafter.config.markov_rank,
        "markov_head_type": drafter.config.markov_head_type, "tree_scores": args.tree_scores,
        "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "budgets": budgets,
        "hardware": hardware_record(device), "results": results,
        "advice": advise_budget(results, device_costs),
        "command": "dflash-eval " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    if out.exists() and args.overwrite:
        shutil.rmtree(out)
    write_atomically(out, lambda tmp: write_report(tmp, report))
    print((out / "report.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
