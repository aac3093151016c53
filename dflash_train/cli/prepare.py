"""`dflash-prepare`: chat data -> token ids with an assistant-only loss mask, ready for training.

    dflash-prepare --input data/tiny/train.jsonl --format messages --target data/tiny-target \
        --output data/prepared/tiny --val-size 200 --shuffle --seed 0 --min-supervised-tokens 8
    dflash-prepare --input HuggingFaceH4/ultrachat_200k --split train_sft --format ultrachat \
        --target Qwen/Qwen3-8B --output data/ultrachat-qwen3 --val-fraction 0.01 --shuffle
    # answers by the target (regenerate.py)
    dflash-prepare ... --regenerate --temperature 0 --max-new-tokens 2048
    dflash-train data.train=data/prepared/tiny/train data.val=data/prepared/tiny/val

The pipeline (steps, output, prepare_info.json): data/prepare.py; formats and the loss mask: data/chat.py.
Bad input stops with one `error:` line and exit code 2, and leaves no OUT behind.
"""

import argparse
import sys
from pathlib import Path

import torch

from dflash_train.cli import defaults_of, locked_main
from dflash_train.core.errors import OneLineArgumentParser
from dflash_train.core.seeds import SEED_LIMIT
from dflash_train.data.chat import FORMATS
from dflash_train.data.prepare import (MAX_BATCH_SIZE, MAX_LENGTH, MAX_NEW_TOKENS, MAX_TEMPERATURE,
                                       PrepareSettings, prepare)


