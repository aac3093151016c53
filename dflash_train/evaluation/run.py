"""The eval pipeline (`dflash-eval`, cli/eval.py): a drafter's acceptance and speed under AR, the DFlash
chain and DDTree over budgets. As a library: `evaluate(EvalSettings(drafter=..., output=...))` -> the
report dict (report.py writes it; the command line does, atomically, holding the output's lock).

Steps: read the suites and any device costs (cheap, before the target) -> load the drafter and its
target, check they match and every prompt fits -> cast, the streaming linear, GQA attention ->
warm up, then the interleaved sweep (sweep.py: every prompt by every method back to back) -> the cost
curve at the mean context AR saw (costs.py) -> the report (summary.py). Bad input stops with one
UserError line; the messages name the command's flags (--suite, --cpu-linear): the settings below are
those flags.
"""

import sys
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from dflash_train.checkpoint.folders import (check_matches_target, drafter_fingerprint, load_drafter,
                                             resolve_folder, trained_for)
from dflash_train.core.errors import UserError
from dflash_train.core.progress import BAR_INTERVAL
from dflash_train.data.dataset import stop_token_ids
from dflash_train.evaluation.costs import measure_costs, read_device_costs, widths_for
from dflash_train.evaluation.suites import DEFAULT_SUITE, Prompt, load_suite
from dflash_train.evaluation.summary import build_report, hardware_record, scorer_key
from dflash_train.evaluation.sweep import Sample, check_prompts_fit, run_sweep, sweep_order, warm_up
from dflash_train.model.cpu_linear import use_stream_linear
from dflash_train.model.gqa_attention import use_gqa_sdpa
from dflash_train.model.target import (Target, check_positions, config_positions, load_target,
                                       locate_verifier, round_weights_to_bf16, target_dtype)

# target_dtype: bf16 weight values held in fp32 (model/target.py round_weights_to_bf16)
BF16_WEIGHTS = "bf16-weights"


@dataclass
class EvalSettings:
    """One dflash-eval run; each field is the flag of the same name (cli/eval.py checks their bounds)."""
    drafter: str  # drafter folder (from training, or an export)
    output: str  # report folder: where the command line writes the report (evaluate writes nothing)
    target: str | None = None  # target folder or Hub id; None: the one the drafter names, at its pin
    target_revision: str | None = None  # None: the drafter's revision (when target is None)
    suite: list[str] | None = None  # names, NAME=local_file or messages .jsonl files; None: DEFAULT_SUITE
    budgets: list[int] = field(default_factory=lambda: [4, 16, 64, 256])  # DDTree budgets, each >= 1
    tree_scores: str = "conditional"  # a key of decode.TREE_SCORES (DSpark, DFlash2, XPress drafters)
    temperature: float = 0.0  # 0: greedy, and lossless is judged
    max_new_tokens: int = 128  # per assistant turn, >= 2 (the first token comes from the prefill)
    limit: int | None = None  # prompts per suite; None: the suite's samples
    repeats: int = 1  # times the whole interleaved sweep runs (timing samples)
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])  # requests per verify, predicted
    seed: int = 0  # per-prompt decoding seeds derive from it
    device: str = "auto"  # auto, cpu, cuda, cuda:N (resolve_device)
    target_dtype: str = "auto"  # auto (bf16 on a GPU that has it, else fp32), bf16, BF16_WEIGHTS or fp32
    cpu_linear: str = "auto"  # fp32 on a CPU: stream, torch, or auto = stream where it builds
    verify_times: str | None = None  # a benchmarks/gpu_costs.py JSON: also predict speedups on its device
    trust_remote_code: bool = False
    overwrite: bool = False  # replace a non-empty output of ours
    argv: list[str] | None = None  # the arguments report.json's "command" records; None: sys.argv[1:]


def resolve_device(text: str) -> torch.device:
    """auto, cpu, cuda or cuda:N -> a device this torch can run on (else one UserError line)."""
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


def read_suites(specs: list[str] | None, limit: int | None) -> list[tuple[str, list[Prompt]]]:
    """The suites, each under its own name: one heading and one report.json name would merge two."""
    suites = [load_suite(s, limit) for s in (specs or [DEFAULT_SUITE])]
    names = [name for name, _ in suites]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        given = [s for s, (n, _) in zip(specs, suites) if n == twice]
        raise UserError(f"--suite: {' and '.join(given)} are both named '{twice}' (a suite file is named by "
                        "its stem): give each suite once, under its own file name")
    return suites


