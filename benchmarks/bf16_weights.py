"""bf16 weights on a CPU without native bf16 (`dflash-eval --target-dtype bf16-weights`): what they cost
and what they change, against fp32, in one run.

    python benchmarks/bf16_weights.py --rounds 6 --limit 8 --max-new-tokens 128

1. Cost: each round runs evaluation.costs.measure_costs (decode.verify over a tree of each width, and
   one drafter block pass) on the fp32 target and on the same target with its weights rounded to bf16,
   in alternating order, both through the streaming linear (the rounded one reads bf16 copies: half
   the bytes); medians over rounds.
2. Departure: plain greedy decoding (all turns, as dflash-eval decodes them) of the first --limit
   prompts of each suite by both targets; per turn, whether the outputs are equal and where they first
   part. Speculative decoding of the rounded target is checked against its own plain decoding by
   dflash-eval (`lossless`); this says how far that reference is from fp32's.

Writes benchmarks/results/bf16_weights.json.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_train.checkpoint.folders import load_drafter  # noqa: E402
from dflash_train.data.dataset import stop_token_ids  # noqa: E402
from dflash_train.evaluation.costs import measure_costs  # noqa: E402
from dflash_train.evaluation.suites import load_suite  # noqa: E402
from dflash_train.evaluation.summary import hardware_record  # noqa: E402
from dflash_train.evaluation.sweep import Sample, decode_prompt  # noqa: E402
from dflash_train.model.cpu_linear import use_stream_linear  # noqa: E402
from dflash_train.model.gqa_attention import use_gqa_sdpa  # noqa: E402
from dflash_train.model.target import load_target, round_weights_to_bf16  # noqa: E402

WIDTHS = [1, 2, 4, 5, 8, 9, 16, 17]
SUITES = ["mtbench", "gsm8k", "humaneval"]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (a length when one is the other's prefix); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def costs(targets: dict, drafter, context: int, rounds: int) -> dict:
    ms = {k: {"verify": [], "draft": []} for k in targets}
    for r in range(rounds):
        for kind in (list(targets) if r % 2 == 0 else list(targets)[::-1]):
            c = measure_costs(targets[kind], drafter, context, [1], widths=WIDTHS, rounds=1, seed=r)
            ms[kind]["verify"].append(c["verify_ms"][0])
            ms[kind]["draft"].append(c["draft_ms"][0][0])
            print(kind, r, [round(x, 1) for x in c["verify_ms"][0]], round(c["draft_ms"][0][0], 1),
                  flush=True)
    med = {}
    for k, v in ms.items():
        by_width = {w: round(statistics.median(row[i] for row in v["verify"]), 2)
                    for i, w in enumerate(WIDTHS)}
        med[k] = {"verify_ms_by_width": by_width, "draft_ms": round(statistics.median(v["draft"]), 2),
                  "verify_x_width_1": {w: round(t / by_width[1], 3) for w, t in by_width.items()}}
    med["bf16_weights_over_fp32"] = {w: round(med["bf16-weights"]["verify_ms_by_width"][w]
                                              / med["fp32"]["verify_ms_by_width"][w], 3) for w in WIDTHS}
    return {"medians": med, "raw_ms": ms}


def departure(targets: dict, limit: int, max_new_tokens: int) -> dict:
    t32 = targets["fp32"]
    stops = stop_token_ids(t32.model, t32.tokenizer)
    out = {}
    for spec in SUITES:
        _, prompts = load_suite(spec, limit)
        turns = []
        for i, prompt in enumerate(prompts):
            got = {k: decode_prompt(t, None, prompt, Sample(0, i, 0, "ar", 0), stops, seed=i,
                                    max_new_tokens=max_new_tokens, temperature=0.0,
                                    tree_scores="conditional").outputs for k, t in targets.items()}
            for a, b in zip(got["fp32"], got["bf16-weights"]):
                turns.append({"prompt": i, "tokens": [len(a), len(b)],
                              "first_difference": first_difference(a, b)})
            print(spec, i, [t["first_difference"] for t in turns if t["prompt"] == i], flush=True)
        parted = [t for t in turns if t["first_difference"] is not None]
        out[spec] = {"prompts": len(prompts), "turns": len(turns), "turns_equal": len(turns) - len(parted),
                     "prompts_equal": sum(all(t["first_difference"] is None for t in turns
                                              if t["prompt"] == i)
                                          for i in range(len(prompts))),
                     "median_first_difference": (statistics.median(t["first_difference"] for t in parted)
                                                 if parted else None),
                     "turns_detail": turns}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default=str(ROOT / "checkpoints" / "smollm2-135m-dflash"))
    p.add_argument("--target", default=str(ROOT / "data" / "real" / "smollm2-135m-instruct"))
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--limit", type=int, default=8, help="prompts per suite for the departure count")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "bf16_weights.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    drafter = load_drafter(args.drafter)[0].eval()
    targets = {"fp32": load_target(args.target), "bf16-weights": load_target(args.target)}
    round_weights_to_bf16(targets["bf16-weights"].model)
    for t in targets.values():  # as dflash-eval runs them on a CPU
        _, why = use_stream_linear(t.model)
        if why is not None:
            sys.exit(f"error: the streaming linear cannot run here: {why}")
        use_gqa_sdpa(t.model)
    use_stream_linear(drafter)
    cost = costs(targets, drafter, args.context, args.rounds)
    parted = departure(targets, args.limit, args.max_new_tokens)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    out = {"command": "python " + " ".join(sys.argv), "commit": commit,
           "machine": hardware_record(torch.device("cpu")), "target": args.target, "drafter": args.drafter,
           "context": args.context, "rounds": args.rounds, "costs": cost, "departure": parted}
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(cost["medians"], indent=1))
    print(json.dumps({s: {k: v for k, v in d.items() if k != "turns_detail"} for s, d in parted.items()},
                     indent=1))


if __name__ == "__main__":
    main()
