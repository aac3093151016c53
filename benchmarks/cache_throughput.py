"""Offline hidden-state cache: build throughput and bytes per token on disk, measured on the tiny
target, and what the same layout costs for Qwen3-8B.

    .venv/bin/python benchmarks/cache_throughput.py [--rows 400]

The tiny numbers are measured here (one process, CPU). The Qwen3-8B numbers are arithmetic from
the layout (5 taps + the last hidden state, hidden 4096) and stated assumptions, not measurements.
"""

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_train.data.dataset import load_conversations  # noqa: E402
from dflash_train.data.hs_cache import build_cache, bytes_per_token  # noqa: E402
from dflash_train.model.target import load_target  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=400)
    args = p.parse_args()
    target = load_target(str(ROOT / "data" / "tiny-target"))
    ds = load_conversations(str(ROOT / "data" / "tiny" / "train.jsonl"), target.tokenizer,
                            256).select(range(args.rows))
    print(f"\ntiny target (8 layers, hidden 128), taps [1, 5], {args.rows} conversations, CPU\n")
    print(f"{'dtype':>9} {'tokens':>8} {'s':>6} {'tokens/s':>9} {'bytes/token':>12} {'on disk/token':>14}")
    for dtype in ["float32", "bfloat16", "fp8"]:
        out = Path(tempfile.mkdtemp()) / "c"
        t0 = time.perf_counter()
        m = build_cache(target, ds, [1, 5], out, dtype, shard_rows=128, batch_size=16)
        dt = time.perf_counter() - t0
        print(f"{dtype:>9} {m['tokens']:>8} {dt:>6.1f} {m['tokens'] / dt:>9.0f} {m['bytes_per_token']:>12} "
              f"{m['bytes_on_disk'] / m['tokens']:>14.1f}")
        shutil.rmtree(out.parent)

    print("\nQwen3-8B, 5 taps + last hidden state, hidden 4096 (layout arithmetic):")
    print(f"{'dtype':>9} {'bytes/token':>12} {'per 3072-token sample':>22} {'800K samples x 1K tokens':>25}")
    for dtype in ["bfloat16", "fp8"]:
        bpt = bytes_per_token(5, 4096, dtype)
        print(f"{dtype:>9} {bpt:>12,} {bpt * 3072 / 2**20:>18.1f} MiB "
              f"{bpt * 800e3 * 1024 / 2**40:>21.1f} TiB")
    flops = 2 * 8.19e9  # forward FLOPs per token of an 8.19B-parameter target
    for mfu in [0.3, 0.5]:
        tps = 790e12 * mfu / flops
        gib = tps * bytes_per_token(5, 4096, "bfloat16") / 2**30
        print(f"H200 at {mfu:.0%} of 790 bf16 TFLOP/s: ~{tps:,.0f} tokens/s per GPU (assumed, not measured), "
              f"writing ~{gib:.1f} GiB/s in bf16 per GPU, ~{8 * gib:.0f} GiB/s for 8 GPUs: "
              f"size the disk for it")


if __name__ == "__main__":
    main()
