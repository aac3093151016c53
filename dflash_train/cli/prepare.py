"""`dflash-prepare`: chat data -> token ids with an assistant-only loss mask, ready for training.

    dflash-prepare --input data/tiny/train.jsonl --format messages --target data/tiny-target \
        --output data/prepared/tiny --val-size 200 --shuffle --seed 0 --min-supervised-tokens 8
    dflash-prepare --input HuggingFaceH4/ultrachat_200k --split train_sft --format ultrachat \
        --target Qwen/Qwen3-8B --output data/ultrachat-qwen3 --val-fraction 0.01 --shuffle
    dflash-prepare ... --regenerate --temperature 0 --max-new-tokens 2048    # answers by the target (regenerate.py)
    dflash-train data.train=data/prepared/tiny/train data.val=data/prepared/tiny/val

Steps: read rows (local .jsonl/.json/.parquet, or a Hub dataset) -> normalise each row to OpenAI
messages -> optionally let the target rewrite the assistant turns -> render with the target's
chat template -> token ids and loss mask -> drop unusable rows (counted by reason) -> optional
shuffle and train/val split -> `Dataset.save_to_disk` folder(s) + `prepare_info.json`.

Output: OUT (no split) or OUT/train and OUT/val, with columns input_ids and loss_mask, one row
per conversation in input order (unless --shuffle); OUT/prepare_info.json records the input,
target, template hash, settings and counts; OUT/regenerated.jsonl the target's conversations.
Bad input stops with one `error:` line and exit code 2, and leaves no OUT behind.

Formats and the loss mask: data/chat.py.
"""

import argparse
import json
import shutil
import sys
from collections import Counter
from dataclasses import asdict
from itertools import islice
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from dflash_train.core.errors import Interrupted, OneLineArgumentParser, UserError, cli_guard
from dflash_train.core.outputs import marker_kind, output_lock, require_free_output, write_atomically
from dflash_train.core.paths import model_source, resolve_input
from dflash_train.core.progress import BAR_INTERVAL
from dflash_train.core.seeds import SEED_LIMIT
from dflash_train.data import regenerate as regen
from dflash_train.data.chat import (DROP_REASONS, FORMATS, INFO_FILE, ROLE_NAMES, Fields, append_rows,
                                    check_appendable, encode_conversations, end_of_turn, input_kind,
                                    read_conversations, read_prepared, read_rows, split_indices,
                                    template_sha256, to_dataset, tokenizer_sha256, weights_key)
from dflash_train.data.engine import static_generate
from dflash_train.model.target import (LOAD_ERRORS, check_positions, first_line, load_target, max_positions,
                                       resolve_pin, target_dtype)


MAX_TEMPERATURE = 2.0  # beyond it a target's samples are close to uniform noise
# Conversations generated together: a judgement, 256x the default, no memory estimate. The static
# engine allocates a KV cache of that many rows up front: 1e9 was a traceback after the target had
# loaded (80 TB asked for the tiny target), leaving a work folder behind.
MAX_BATCH_SIZE = 4096
# Defaults lowered to the target's positions when it has fewer (an explicit value past them is refused).
MAX_LENGTH = 3072  # tokens per conversation (DFlash's)
MAX_NEW_TOKENS = 2048  # tokens per regenerated answer


