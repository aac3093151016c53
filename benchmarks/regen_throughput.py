"""Regeneration speed: the static engine (--backend static) against today's batched `generate`, interleaved.

    make real-target && python benchmarks/regen_throughput.py [--prompts 48] [--max-new-tokens 128]

Both answer the same ShareGPT prompts greedily in fp32 on one thread, in alternating rounds (baseline,
engine, baseline, engine) so machine load hits both alike. Today's path is `dflash-prepare --regenerate`'s
transformers backend: prompts ordered by length, batches of 16, left padded. Reports answer tokens/s of each
round, the ratio, and how many answers differ between the two (any token): the engine computes the same
model, so only float-order ties may differ. Raw results -> benchmarks/results/regen_throughput.json.
"""

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from dflash_train.core.paths import ROOT
from dflash_train.data import regenerate as regen
from dflash_train.data.corpus import select_prompts
from dflash_train.data.dataset import stop_token_ids
from dflash_train.data.engine import static_generate
from dflash_train.data.real_target import DEFAULT_DEST, MODEL_DIR
from dflash_train.model.target import load_target


def baseline(generate, prompts):
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = [None] * len(prompts)
    for lo in range(0, len(order), 16):
        idx = order[lo:lo + 16]
        for i, g in zip(idx, generate([prompts[i] for i in idx], 0)):
            out[i] = g
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--real", default=str(DEFAULT_DEST))
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--slots", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "regen_throughput.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    target = load_target(str(Path(args.real) / MODEL_DIR), dtype=torch.float32)
    tok = target.tokenizer
    convs = select_prompts(Path(args.real) / "prompts" / "sharegpt.jsonl", tok, args.prompts, 192, seed=1)
    prompts = [regen._prompt_ids(tok, c, False) for c in convs]
    stops = sorted(stop_token_ids(target.model, tok, "<|im_end|>"))
    s = regen.Sampling("transformers", 0.0, 1.0, args.max_new_tokens, 0, 16, False, True)
    paths = {"generate_b16": lambda: baseline(regen.transformers_generate(target, stops, s), prompts),
             "static_engine": lambda: static_generate(target, stops, replace(s, backend="static"), args.slots,
                                                      192 + args.max_new_tokens + 1)(prompts, 0)}
    rounds, answers = [], {}
    for r in range(args.rounds):
        for name, run in paths.items():
            t = time.time()
            gens = run()
            dt = time.time() - t
            n = sum(len(g.tokens) + g.stopped for g in gens)  # the stop token is generated too
            rounds.append({"round": r, "path": name, "seconds": round(dt, 2), "tokens": n,
                           "tokens_per_s": round(n / dt, 1)})
            answers[name] = gens
            print(json.dumps(rounds[-1]), flush=True)
    rate = {k: sum(x["tokens"] for x in rounds if x["path"] == k)
            / sum(x["seconds"] for x in rounds if x["path"] == k)
            for k in paths}
    differ = sum(a != b for a, b in zip(answers["generate_b16"], answers["static_engine"]))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    result = {"command": "python " + " ".join(sys.argv), "commit": commit,
              "machine": {"cpu": platform.processor() or platform.machine(), "cores_used": 1,
                          "note": "shared with other jobs; ratios are interleaved rounds"},
              "settings": vars(args) | {"dtype": "float32"}, "rounds": rounds,
              "tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
              "speedup": round(rate["static_engine"] / rate["generate_b16"], 2),
              "answers_differing": differ, "answers": len(prompts)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("tokens_per_s", "speedup", "answers_differing", "answers")}))


if __name__ == "__main__":
    main()
