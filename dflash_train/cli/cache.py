"""Offline hidden-state cache: the target's tapped states, computed once, read by training.

    dflash-cache --data data/tiny/train.jsonl --target data/tiny-target --output data/cache/tiny
    accelerate launch dflash_train/train.py data.hidden_state_cache=data/cache/tiny

The command line of `dflash-cache`; the cache itself (layout, resume, checks): data/hs_cache.py.
"""

import sys
from pathlib import Path

import torch

from dflash_train.cli import locked_main
from dflash_train.core.errors import Interrupted, OneLineArgumentParser, UserError
from dflash_train.core.outputs import require_free_output
from dflash_train.core.paths import model_source
from dflash_train.data.dataset import check_data_path, load_conversations
from dflash_train.data.hs_cache import DTYPES, build_cache, shards_done
from dflash_train.data.prepare import MAX_BATCH_SIZE
from dflash_train.model.target import (build_target_layer_ids, check_positions, check_tap_layers, load_target,
                                       max_positions, target_dtype)


def parse_args(argv):
    p = OneLineArgumentParser(prog="dflash-cache", description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="messages .jsonl or a dflash-prepare dataset folder")
    p.add_argument("--target", required=True)
    p.add_argument("--target-revision", default=None)
    p.add_argument("--output", required=True)
    p.add_argument("--overwrite", action="store_true", help="replace a cache made with other settings")
    p.add_argument("--append", action="store_true",
                   help="extend a complete cache of the first rows of --data (a corpus that grew at its end, "
                        "dflash-prepare --append-to): its full shards are kept")
    p.add_argument("--target-layer-ids", default=None,
                   help="comma-separated taps (z-lab ids); default: DFlash's rule")
    p.add_argument("--num-draft-layers", type=int, default=2,
                   help="for the default taps: one per drafter layer")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--target-dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="the target's weights while it computes the states (not how they are stored: "
                        "--dtype): auto = bf16 on a GPU that has it, else fp32; bf16 on a CPU with AVX-512 "
                        "BF16 is ~3x faster")
    p.add_argument("--max-length", type=int, default=256, help="as data.max_length in the recipe")
    p.add_argument("--shard-rows", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8,
                   help=f"rows per target forward (at most {MAX_BATCH_SIZE})")
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    if args.append and args.overwrite:
        p.error("--append keeps a cache's shards, --overwrite replaces them: pass one")
    for name in ["shard_rows", "batch_size", "max_length", "num_draft_layers"]:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.batch_size > MAX_BATCH_SIZE:
        p.error(f"--batch-size must be at most {MAX_BATCH_SIZE} (rows per target forward), got "
                f"{args.batch_size}")
    if args.device != "auto":
        try:
            device = torch.device(args.device)
        except RuntimeError:
            p.error(f"--device '{args.device}' is not a device: use auto, cpu, cuda or cuda:N")
        if device.type not in ("cpu", "cuda"):
            p.error(f"--device '{args.device}': use auto, cpu, cuda or cuda:N")
        if device.type == "cuda" and (not torch.cuda.is_available()
                                      or (device.index or 0) >= torch.cuda.device_count()):
            p.error(f"--device '{args.device}': this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if args.target_layer_ids is not None:
        try:
            args.target_layer_ids = [int(x) for x in args.target_layer_ids.split(",")]
        except ValueError:
            p.error(f"--target-layer-ids must be comma-separated integers, got '{args.target_layer_ids}'")
    return args


def run(args) -> None:
    out = Path(args.output)
    # A cache of ours is resumed, or kept when complete, without --overwrite (build_cache decides)
    require_free_output(out, args.overwrite, "cache", [("--data", args.data), ("--target", args.target)],
                        resumable=True)
    check_data_path(args.data)
    source = model_source(args.target, "target")
    check_positions(args.max_length, "--max-length", max_positions(source, args.target_revision), args.target)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    target = load_target(args.target, revision=args.target_revision, device=device,
                         dtype=target_dtype(args.target_dtype, device))
    layer_ids = args.target_layer_ids or build_target_layer_ids(target.num_layers, args.num_draft_layers)
    try:
        check_tap_layers(layer_ids, target.num_layers)
    except UserError as e:  # its words are the recipe's: name this command's flag instead
        flag = ("--target-layer-ids" if args.target_layer_ids
                else f"the taps for --num-draft-layers {args.num_draft_layers}")
        raise UserError(str(e).replace("model.target_layer_ids", flag)) from None
    ds = load_conversations(args.data, target.tokenizer, args.max_length)
    try:
        m = build_cache(target, ds, layer_ids, out, args.dtype, args.shard_rows, args.batch_size,
                        args.overwrite, args.append)
    except KeyboardInterrupt:
        m = None
    if m is None:  # outside the except block, so the progress bar has closed before our line
        raise Interrupted(f"interrupted with {shards_done(out)} of {-(-len(ds) // args.shard_rows)} shards "
                          "done; rerun the same command to resume")
    print(f"{len(m['shards'])} shard(s), {m.get('bytes_on_disk', 0):,} bytes for {m['tokens']:,} tokens "
          f"({m.get('bytes_on_disk', 0) / m['tokens']:.0f} bytes/token on disk) in {out}")


main = locked_main(parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
