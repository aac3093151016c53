"""Throughput of dflash-prepare on the bundled tiny target and data, on CPU.

    .venv/bin/python benchmarks/prepare_throughput.py [--regen-rows 32] [--threads N]

tokenize: read + normalise + chat template + masks for all of data/tiny/train.jsonl (3000
conversations), as `dflash-prepare` does; tokens/s counts every token of the rendered rows.
regenerate: the target answers every turn of the first --regen-rows conversations (greedy,
--max-new-tokens per turn) at each batch size; tokens/s counts generated tokens. The tiny target
is 1.8M parameters, so these numbers measure the pipeline's own overhead more than a model.
--threads sets torch's intra-op threads (on a few busy cores one thread decodes a tiny model fastest).
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

from dflash_train.data import chat
from dflash_train.data import regenerate as regen
from dflash_train.data.dataset import stop_token_ids
from dflash_train.model.target import load_target

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "tiny" / "train.jsonl"
TARGET = ROOT / "data" / "tiny-target"


def read(limit: int | None = None) -> list[list[dict]]:
    fields = chat.Fields(*chat.FORMATS["messages"], chat.ROLE_NAMES)
    rows = chat.read_rows(str(DATA), "json", "train", None)
    conversations, _ = chat.read_conversations(rows, "messages", fields, strict=True, source=str(DATA))
    return conversations[:limit]


def main():
    p = argparse.ArgumentParser(description="Time dflash-prepare's tokenization and regeneration on CPU.")
    p.add_argument("--regen-rows", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="8,32")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(str(TARGET))
    tok = target.tokenizer
    eot = chat.end_of_turn(tok)
    rows = []  # (stage, conversations, tokens, seconds)

    t0 = time.perf_counter()
    conversations = read()
    encoded = [r for r in chat.encode_conversations(tok, conversations, eot, 3072, False)
               if not isinstance(r, str)]
    rows.append(("tokenize", len(conversations), sum(len(ids) for ids, _ in encoded),
                 time.perf_counter() - t0))

    convs = read(args.regen_rows)
    stops = sorted(stop_token_ids(target.model, tok, eot))
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        s = regen.Sampling("transformers", 0.0, 1.0, args.max_new_tokens, 0, bs, False, True)
        generate = regen.transformers_generate(target, stops, s)
        with tempfile.TemporaryDirectory() as work:
            t0 = time.perf_counter()
            _, stats = regen.regenerate(convs, tok, generate, s, Path(work), {})
            rows.append((f"regenerate bs={bs}", len(convs), stats["generated_tokens"],
                         time.perf_counter() - t0))

    params = sum(p.numel() for p in target.model.parameters()) / 1e6
    print(f"\ntorch {torch.__version__}, {args.threads} thread(s), tiny target ({params:.1f}M parameters), "
          f"regeneration: greedy, max {args.max_new_tokens} new tokens per turn")
    print(f"| {'stage':<18} | {'convs':>6} | {'tokens':>8} | {'seconds':>8} | {'convs/s':>8} "
          f"| {'tokens/s':>9} |")
    print(f"|{'-' * 20}|{'-' * 8}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 11}|")
    for stage, n, tokens, sec in rows:
        print(f"| {stage:<18} | {n:>6} | {tokens:>8} | {sec:>8.2f} | {n / sec:>8.1f} | "
              f"{tokens / sec:>9.0f} |")


if __name__ == "__main__":
    main()
