"""What three exact changes to a decoding round cost and save on a CPU, each against what it replaced,
alternated in one run (so machine load lands on both alike):

  tree     a DDTree's build: over the draft vocabulary's N logits with ids mapped through d2t (now),
           against full_logits' scatter into the target's V columns (-inf elsewhere) and a build over them
  draft    the drafter's block pass through the streaming linear: weights streamed from a bf16 copy (now,
           the drafter's weights are bf16 values) against from their fp32 selves
  verify   the target's verify forward of 1 token (plain decoding) and of 4 (DDTree@3): sdpa with GQA K/V
           heads shared (enable_gqa, now) against transformers' sdpa, which copies them under a mask

    python benchmarks/round_overheads.py --drafter checkpoints/smollm2-135m-dflash --context 300 --rounds 8

Medians over rounds; one thread; the streaming linear on for all. Writes
benchmarks/results/round_overheads.json (command, commit, machine, every timing).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_train.checkpoint.folders import load_drafter  # noqa: E402
from dflash_train.decoding.ddtree import build_tree, root_only_tree  # noqa: E402
from dflash_train.decoding.decode import choose, verify  # noqa: E402
from dflash_train.decoding.proposers import draft_hidden  # noqa: E402
from dflash_train.evaluation.summary import hardware_record  # noqa: E402
from dflash_train.model.cpu_linear import StreamLinear, use_stream_linear  # noqa: E402
from dflash_train.model.drafter import ContextCache  # noqa: E402
from dflash_train.model.gqa_attention import NAME as SHARED_KV, use_gqa_sdpa  # noqa: E402
from dflash_train.model.target import load_target, taps_from_hidden_states  # noqa: E402

BUDGET = 3


def ms(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e3 * (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default=str(ROOT / "checkpoints" / "smollm2-135m-dflash"))
    p.add_argument("--target", default=str(ROOT / "data" / "real" / "smollm2-135m-instruct"))
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "round_overheads.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    drafter = load_drafter(args.drafter)[0].eval().float()
    target = load_target(args.target)
    if drafter.lm_head is None:
        sys.exit("error: the tree comparison needs a drafter with a draft vocabulary")
    for m in (target.model, drafter):
        if use_stream_linear(m)[1] is not None:
            sys.exit(f"error: the streaming linear cannot run here: {use_stream_linear(m)[1]}")
    copies = {m: m.weight_bf16 for m in drafter.modules() if isinstance(m, StreamLinear)}
    if not all(c is not None for c in copies.values()):
        sys.exit("error: the drafter's weights are not all bf16 values (export it with --dtype bf16)")
    use_gqa_sdpa(target.model)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.model.config.vocab_size, (1, args.context), generator=g)
    cache = DynamicCache(config=target.model.config)
    with torch.no_grad():
        out = target.model(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        ctx = ContextCache(drafter.config.num_hidden_layers)
        drafter.extend_context(ctx, taps_from_hidden_states(out.hidden_states,
                                                            drafter.config.target_layer_ids),
                               torch.arange(args.context)[None])
        hidden = draft_hidden(drafter, target, ctx, 5, args.context)[1:]  # [B-1, H], the tree's input
    kept, head = drafter.draft_vocab.kept, drafter.logits_head(target.lm_head)
    trees = {1: root_only_tree(), BUDGET + 1: build_tree(torch.randn(7, 64, generator=g), BUDGET)}

    def tree_now():
        build_tree(head(hidden), BUDGET, token_ids=kept)

    def tree_before():
        build_tree(drafter.full_logits(hidden, target.lm_head), BUDGET)

    def draft(bf16: bool):
        for m, c in copies.items():
            m.weight_bf16 = c if bf16 else None
        head(draft_hidden(drafter, target, ctx, 5, args.context)[1:])

    def verify_once(width: int, attention: str):
        target.model.set_attn_implementation(attention)
        logits, _ = verify(target, cache, trees[width], 5, args.context, want_taps=width > 1)
        choose(logits, 0.0, None).tolist()
        cache.crop(-width)

    jobs = {"tree_now": (tree_now, 20), "tree_before": (tree_before, 20),
            "draft_bf16": (lambda: draft(True), 10), "draft_fp32": (lambda: draft(False), 10)}
    for w in trees:
        jobs[f"verify{w}_shared_kv"] = (lambda w=w: verify_once(w, SHARED_KV), 3)
        jobs[f"verify{w}_sdpa"] = (lambda w=w: verify_once(w, "sdpa"), 3)
    names = list(jobs)
    raw = {k: [] for k in names}
    with torch.no_grad():
        for k in names:  # warm-up
            jobs[k][0]()
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for k in (order if r % 2 == 0 else order[::-1]):
                fn, n = jobs[k]
                raw[k].append(ms(fn, n))
            print(r, {k: round(v[-1], 2) for k, v in raw.items()}, flush=True)
    med = {k: round(statistics.median(v), 3) for k, v in raw.items()}
    w = BUDGET + 1
    summary = {
        "tree_ms": {"now": med["tree_now"], "before": med["tree_before"]},
        "draft_ms": {"now": med["draft_bf16"], "before": med["draft_fp32"]},
        "verify_ms": {"1": {"now": med["verify1_shared_kv"], "before": med["verify1_sdpa"]},
                      str(w): {"now": med[f"verify{w}_shared_kv"], "before": med[f"verify{w}_sdpa"]}},
        "verify_x_one_token": {"now": round(med[f"verify{w}_shared_kv"] / med["verify1_shared_kv"], 3),
                               "before": round(med[f"verify{w}_sdpa"] / med["verify1_sdpa"], 3)},
    }
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    result = {"command": "python " + " ".join(sys.argv), "commit": commit,
              "machine": hardware_record(torch.device("cpu")), "target": args.target, "drafter": args.drafter,
              "context": args.context, "rounds": args.rounds, "budget": BUDGET, "summary": summary,
              "median_ms": med, "raw_ms": raw}
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