def parse_args(argv):
    p = OneLineArgumentParser(prog="dflash-prepare", description=__doc__.splitlines()[0],
                              epilog="Then: dflash-train data.train=OUT/train data.val=OUT/val")
    p.add_argument("--input", required=True,
                   help="a .jsonl/.json/.parquet file, or a Hub dataset id (owner/name)")
    p.add_argument("--format", required=True, choices=list(FORMATS))
    p.add_argument("--split", default="train", help="Hub dataset split (default train)")
    p.add_argument("--config", default=None, help="Hub dataset config (subset) name")
    p.add_argument("--messages-field", default=None, help="the row's list of turns (default: per format)")
    p.add_argument("--role-field", default=None, help="a turn's speaker field (default: per format)")
    p.add_argument("--content-field", default=None, help="a turn's text field (default: per format)")
    p.add_argument("--role-map", action="append", default=[], metavar="NAME=ROLE",
                   help="map a speaker name to system/user/assistant (repeatable; human=user, gpt=assistant "
                        "are built in)")
    p.add_argument("--max-rows", type=int, default=None, help="read only the first N rows")
    p.add_argument("--strict", action="store_true",
                   help="a malformed row is an error (default: skipped, counted)")
    p.add_argument("--target", required=True,
                   help="target folder or Hub id (its tokenizer and chat template)")
    p.add_argument("--target-revision", default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=False,
                   help="passed to the chat template as enable_thinking (Qwen3); DFlash drafters are trained "
                        "with thinking off (default)")
    p.add_argument("--max-length", type=int, default=None,
                   help=f"tokens per conversation; longer ones are cut (default {MAX_LENGTH}, DFlash's, or "
                        "the target's max_position_embeddings when fewer)")
    p.add_argument("--min-supervised-tokens", type=int, default=32,
                   help="drop conversations with fewer assistant tokens after cutting (default 32 = 2 x "
                        "DFlash's block size 16, as DFlash drops them)")
    p.add_argument("--shuffle", action="store_true", help="shuffle rows (seeded); default: input order")
    p.add_argument("--seed", type=int, default=0, help="for shuffling, the val sample and sampling")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=float, default=None, help="hold out this fraction as OUT/val")
    val.add_argument("--val-size", type=int, default=None, help="hold out this many rows as OUT/val")
    p.add_argument("--append-to", default=None, metavar="PREPARED",
                   help="grow an earlier dflash-prepare output: OUT holds its rows, then this input's rows "
                        "that are not already in it, added to its train split; its val split stays as it was "
                        "(for a corpus that grew at its end; then dflash-cache --append)")
    p.add_argument("--output", required=True, help="output folder (OUT, or OUT/train + OUT/val with a split)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    add_regeneration_args(p)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def add_regeneration_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("regeneration (the target writes the assistant turns; see "
                             "dflash_train/data/regenerate.py)")
    g.add_argument("--regenerate", action="store_true",
                   help="replace every assistant turn by the target's answer")
    g.add_argument("--backend", choices=["transformers", "static", "vllm"], default="transformers",
                   help="static: continuous batching over a static KV cache on the CPU, --batch-size answers "
                        "at a time (Llama/Qwen3 targets; data/engine.py)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help=f"0 = greedy (default); at most {MAX_TEMPERATURE:g} (hotter samples are noise, not "
                        "the target's text)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"per assistant turn (default {MAX_NEW_TOKENS}, or the target's positions when "
                        "fewer)")
    g.add_argument("--keep-truncated", action="store_true",
                   help="keep answers cut by --max-new-tokens, supervised up to the cut with no end-of-turn "
                        "token; a cut answer ends its conversation (default: drop the conversation)")
    g.add_argument("--batch-size", type=int, default=16,
                   help=f"conversations per generate call (at most {MAX_BATCH_SIZE})")
    g.add_argument("--device", default="auto",
                   help="auto, cpu, cuda, cuda:1, ... (transformers backend; the static one runs on the CPU)")
    g.add_argument("--target-dtype", choices=["auto", "bf16", "fp32"], default="auto",
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


def fit_positions(args) -> None:
    """--max-length and --max-new-tokens against the target's positions (read from its config alone):
    a value given past them is refused, a default is lowered to them."""
    limit = max_positions(args.target, args.target_revision, args.trust_remote_code)
    for name, default in [("max_length", MAX_LENGTH), ("max_new_tokens", MAX_NEW_TOKENS)]:
        if getattr(args, name) is None:
            setattr(args, name, min(default, limit or default))
        check_positions(getattr(args, name), f"--{name.replace('_', '-')}", limit, args.target)
    if args.min_supervised_tokens > args.max_length:
        raise UserError(f"--min-supervised-tokens {args.min_supervised_tokens} is more than --max-length "
                        f"{args.max_length}: every conversation would be dropped")


def fields_from(args) -> Fields:
    messages, role, content = FORMATS[args.format]
    roles = dict(ROLE_NAMES)
    for item in args.role_map:
        name, _, role_to = item.partition("=")
        if role_to not in ("system", "user", "assistant"):
            raise UserError(f"--role-map '{item}' must be NAME=system, NAME=user or NAME=assistant")
        roles[name] = role_to
    return Fields(args.messages_field or messages, args.role_field or role, args.content_field or content,
                  roles)


def load_tokenizer(args):
    try:
        return AutoTokenizer.from_pretrained(args.target, revision=args.target_revision,
                                             trust_remote_code=args.trust_remote_code)
    except LOAD_ERRORS as e:
        raise UserError(f"cannot load the tokenizer of target '{args.target}': {first_line(e)}") from None


def run_regeneration(args, tokenizer, conversations, eot: str, work: Path):
    """The target answers every turn (regenerate.py), resuming from the work folder `work`. Returns
    per conversation the new messages or a drop reason, and the settings and counts for prepare_info.json."""
    s = regen.Sampling(args.backend, args.temperature, args.top_p, args.max_new_tokens, args.seed,
                       args.batch_size, args.enable_thinking, args.keep_truncated)
    if args.backend == "vllm":
        stops = regen.stop_token_ids(tokenizer, eot)
        generate = regen.vllm_generate(args.target, args.target_revision, args.trust_remote_code, stops, s)
        dtype = "auto"  # vLLM's choice
    else:
        # auto: a GPU when there is one, but the static engine's is the CPU (it refuses any other)
        gpu = torch.cuda.is_available() and args.backend != "static"
        device = ("cuda" if gpu else "cpu") if args.device == "auto" else args.device
        torch_dtype = target_dtype(args.target_dtype, device)
        dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(torch_dtype, str(torch_dtype))
        target = load_target(args.target, revision=args.target_revision, device=device,
                             dtype=torch_dtype, trust_remote_code=args.trust_remote_code)
        stops = regen.stop_token_ids(tokenizer, eot, target.model.generation_config.eos_token_id)
        generate = (static_generate(target, stops, s, slots=args.batch_size) if args.backend == "static" else
                    regen.transformers_generate(target, stops, s))
    # The dtype the target computed in is part of the resume key: bf16 and fp32 answers are not mixed;
    # so are its weights by content: other weights under the same path do not resume these answers.
    record = asdict(s) | {"target": args.target, "target_revision": args.target_revision,
                          "target_weights": weights_key(weights_pin(args)), "target_dtype": dtype,
                          "template_sha256": template_sha256(tokenizer), "stop_token_ids": stops}
    try:
        results, stats = regen.regenerate(conversations, tokenizer, generate, s, work, record)
    except KeyboardInterrupt:
        results = None
    if results is None:  # outside the except block, so the progress bar has closed before our line
        raise Interrupted(f"interrupted with {regen.conversations_done(work)} of {len(conversations)} "
                          f"conversations regenerated (kept in '{work}'); rerun the same command to resume")
    return results, record | {"stats": stats}


@cli_guard
def main(argv=None):
    args = parse_args(argv)
    with output_lock(Path(args.output), "--output"):  # one dflash-train process per output
        run(args)


def run(args) -> None:
    out = Path(args.output)
    # --append-to is an input like the others: replacing an output that holds it deletes it
    inputs = [("--input", args.input), ("--target", args.target), ("--append-to", args.append_to)]
    require_free_output(out, args.overwrite, "prepare", inputs)
    work = regen.work_folder(out) if args.regenerate else None
    if work is not None:  # ours or absent, before anything is read, written or deleted
        regen.check_work_folder(work, inputs)
    args.input, args.target = resolve_input(args.input), model_source(args.target, "target")
    fit_positions(args)
    if args.regenerate and args.backend == "vllm":
        regen.import_vllm()  # fail before reading anything
    elif args.backend == "vllm":
        raise UserError("--backend applies to --regenerate only")
    fields = fields_from(args)
    tokenizer = load_tokenizer(args)
    eot = end_of_turn(tokenizer)
    info = prepare_info(args, fields, tokenizer, eot)
    old = None
    if args.append_to:  # checked before the input is read
        old_info, old = read_prepared(Path(args.append_to))
        check_appendable(old_info, info, Path(args.append_to))

    conversations, counts, dropped, info["regeneration"] = read_and_regenerate(args, fields, tokenizer, eot,
                                                                               work)
    kept, truncated = encode_and_filter(args, tokenizer, conversations, eot, dropped)
    summary = (f"{counts.read} rows read from {args.input}, {counts.malformed} malformed; kept {len(kept)}, "
               f"dropped {sum(dropped.values())}" + "".join(f", {k} {v}" for k, v in dropped.items() if v))
    if not kept:
        raise UserError(f"no usable conversation: {summary}"
                        + (f" (first malformed: {counts.examples[0]})" if counts.examples else ""))
    splits, already = split_rows(args, kept, old)
    rows = [r for part in splits.values() for r in part]
    info |= {"counts": {"read": counts.read, "malformed": counts.malformed, "kept": len(kept),
                        "dropped": dict(dropped), "truncated_to_max_length": truncated},
             "malformed_examples": counts.examples,
             "splits": {name: len(part) for name, part in splits.items()},
             "tokens": {"total": sum(len(r[0]) for r in rows), "supervised": sum(sum(r[1]) for r in rows)}}
    if old is not None:
        summary += f"; {already} already in --append-to, {len(kept) - already} appended"
        info["appended_to"] = {"path": str(Path(args.append_to).resolve()),
                               "splits": {name: len(part) for name, part in old.items()},
                               "already_there": already}
    write_atomically(out, lambda tmp: write_prepared(tmp, splits, info,
                                                     conversations if args.regenerate else None),
                     "prepare")
    if work is not None and marker_kind(work) == "regenerate":
        shutil.rmtree(work, ignore_errors=True)  # ours, finished: nothing left to resume
    print(summary)
    print(f"wrote {' / '.join(f'{k} {v}' for k, v in info['splits'].items())}, {info['tokens']['total']:,} "
          f"tokens ({info['tokens']['supervised']:,} supervised) to {out}")


def weights_pin(args) -> dict | None:
    """The target's weights by content (resolve_pin: a local folder's safetensors SHA-256, a Hub cache
    commit, an explicit revision), so --append-to can tell other weights under the same name; None
    where they cannot be pinned (a folder without safetensors, a Hub id not in the local cache)."""
    try:
        return resolve_pin(args.target, args.target_revision)
    except UserError:
        return None


def prepare_info(args, fields: Fields, tokenizer, eot: str) -> dict:
    """prepare_info.json's settings (its counts, splits and tokens are added once known). The target's
    weights, tokenizer and template are what --append-to checks before mixing two runs' rows."""
    return {"input": args.input, "split": args.split if input_kind(args.input) == "hub" else None,
            "config": args.config, "format": args.format, "fields": asdict(fields),
            "target": {"name_or_path": args.target, "revision": args.target_revision,
                       "weights": weights_pin(args)},
            "tokenizer": {"sha256": tokenizer_sha256(tokenizer)},
            "template": {"sha256": template_sha256(tokenizer), "end_of_turn": eot},
            "enable_thinking": args.enable_thinking, "max_length": args.max_length,
            "min_supervised_tokens": args.min_supervised_tokens, "shuffle": args.shuffle, "seed": args.seed}


def read_and_regenerate(args, fields: Fields, tokenizer, eot: str, work: Path | None):
    """Rows -> OpenAI messages (and the target's answers with --regenerate).
    -> conversations, read counts, drop counts, the regeneration record (None without it)."""
    rows = read_rows(args.input, input_kind(args.input), args.split, args.config)
    conversations, counts = read_conversations(islice(rows, args.max_rows), args.format, fields, args.strict,
                                               args.input)
    dropped = Counter(dict.fromkeys(DROP_REASONS, 0))
    regeneration = None
    if args.regenerate:
        results, regeneration = run_regeneration(args, tokenizer, conversations, eot, work)
        dropped.update(r for r in results if isinstance(r, str))
        conversations = [r for r in results if not isinstance(r, str)]
    return conversations, counts, dropped, regeneration


def encode_and_filter(args, tokenizer, conversations, eot: str, dropped: Counter) -> tuple[list, int]:
    """Token ids and loss masks of the usable conversations (drops counted into `dropped`).
    -> kept (ids, mask) rows, how many were cut to --max-length."""
    kept, truncated = [], 0
    encoded = encode_conversations(tokenizer, conversations, eot, args.max_length, args.enable_thinking)
    for r in tqdm(encoded, total=len(conversations), desc="tokenize", unit="conv", mininterval=BAR_INTERVAL):
        if isinstance(r, str):
            dropped[r] += 1
        elif sum(r[1]) < args.min_supervised_tokens:
            dropped["too_few_supervised_tokens"] += 1
        else:
            kept.append(r)
            truncated += len(r[0]) == args.max_length
    return kept, truncated


def split_rows(args, kept: list, old: dict | None) -> tuple[dict[str, list], int]:
    """-> ({train, val} or {all}: rows, rows of `kept` already in `old`). Grown onto `old` with
    --append-to, else a train/val split when asked."""
    if old is not None:
        return append_rows(old, kept)
    n = len(kept)
    val_size = args.val_size or (max(1, round(args.val_fraction * n)) if args.val_fraction else 0)
    if val_size >= n:
        raise UserError(f"a validation split of {val_size} rows leaves no training rows ({n} kept)")
    train_idx, val_idx = split_indices(n, args.shuffle, args.seed, val_size)
    if not val_size:
        return {"all": [kept[i] for i in train_idx]}, 0
    return {"train": [kept[i] for i in train_idx], "val": [kept[i] for i in val_idx]}, 0


def write_prepared(tmp: Path, splits: dict[str, list], info: dict, conversations: list | None) -> None:
    """The dataset folder(s) (OUT, or OUT/train + OUT/val), prepare_info.json, and the target's
    conversations (regenerated.jsonl) when it wrote them."""
    for name, rows in splits.items():
        to_dataset(rows).save_to_disk(str(tmp if name == "all" else tmp / name))
    if conversations is not None:
        with open(tmp / "regenerated.jsonl", "w") as f:
            for messages in conversations:
                f.write(json.dumps({"messages": messages}) + "\n")
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
