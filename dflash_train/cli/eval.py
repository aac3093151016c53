"""`dflash-eval`: a drafter's acceptance and speed under AR, the DFlash chain and DDTree over budgets.

    dflash-eval --drafter runs/demo/final --budgets 4,16,64,256 --output runs/demo/eval
    dflash-eval --drafter D --target T --suite gsm8k --suite mt-bench --temperature 1.0 --repeats 3 --output R

Every prompt is decoded by every method back to back, in an order rotated from prompt to
prompt (`sweep_order`), so a change in machine load lands on all of them. For each suite and
method: tau (tokens per target forward, bonus included, macro-averaged over prompts as the
DDTree paper does), the acceptance-length histogram, the speedup over AR (the median of
per-prompt time ratios, with a bootstrap interval: dflash_train/evaluation/speed.py), medians of tokens/s
and of the time per stage (prefill excluded), the speedup predicted at each --concurrency from a
cost curve measured here (dflash_train/evaluation/costs.py), and at temperature 0 `lossless`: every chain
and DDTree output equals the AR greedy output token for token. Writes report.json, report.md
and PNG plots to --output.

The pipeline: dflash_train/evaluation/run.py (evaluate); here the flags, the output's check, the write.
"""

import math
import sys
from pathlib import Path

from dflash_train.cli import defaults_of, locked_main
from dflash_train.core.errors import OneLineArgumentParser, UserError
from dflash_train.core.outputs import require_free_output, write_atomically
from dflash_train.core.seeds import SEED_LIMIT
from dflash_train.decoding.decode import TREE_SCORES
from dflash_train.evaluation.report import write_report
from dflash_train.evaluation.run import BF16_WEIGHTS, EvalSettings, evaluate, resolve_device
from dflash_train.evaluation.suites import DEFAULT_SUITE
from dflash_train.model.cpu_linear import CHOICES as CPU_LINEAR_CHOICES
from dflash_train.training.config import MAX_TREE_BUDGET

# A budget-b tree is verified in one forward of width b+1: [b+1, vocab] logits and a
# [b+1, context+b+1] mask, and the cost curve is measured up to width 1024 at most. Beyond 4096 nodes
# (MAX_TREE_BUDGET, the recipes' bound too) the allocator, not the tree, decides; 256 requests
# already put a 64-node tree at width 16,640.
MAX_CONCURRENCY = 256


MAX_REPEATS = 100


def parse_budgets(text: str) -> list[int]:
    """DDTree budgets; 0 means plain decoding, which always runs (as AR) and is not a tree."""
    try:
        budgets = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise UserError(f"--budgets must be comma-separated integers, got '{text}'") from None
    if not budgets or budgets[0] < 0:
        raise UserError(f"--budgets must be non-negative integers, got '{text}'")
    if budgets[-1] > MAX_TREE_BUDGET:
        raise UserError(f"--budgets {budgets[-1]} is above the limit of {MAX_TREE_BUDGET} tree nodes (one "
                        "verify forward holds [budget+1, vocab] logits and a [budget+1, context+budget+1] "
                        "mask)")
    return [b for b in budgets if b > 0]


def parse_concurrency(text: str) -> list[int]:
    try:
        levels = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        raise UserError(f"--concurrency must be comma-separated integers, got '{text}'") from None
    if not levels or levels[0] < 1:
        raise UserError(f"--concurrency must be integers >= 1, got '{text}'")
    if levels[-1] > MAX_CONCURRENCY:
        raise UserError(f"--concurrency {levels[-1]} is above the limit of {MAX_CONCURRENCY} requests (the "
                        "cost curve runs the drafter on that many contexts at once)")
    return levels


def parse_args(argv) -> EvalSettings:
    """The flags, checked -> the run's settings (one `error:` line and exit 2 on a bad flag)."""
    p = OneLineArgumentParser(prog="dflash-eval", description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True, help="drafter folder (from training, or an export)")
    p.add_argument("--target",
                   help="target folder or Hub id (default: the one the drafter names)")
    p.add_argument("--target-revision")
    p.add_argument("--suite", action="append",
                   help="suite name, NAME=local_file or a messages .jsonl (repeatable; default "
                        f"{DEFAULT_SUITE})")
    p.add_argument("--budgets",
                   help="DDTree budgets (non-root nodes); 0 = plain decoding")
    p.add_argument("--tree-scores", choices=TREE_SCORES,
                   help="a DSpark, DFlash2 or XPress drafter's DDTree: path-conditioned "
                        "(default; DFlash2: by its selector) or from the backbone's marginals")
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-new-tokens", type=int, help="per assistant turn")
    p.add_argument("--limit", type=int, help="prompts per suite (default: the suite's samples)")
    p.add_argument("--repeats", type=int,
                   help="times the whole interleaved sweep runs (timing samples)")
    p.add_argument("--concurrency",
                   help="requests sharing one verify forward, for the predicted speedups")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--target-dtype", choices=["auto", "bf16", BF16_WEIGHTS, "fp32"],
                   help="target and drafter weights: auto = bf16 on a GPU that has it, else fp32; bf16 on a "
                        "CPU with AVX-512 BF16 verifies ~1.7x faster, but a tree's verify forward rounds "
                        "differently from AR's, so at temperature 0 outputs can part at near-ties: lossless "
                        f"is exact in fp32; {BF16_WEIGHTS} = weights rounded to bf16, activations in fp32 "
                        "(a CPU without native bf16: the streaming linear reads half the bytes, and "
                        "lossless stays exact)")
    p.add_argument("--cpu-linear", choices=CPU_LINEAR_CHOICES,
                   help="fp32 on a CPU: stream = the weight-streaming linear (a few-token verify costs about "
                        "one token; needs cc and AVX2), torch = torch's GEMM, auto = stream where it builds")
    p.add_argument("--verify-times",
                   help="costs JSON from benchmarks/gpu_costs.py: also predict speedups on that device")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--output", required=True, help="report folder")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    defaults = defaults_of(EvalSettings)  # stated once, in EvalSettings; the comma lists as their text
    p.set_defaults(**(defaults | {k: ",".join(map(str, defaults[k])) for k in ("budgets", "concurrency")}))
    args = p.parse_args(argv)
    if not 0 <= args.seed < SEED_LIMIT:  # per-prompt seeds are derived from it
        p.error(f"--seed must be from 0 to 2**32 - 1, got {args.seed}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.max_new_tokens < 2:
        p.error("--max-new-tokens must be >= 2 (the first token comes from the prefill; rounds decode the "
                "rest)")
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    if not 1 <= args.repeats <= MAX_REPEATS:  # each repeat keeps every sample in memory (1e9 was OOM-killed)
        p.error(f"--repeats must be in 1..{MAX_REPEATS} (timing samples of the whole sweep), got "
                f"{args.repeats}")
    args.budgets = parse_budgets(args.budgets)
    args.concurrency = parse_concurrency(args.concurrency)
    resolve_device(args.device)  # checked here, before the output or any input; evaluate resolves it
    return EvalSettings(**vars(args) | {"argv": argv})


def run(settings: EvalSettings) -> None:
    """Check the output is free, evaluate, write the report folder whole, print report.md."""
    out = Path(settings.output)
    inputs = [("--drafter", settings.drafter), ("--target", settings.target),
              ("--verify-times", settings.verify_times)]
    require_free_output(out, settings.overwrite, "eval", inputs)
    report = evaluate(settings)
    write_atomically(out, lambda tmp: write_report(tmp, report), "eval")
    print((out / "report.md").read_text())


main = locked_main(parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