def parse_args(argv) -> PrepareSettings:
    """The flags, checked -> the run's settings (one `error:` line and exit 2 on a bad flag)."""
    p = OneLineArgumentParser(prog="dflash-prepare", description=__doc__.splitlines()[0],
                              epilog="Then: dflash-train data.train=OUT/train data.val=OUT/val")
    p.add_argument("--input", required=True,
                   help="a .jsonl/.json/.parquet file, or a Hub dataset id (owner/name)")
    p.add_argument("--format", required=True, choices=list(FORMATS))
    p.add_argument("--split", help="Hub dataset split (default %(default)s)")
    p.add_argument("--config", help="Hub dataset config (subset) name")
    p.add_argument("--messages-field", help="the row's list of turns (default: per format)")
    p.add_argument("--role-field", help="a turn's speaker field (default: per format)")
    p.add_argument("--content-field", help="a turn's text field (default: per format)")
    p.add_argument("--role-map", action="append", metavar="NAME=ROLE",
                   help="map a speaker name to system/user/assistant (repeatable; human=user, gpt=assistant "
                        "are built in)")
    p.add_argument("--max-rows", type=int, help="read only the first N rows")
    p.add_argument("--strict", action="store_true",
                   help="a malformed row is an error (default: skipped, counted)")
    p.add_argument("--target", required=True,
                   help="target folder or Hub id (its tokenizer and chat template)")
    p.add_argument("--target-revision")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction,
                   help="passed to the chat template as enable_thinking (Qwen3); DFlash drafters are trained "
                        "with thinking off (default)")
    p.add_argument("--max-length", type=int,
                   help=f"tokens per conversation; longer ones are cut (default {MAX_LENGTH}, DFlash's, or "
                        "the target's max_position_embeddings when fewer)")
    p.add_argument("--min-supervised-tokens", type=int,
                   help="drop conversations with fewer assistant tokens after cutting "
                        "(default %(default)s = 2 x DFlash's block size 16, as DFlash drops them)")
    p.add_argument("--shuffle", action="store_true", help="shuffle rows (seeded); default: input order")
    p.add_argument("--seed", type=int, help="for shuffling, the val sample and sampling")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=float, help="hold out this fraction as OUT/val")
    val.add_argument("--val-size", type=int, help="hold out this many rows as OUT/val")
    p.add_argument("--append-to", metavar="PREPARED",
                   help="grow an earlier dflash-prepare output: OUT holds its rows, then this input's rows "
                        "that are not already in it, added to its train split; its val split stays as it was "
                        "(for a corpus that grew at its end; then dflash-cache --append)")
    p.add_argument("--output", required=True, help="output folder (OUT, or OUT/train + OUT/val with a split)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    add_regeneration_args(p)
    p.set_defaults(**defaults_of(PrepareSettings))  # stated once, in PrepareSettings
    args = p.parse_args(argv)
    check_args(p, args)
    return PrepareSettings(**vars(args))


def add_regeneration_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("regeneration (the target writes the assistant turns; see "
                             "dflash_train/data/regenerate.py)")
    g.add_argument("--regenerate", action="store_true",
                   help="replace every assistant turn by the target's answer")
    g.add_argument("--backend", choices=["transformers", "static", "vllm"],
                   help="static: continuous batching over a static KV cache on the CPU, --batch-size answers "
                        "at a time (Llama/Qwen3 targets; data/engine.py)")
    g.add_argument("--temperature", type=float,
                   help=f"0 = greedy (default); at most {MAX_TEMPERATURE:g} (hotter samples are noise, not "
                        "the target's text)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--max-new-tokens", type=int,
                   help=f"per assistant turn (default {MAX_NEW_TOKENS}, or the target's positions when "
                        "fewer)")
    g.add_argument("--keep-truncated", action="store_true",
                   help="keep answers cut by --max-new-tokens, supervised up to the cut with no end-of-turn "
                        "token; a cut answer ends its conversation (default: drop the conversation)")
    g.add_argument("--batch-size", type=int,
                   help=f"conversations per generate call (at most {MAX_BATCH_SIZE})")
    g.add_argument("--device",
                   help="auto, cpu, cuda, cuda:1, ... (transformers backend; the static one runs on the CPU)")
    g.add_argument("--target-dtype", choices=["auto", "bf16", "fp32"],
                   help="the target's weights while it answers: auto = bf16 on a GPU that has it, else fp32; "
                        "bf16 on a CPU with AVX-512 BF16 is ~2x faster")


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Bounds and combinations argparse cannot express: one `error:` line, exit 2."""
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        p.error("--val-fraction must be in (0, 1)")
    for name in ["val_size", "max_rows", "max_length", "max_new_tokens", "batch_size"]:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.batch_size > MAX_BATCH_SIZE:
        p.error(f"--batch-size must be at most {MAX_BATCH_SIZE} (conversations generated together), got "
                f"{args.batch_size}")
    if args.min_supervised_tokens < 0 or not 0 < args.top_p <= 1:
        p.error("--min-supervised-tokens must be >= 0, --top-p in (0, 1]")
    if not 0 <= args.temperature <= MAX_TEMPERATURE:  # refuses nan and inf too
        p.error(f"--temperature must be a number from 0 (greedy) to {MAX_TEMPERATURE:g}, got "
                f"{args.temperature}")
    if not 0 <= args.seed < SEED_LIMIT:
        p.error(f"--seed must be from 0 to 2**32 - 1, got {args.seed}")
    if args.append_to and (args.val_size or args.val_fraction or args.shuffle):
        p.error("--append-to keeps the earlier output's split: --val-size, --val-fraction and --shuffle do "
                "not apply")
    if args.append_to and Path(args.append_to).resolve() == Path(args.output).resolve():
        p.error("--append-to and --output are the same folder: write the grown data to a new --output")
    if args.backend == "vllm" and args.target_dtype != "auto":
        p.error("--target-dtype applies to the transformers and static backends (vLLM picks its own dtype)")
    if args.regenerate and args.backend != "vllm" and args.device != "auto":
        check_device(p, args.device, args.backend)


def check_device(p: argparse.ArgumentParser, text: str, backend: str) -> None:
    """--device is one this torch can run the target on: a CUDA device on a CPU build of torch was a
    traceback once the target had loaded, for either backend."""
    try:
        device = torch.device(text)
    except RuntimeError:
        p.error(f"--device '{text}' is not a device: use auto, cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device '{text}': use auto, cpu, cuda or cuda:N")
    if backend == "static" and device.type != "cpu":
        p.error(f"--device {text}: --backend static runs on the CPU; use --device cpu (or auto), or "
                "--backend transformers")
    if device.type == "cuda" and not torch.cuda.is_available():
        build = " (a CPU build)" if torch.version.cuda is None else ""
        p.error(f"--device {text}: this torch {torch.__version__}{build} sees no CUDA device; use --device "
                "cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        p.error(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")


main = locked_main(parse_args, prepare)


if __name__ == "__main__":
    sys.exit(main())