def load_verifier(s: EvalSettings, meta: dict, device: torch.device,
                  dtype: torch.dtype) -> tuple[Target, str]:
    """The target the drafter is verified by -> (it, the name the report gives it: the drafter's own,
    a Hub id it is pinned to, wherever it loaded from, unless s.target names another)."""
    target_id = s.target or meta["target"]["name_or_path"]
    source, chosen = (s.target, None) if s.target else locate_verifier(
        target_id, meta["target"].get("pin"), "--target")
    if chosen:
        print(chosen, file=sys.stderr)
    target = load_target(source, revision=s.target_revision or (None if s.target
                                                                   else meta["target"]["revision"]),
                         dtype=dtype, device=device, trust_remote_code=s.trust_remote_code)
    return target, target_id


def cost_curve(target: Target, drafter, samples: list[Sample], methods: list[tuple[str, int]],
               concurrency: list[int]) -> dict:
    """The verify and draft cost curve (costs.measure_costs) at the mean context the AR verify
    forwards saw, wide enough for every method at the highest concurrency."""
    ar = [x for x in samples if x.method == "ar"]
    context = max(1, round(sum(x.context_tokens for x in ar) / max(sum(x.decoded for x in ar), 1)))
    widths, context_widths = widths_for(max(concurrency) * max(b + 1 for _, b in methods))
    return measure_costs(target, drafter, context, concurrency, widths=widths,
                         contexts=[c * context for c in concurrency], context_widths=context_widths)


def evaluate(settings: EvalSettings) -> dict:
    """Decode every suite's prompts by AR, the chain and DDTree at each budget, measure the cost curve
    -> the report (summary.build_report plus the drafter, target and hardware). Cheap inputs are
    checked before the target loads; the output is the caller's to check and write."""
    s = settings
    device = resolve_device(s.device)
    device_costs = read_device_costs(s.verify_times)
    suites = read_suites(s.suite, s.limit)  # before the target: cheap
    drafter, meta = load_drafter(s.drafter)
    fingerprint = drafter_fingerprint(drafter)  # of the drafter as stored, before any cast or move
    bf16_weights = s.target_dtype == BF16_WEIGHTS
    dtype = target_dtype("fp32" if bf16_weights else s.target_dtype, device)
    target, target_id = load_verifier(s, meta, device, dtype)
    check_matches_target(drafter.config, target)
    positions = config_positions(target.model.config)
    check_positions(s.max_new_tokens, "--max-new-tokens", positions, target_id)
    check_prompts_fit(suites, target.tokenizer, positions, target_id)
    drafter.to(device=device, dtype=dtype).eval()
    if bf16_weights:  # before the streaming linear, which then keeps each weight's bf16 copy
        round_weights_to_bf16(target.model)
        round_weights_to_bf16(drafter)
    cpu_linear = choose_cpu_linear(s.cpu_linear, target, drafter, device, dtype)
    if device.type == "cpu":  # the same bits without copying K/V heads per layer (CUDA: sdpa's own choice)
        use_gqa_sdpa(target.model)
    stops = stop_token_ids(target.model, target.tokenizer)
    B = drafter.config.block_size

    methods = [("ar", 0), ("dflash", B - 1)] + [("ddtree", b) for b in s.budgets]
    order = sweep_order([len(p) for _, p in suites], methods, s.repeats)
    warm_up(target, drafter, suites[0][1][0], methods, s, stops)
    bar = tqdm(total=len(order), desc="eval", dynamic_ncols=True, mininterval=BAR_INTERVAL)
    samples = run_sweep(target, drafter, [p for _, p in suites], order, s, stops, bar)
    bar.close()

    costs = cost_curve(target, drafter, samples, methods, s.concurrency)
    scores = scorer_key(drafter.config, s.tree_scores)  # which scored costs --verify-times reads
    report = build_report(s, suites, methods, samples, costs, device_costs, B, scores)
    report.update({"drafter": str(s.drafter), "drafter_fingerprint": fingerprint, "target": target_id,
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
                   "tree_scores": s.tree_scores,
                   "trained_for": trained_for(resolve_folder(s.drafter))})
    return report
