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
"""

import math
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dflash_train.checkpoint.folders import (check_matches_target, drafter_fingerprint, load_drafter,
                                             resolve_folder, trained_for)
from dflash_train.core.errors import OneLineArgumentParser, UserError, cli_guard
from dflash_train.core.outputs import output_lock, require_free_output, write_atomically
from dflash_train.core.progress import BAR_INTERVAL
from dflash_train.core.seeds import SEED_LIMIT
from dflash_train.data.dataset import stop_token_ids
from dflash_train.decoding.decode import TREE_SCORES
from dflash_train.evaluation.costs import measure_costs, read_device_costs, widths_for
from dflash_train.evaluation.report import write_report
from dflash_train.evaluation.suites import DEFAULT_SUITE, load_suite
from dflash_train.evaluation.summary import build_report, hardware_record, scorer_key
from dflash_train.evaluation.sweep import check_prompts_fit, run_sweep, sweep_order, warm_up
from dflash_train.model.cpu_linear import CHOICES as CPU_LINEAR_CHOICES
from dflash_train.model.cpu_linear import use_stream_linear
from dflash_train.model.gqa_attention import use_gqa_sdpa
from dflash_train.model.target import (check_positions, config_positions, load_target, locate_verifier,
                                       round_weights_to_bf16, target_dtype)
from dflash_train.training.config import MAX_TREE_BUDGET

# --target-dtype: bf16 weight values held in fp32 (model/target.py round_weights_to_bf16)
BF16_WEIGHTS = "bf16-weights"

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


def parse_args(argv):
    p = OneLineArgumentParser(prog="dflash-eval", description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True, help="drafter folder (from training, or an export)")
    p.add_argument("--target", default=None,
                   help="target folder or Hub id (default: the one the drafter names)")
    p.add_argument("--target-revision", default=None)
    p.add_argument("--suite", action="append", default=None,
                   help="suite name, NAME=local_file or a messages .jsonl (repeatable; default "
                        f"{DEFAULT_SUITE})")
    p.add_argument("--budgets", default="4,16,64,256",
                   help="DDTree budgets (non-root nodes); 0 = plain decoding")
    p.add_argument("--tree-scores", default="conditional", choices=TREE_SCORES,
                   help="a DSpark, DFlash2 or XPress drafter's DDTree: path-conditioned "
                        "(default; DFlash2: by its selector) or from the backbone's marginals")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=128, help="per assistant turn")
    p.add_argument("--limit", type=int, default=None, help="prompts per suite (default: the suite's samples)")
    p.add_argument("--repeats", type=int, default=1,
                   help="times the whole interleaved sweep runs (timing samples)")
    p.add_argument("--concurrency", default="1,4,16",
                   help="requests sharing one verify forward, for the predicted speedups")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--target-dtype", choices=["auto", "bf16", BF16_WEIGHTS, "fp32"], default="auto",
                   help="target and drafter weights: auto = bf16 on a GPU that has it, else fp32; bf16 on a "
                        "CPU with AVX-512 BF16 verifies ~1.7x faster, but a tree's verify forward rounds "
                        "differently from AR's, so at temperature 0 outputs can part at near-ties: lossless "
                        f"is exact in fp32; {BF16_WEIGHTS} = weights rounded to bf16, activations in fp32 "
                        "(a CPU without native bf16: the streaming linear reads half the bytes, and "
                        "lossless stays exact)")
    p.add_argument("--cpu-linear", choices=CPU_LINEAR_CHOICES, default="auto",
                   help="fp32 on a CPU: stream = the weight-streaming linear (a few-token verify costs about "
                        "one token; needs cc and AVX2), torch = torch's GEMM, auto = stream where it builds")
    p.add_argument("--verify-times", default=None,
                   help="costs JSON from benchmarks/gpu_costs.py: also predict speedups on that device")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--output", required=True, help="report folder")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
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
    args.device = resolve_device(args.device)
    return args


def choose_cpu_linear(choice: str, target, drafter, device: torch.device, dtype: torch.dtype) -> str:
    """Switch target and drafter to the streaming linear where asked and possible. -> the one in use."""
    if choice == "torch" or device.type != "cpu" or dtype != torch.float32:
        if choice == "stream":
            raise UserError(f"--cpu-linear stream runs fp32 on a CPU only (here: {device.type}, "
                            f"{str(dtype).removeprefix('torch.')}); use --cpu-linear auto or torch")
        return "torch"
    _, why = use_stream_linear(target.model)
    if why is not None:
        if choice == "stream":
            raise UserError(f"--cpu-linear stream: {why}; use --cpu-linear torch")
        print(f"dflash-eval: torch's linear kept ({why})", file=sys.stderr)
        return "torch"
    use_stream_linear(drafter)
    return "stream"


@cli_guard
def main(argv=None):
    args = parse_args(argv)
    with output_lock(Path(args.output), "--output"):  # one dflash-train process per output
        run(args, argv)


def run(args, argv) -> None:
    out = Path(args.output)
    require_free_output(out, args.overwrite, "eval", [("--drafter", args.drafter), ("--target", args.target),
                                                      ("--verify-times", args.verify_times)])
    device_costs = read_device_costs(args.verify_times)
    suites = [load_suite(s, args.limit) for s in (args.suite or [DEFAULT_SUITE])]  # before the target: cheap
    names = [name for name, _ in suites]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:  # one heading and one report.json name would merge them
        specs = [s for s, (n, _) in zip(args.suite, suites) if n == twice]
        raise UserError(f"--suite: {' and '.join(specs)} are both named '{twice}' (a suite file is named by "
                        "its stem): give each suite once, under its own file name")

    drafter, meta = load_drafter(args.drafter)
    fingerprint = drafter_fingerprint(drafter)  # of the drafter as stored, before any cast or move
    device = args.device
    bf16_weights = args.target_dtype == BF16_WEIGHTS
    dtype = target_dtype("fp32" if bf16_weights else args.target_dtype, device)
    # the report names the target as the drafter does (a Hub id it is pinned to), wherever it loaded from
    target_id = args.target or meta["target"]["name_or_path"]
    source, chosen = (args.target, None) if args.target else locate_verifier(
        target_id, meta["target"].get("pin"), "--target")
    if chosen:
        print(chosen, file=sys.stderr)
    target = load_target(source, revision=args.target_revision or (None if args.target
                                                                      else meta["target"]["revision"]),
                         dtype=dtype, device=device, trust_remote_code=args.trust_remote_code)
    check_matches_target(drafter.config, target)
    positions = config_positions(target.model.config)
    check_positions(args.max_new_tokens, "--max-new-tokens", positions, target_id)
    check_prompts_fit(suites, target.tokenizer, positions, target_id)
    drafter.to(device=device, dtype=dtype).eval()
    if bf16_weights:  # before the streaming linear, which then keeps each weight's bf16 copy
        round_weights_to_bf16(target.model)
        round_weights_to_bf16(drafter)
    cpu_linear = choose_cpu_linear(args.cpu_linear, target, drafter, device, dtype)
    if device.type == "cpu":  # the same bits without copying K/V heads per layer (CUDA: sdpa's own choice)
        use_gqa_sdpa(target.model)
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
                   "hardware": hardware_record(device) | {
                       "dtype": BF16_WEIGHTS if bf16_weights else str(dtype).removeprefix("torch."),
                       "cpu_linear": cpu_linear, "attention": target.model.config._attn_implementation},
                   "variant": drafter.config.variant, "markov_rank": drafter.config.markov_rank,
                   "markov_head_type": drafter.config.markov_head_type,
                   "selector_rank": drafter.config.selector_rank,
                   "selector_top_k": drafter.config.selector_top_k,
                   **{k: getattr(drafter.config, k) for k in drafter.variant.recipe_fields},  # XPress's
                   "tree_scores": args.tree_scores,
                   "trained_for": trained_for(resolve_folder(args.drafter))})
    write_atomically(out, lambda tmp: write_report(tmp, report), "eval")
    print((out / "report.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
