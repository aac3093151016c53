"""Peak memory and time of one loss evaluation + backward at Qwen3's vocabulary (151,936) on CPU,
unchunked vs chunked (`loss.chunk_slots`, dflash_train/model/loss.py).

    .venv/bin/python benchmarks/loss_memory.py                  # 1,920 slots (128 anchors x 15), ~5 min
    .venv/bin/python benchmarks/loss_memory.py --anchors 512 --no-unchunked   # 7,680 slots, chunked only

The inputs are what the training step hands the loss: the drafter's and the target's hidden states
for every slot [1, A, 15, H] and a frozen LM head [V, H] (random values; the memory and time do not
depend on them). Each configuration runs in its own subprocess and its peak RSS is read with
os.wait4; a child that only builds the inputs gives the baseline, so "loss peak" = peak RSS -
baseline = what the loss and its backward add. The time is the wall time of loss + backward.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN3_VOCAB = 151_936


def child(args) -> None:
    import torch

    from dflash_train.training.config import LossConfig
    from dflash_train.model.loss import dflash_loss

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    K, H, V = args.block_size - 1, args.hidden, args.vocab
    head = torch.nn.utils.skip_init(torch.nn.Linear, H, V, bias=False).requires_grad_(False)
    torch.nn.init.normal_(head.weight, std=0.05, generator=g)  # in place: no second [V, H] copy
    h = torch.randn(1, args.anchors, K, H, generator=g).requires_grad_()
    th = torch.randn(1, args.anchors, K, H, generator=g)
    tokens = torch.randint(0, V, (1, args.anchors, K), generator=g)
    valid = torch.ones(1, args.anchors, K, dtype=torch.bool)
    if args.child < 0:  # the baseline: inputs only
        print(json.dumps({"seconds": 0.0}))
        return
    cfg = LossConfig(terms=json.loads(args.terms), position_weight=args.position_weight,
                     chunk_slots=args.child)
    t0 = time.perf_counter()
    loss, _ = dflash_loss(h, th, head, tokens, valid, cfg)
    loss.backward()
    print(json.dumps({"seconds": time.perf_counter() - t0, "loss": loss.item(),
                      "grad_sum": h.grad.abs().sum().item()}))


def run_child(args, chunk: int) -> dict:
    cmd = [sys.executable, __file__, "--child", str(chunk), "--anchors", str(args.anchors), "--block-size",
           str(args.block_size), "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--terms",
           args.terms, "--position-weight", args.position_weight, "--threads", str(args.threads)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err,
                                env={**os.environ, "PYTHONPATH": str(ROOT),
                                     "OMP_NUM_THREADS": str(args.threads)})
        _, status, usage = os.wait4(proc.pid, 0)  # rusage of this child alone (ru_maxrss in KiB on Linux)
        out.seek(0), err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"error: the child for chunk_slots={chunk} failed:\n{err.read()[-2000:]}")
        result = json.loads(out.read().strip().splitlines()[-1])
    return {**result, "peak_rss_mib": usage.ru_maxrss / 1024}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--anchors", type=int, default=128, help="blocks (anchors) in the batch")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512,
                   help="hidden size (only the head's matmul cost depends on it)")
    p.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    p.add_argument("--terms", default='{"ce": 0.1, "tv": 0.9}', help="loss.terms as JSON")
    p.add_argument("--position-weight", default="exp", choices=["exp", "dpace", "uniform"])
    p.add_argument("--chunks", type=int, nargs="+", default=[1024, 512, 240],
                   help="chunk_slots values to measure")
    p.add_argument("--no-unchunked", action="store_true",
                   help="skip chunk_slots=0 (needs ~7 x slots x V x 4 bytes)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        return child(args)

    slots = args.anchors * (args.block_size - 1)
    print(f"{slots} slots ({args.anchors} anchors x {args.block_size - 1}), V = {args.vocab}, "
          f"H = {args.hidden}, terms {args.terms}, {args.position_weight} weights, {args.threads} thread(s); "
          f"one fp32 [slots, V] tensor = {slots * args.vocab * 4 / 2**30:.2f} GiB")
    base = run_child(args, -1)["peak_rss_mib"]
    print(f"baseline (imports + inputs): peak RSS {base:.0f} MiB\n")
    print("| chunk_slots | loss + backward s | peak RSS MiB | loss peak MiB (over baseline) | loss |")
    print("|---:|---:|---:|---:|---:|")
    for chunk in ([] if args.no_unchunked else [0]) + args.chunks:
        r = run_child(args, chunk)
        print(f"| {chunk if chunk else '0 (unchunked)'} | {r['seconds']:.2f} | {r['peak_rss_mib']:.0f} | "
              f"{r['peak_rss_mib'] - base:.0f} | {r['loss']:.6f} |", flush=True)


if __name__ == "__main__":
    main()
