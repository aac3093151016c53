"""The prepare pipeline (`dflash-prepare`, cli/prepare.py): chat data -> token ids with an assistant-only
loss mask, ready for training. As a library: `prepare(PrepareSettings(input=..., format=..., target=...,
output=...))`; the caller holds the output's lock (output_lock; the command line does).

Steps: read rows (local .jsonl/.json/.parquet, or a Hub dataset) -> normalise each row to OpenAI
messages -> optionally let the target rewrite the assistant turns -> render with the target's
chat template -> token ids and loss mask -> drop unusable rows (counted by reason) -> optional
shuffle and train/val split -> `Dataset.save_to_disk` folder(s) + `prepare_info.json`.

Output: OUT (no split) or OUT/train and OUT/val, with columns input_ids and loss_mask, one row
per conversation in input order (unless shuffle); OUT/prepare_info.json records the input,
target, template hash, settings and counts; OUT/regenerated.jsonl the target's conversations.
Bad input stops with one UserError line, and leaves no OUT behind. The messages name the command's
flags (--max-length, --role-map): the settings below are those flags.

Formats and the loss mask: data/chat.py; the target's answers: data/regenerate.py.
"""

import json
import shutil
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from itertools import islice
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from dflash_train.core.errors import Interrupted, UserError
from dflash_train.core.outputs import marker_kind, require_free_output, write_atomically
from dflash_train.core.paths import model_source, resolve_input
from dflash_train.core.progress import BAR_INTERVAL
from dflash_train.data import regenerate as regen
from dflash_train.data.chat import (DROP_REASONS, FORMATS, INFO_FILE, ROLE_NAMES, Fields, append_rows,
                                    check_appendable, encode_conversations, end_of_turn, input_kind,
                                    read_conversations, read_prepared, read_rows, split_indices,
                                    template_sha256, to_dataset, tokenizer_sha256, weights_key)
from dflash_train.data.dataset import stop_token_ids
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


@dataclass
class PrepareSettings:
    """One dflash-prepare run; each field is the flag of the same name (cli/prepare.py checks their
    bounds and combinations)."""
    input: str  # a .jsonl/.json/.parquet file, or a Hub dataset id (owner/name)
    format: str  # a key of chat.FORMATS
    target: str  # target folder or Hub id: its tokenizer, chat template (and answers with regenerate)
    output: str  # OUT, or OUT/train + OUT/val with a split
    split: str = "train"  # Hub dataset split
    config: str | None = None  # Hub dataset config (subset)
    messages_field: str | None = None  # the row's list of turns; None: the format's
    role_field: str | None = None  # a turn's speaker field; None: the format's
    content_field: str | None = None  # a turn's text field; None: the format's
    role_map: list[str] = field(default_factory=list)  # "NAME=ROLE" items, added to chat.ROLE_NAMES
    max_rows: int | None = None  # read only the first N rows
    strict: bool = False  # a malformed row is an error (else skipped, counted)
    target_revision: str | None = None
    trust_remote_code: bool = False
    enable_thinking: bool = False  # passed to the chat template (Qwen3); DFlash drafters train with it off
    max_length: int | None = None  # tokens per conversation, longer cut; None: MAX_LENGTH or the target's
    min_supervised_tokens: int = 32  # fewer assistant tokens after cutting: dropped (2 x DFlash's block 16)
    shuffle: bool = False  # shuffle rows (seeded); else input order
    seed: int = 0  # for shuffling, the val sample and sampling
    val_fraction: float | None = None  # hold out this fraction as OUT/val (or val_size rows; not both)
    val_size: int | None = None
    append_to: str | None = None  # an earlier output to grow: its rows, then this input's new ones (train)
    overwrite: bool = False  # replace an output of ours of the same kind
    regenerate: bool = False  # the target answers every assistant turn (regenerate.py)
    backend: str = "transformers"  # transformers, static (engine.py, CPU) or vllm
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int | None = None  # per answer; None: MAX_NEW_TOKENS or the target's positions
    keep_truncated: bool = False  # keep answers cut by max_new_tokens (else drop the conversation)
    batch_size: int = 16  # conversations per generate call (part of the resume key)
    device: str = "auto"  # auto, cpu, cuda, cuda:N (transformers backend; static runs on the CPU)
    target_dtype: str = "auto"  # auto (bf16 on a GPU that has it, else fp32), bf16 or fp32


def prepare(settings: PrepareSettings) -> None:
    """Read, (regenerate,) encode, filter, split and write one prepared dataset folder; print what it
    kept and wrote. Every input is checked before anything is written or deleted."""
    s = settings
    out = Path(s.output)
    # --append-to is an input like the others: replacing an output that holds it deletes it
    inputs = [("--input", s.input), ("--target", s.target), ("--append-to", s.append_to)]
    require_free_output(out, s.overwrite, "prepare", inputs)
    work = regen.work_folder(out) if s.regenerate else None
    if work is not None:  # ours or absent, before anything is read, written or deleted
        regen.check_work_folder(work, inputs)
    s = fit_positions(replace(s, input=resolve_input(s.input), target=model_source(s.target, "target")))
    if s.regenerate and s.backend == "vllm":
        regen.import_vllm()  # fail before reading anything
    elif s.backend == "vllm":
        raise UserError("--backend applies to --regenerate only")
    fields = fields_from(s)
    tokenizer = load_tokenizer(s)
    eot = end_of_turn(tokenizer)
    info = prepare_info(s, fields, tokenizer, eot)
    old = None
    if s.append_to:  # checked before the input is read
        old_info, old = read_prepared(Path(s.append_to))
        check_appendable(old_info, info, Path(s.append_to))

    conversations, counts, dropped, info["regeneration"] = read_and_regenerate(
        s, fields, tokenizer, eot, work)
    kept, truncated = encode_and_filter(s, tokenizer, conversations, eot, dropped)
    summary = (f"{counts.read} rows read from {s.input}, {counts.malformed} malformed; kept {len(kept)}, "
               f"dropped {sum(dropped.values())}" + "".join(f", {k} {v}" for k, v in dropped.items() if v))
    if not kept:
        raise UserError(f"no usable conversation: {summary}"
                        + (f" (first malformed: {counts.examples[0]})" if counts.examples else ""))
    splits, already = split_rows(s, kept, old)
    rows = [r for part in splits.values() for r in part]
    info |= {"counts": {"read": counts.read, "malformed": counts.malformed, "kept": len(kept),
                        "dropped": dict(dropped), "truncated_to_max_length": truncated},
             "malformed_examples": counts.examples,
             "splits": {name: len(part) for name, part in splits.items()},
             "tokens": {"total": sum(len(r[0]) for r in rows), "supervised": sum(sum(r[1]) for r in rows)}}
    if old is not None:
        summary += f"; {already} already in --append-to, {len(kept) - already} appended"
        info["appended_to"] = {"path": str(Path(s.append_to).resolve()),
                               "splits": {name: len(part) for name, part in old.items()},
                               "already_there": already}
    write_atomically(out, lambda tmp: write_prepared(tmp, splits, info,
                                                     conversations if s.regenerate else None),
                     "prepare")
    if work is not None and marker_kind(work) == "regenerate":
        shutil.rmtree(work, ignore_errors=True)  # ours, finished: nothing left to resume
    print(summary)
    print(f"wrote {' / '.join(f'{k} {v}' for k, v in info['splits'].items())}, {info['tokens']['total']:,} "
          f"tokens ({info['tokens']['supervised']:,} supervised) to {out}")


def fit_positions(s: PrepareSettings) -> PrepareSettings:
    """max_length and max_new_tokens against the target's positions (read from its config alone):
    a value given past them is refused, a default (None) is lowered to them. -> the settings with both set."""
    limit = max_positions(s.target, s.target_revision, s.trust_remote_code)
    fitted = {}
    for name, default in [("max_length", MAX_LENGTH), ("max_new_tokens", MAX_NEW_TOKENS)]:
        value = getattr(s, name)
        fitted[name] = min(default, limit or default) if value is None else value
        check_positions(fitted[name], f"--{name.replace('_', '-')}", limit, s.target)
    if s.min_supervised_tokens > fitted["max_length"]:
        raise UserError(f"--min-supervised-tokens {s.min_supervised_tokens} is more than --max-length "
                        f"{fitted['max_length']}: every conversation would be dropped")
    return replace(s, **fitted)


def fields_from(s: PrepareSettings) -> Fields:
    messages, role, content = FORMATS[s.format]
    roles = dict(ROLE_NAMES)
    for item in s.role_map:
        name, _, role_to = item.partition("=")
        if role_to not in ("system", "user", "assistant"):
            raise UserError(f"--role-map '{item}' must be NAME=system, NAME=user or NAME=assistant")
        roles[name] = role_to
    return Fields(s.messages_field or messages, s.role_field or role, s.content_field or content, roles)


def load_tokenizer(s: PrepareSettings):
    try:
        return AutoTokenizer.from_pretrained(s.target, revision=s.target_revision,
                                             trust_remote_code=s.trust_remote_code)
    except LOAD_ERRORS as e:
        raise UserError(f"cannot load the tokenizer of target '{s.target}': {first_line(e)}") from None


def run_regeneration(s: PrepareSettings, tokenizer, conversations, eot: str, work: Path):
    """The target answers every turn (regenerate.py), resuming from the work folder `work`. Returns
    per conversation the new messages or a drop reason, and the settings and counts for prepare_info.json."""
    sampling = regen.Sampling(s.backend, s.temperature, s.top_p, s.max_new_tokens, s.seed, s.batch_size,
                              s.enable_thinking, s.keep_truncated)
    if s.backend == "vllm":
        stops = sorted(stop_token_ids(None, tokenizer, eot))  # the model runs in vLLM
        generate = regen.vllm_generate(s.target, s.target_revision, s.trust_remote_code, stops, sampling)
        dtype = "auto"  # vLLM's choice
    else:
        # auto: a GPU when there is one, but the static engine's is the CPU (it refuses any other)
        gpu = torch.cuda.is_available() and s.backend != "static"
        device = ("cuda" if gpu else "cpu") if s.device == "auto" else s.device
        torch_dtype = target_dtype(s.target_dtype, device)
        dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(torch_dtype, str(torch_dtype))
        target = load_target(s.target, revision=s.target_revision, device=device,
                             dtype=torch_dtype, trust_remote_code=s.trust_remote_code)
        stops = sorted(stop_token_ids(target.model, tokenizer, eot))
        generate = (static_generate(target, stops, sampling, slots=s.batch_size) if s.backend == "static" else
                    regen.transformers_generate(target, stops, sampling))
    # The dtype the target computed in is part of the resume key: bf16 and fp32 answers are not mixed;
    # so are its weights by content: other weights under the same path do not resume these answers.
    record = asdict(sampling) | {"target": s.target, "target_revision": s.target_revision,
                                 "target_weights": weights_key(weights_pin(s)), "target_dtype": dtype,
                                 "template_sha256": template_sha256(tokenizer), "stop_token_ids": stops}
    try:
        results, stats = regen.regenerate(conversations, tokenizer, generate, sampling, work, record)
    except KeyboardInterrupt:
        results = None
    if results is None:  # outside the except block, so the progress bar has closed before our line
        raise Interrupted(f"interrupted with {regen.conversations_done(work)} of {len(conversations)} "
                          f"conversations regenerated (kept in '{work}'); rerun the same command to resume")
    return results, record | {"stats": stats}


def weights_pin(s: PrepareSettings) -> dict | None:
    """The target's weights by content (resolve_pin: a local folder's safetensors SHA-256, a Hub cache
    commit, an explicit revision), so --append-to can tell other weights under the same name; None
    where they cannot be pinned (a folder without safetensors, a Hub id not in the local cache)."""
    try:
        return resolve_pin(s.target, s.target_revision)
    except UserError:
        return None


def prepare_info(s: PrepareSettings, fields: Fields, tokenizer, eot: str) -> dict:
    """prepare_info.json's settings (its counts, splits and tokens are added once known). The target's
    weights, tokenizer and template are what --append-to checks before mixing two runs' rows."""
    return {"input": s.input, "split": s.split if input_kind(s.input) == "hub" else None,
            "config": s.config, "format": s.format, "fields": asdict(fields),
            "target": {"name_or_path": s.target, "revision": s.target_revision, "weights": weights_pin(s)},
            "tokenizer": {"sha256": tokenizer_sha256(tokenizer)},
            "template": {"sha256": template_sha256(tokenizer), "end_of_turn": eot},
            "enable_thinking": s.enable_thinking, "max_length": s.max_length,
            "min_supervised_tokens": s.min_supervised_tokens, "shuffle": s.shuffle, "seed": s.seed}


def read_and_regenerate(s: PrepareSettings, fields: Fields, tokenizer, eot: str, work: Path | None):
    """Rows -> OpenAI messages (and the target's answers with regenerate).
    -> conversations, read counts, drop counts, the regeneration record (None without it)."""
    rows = read_rows(s.input, input_kind(s.input), s.split, s.config)
    conversations, counts = read_conversations(islice(rows, s.max_rows), s.format, fields, s.strict, s.input)
    dropped = Counter(dict.fromkeys(DROP_REASONS, 0))
    regeneration = None
    if s.regenerate:
        results, regeneration = run_regeneration(s, tokenizer, conversations, eot, work)
        dropped.update(r for r in results if isinstance(r, str))
        conversations = [r for r in results if not isinstance(r, str)]
    return conversations, counts, dropped, regeneration


def encode_and_filter(s: PrepareSettings, tokenizer, conversations, eot: str,
                      dropped: Counter) -> tuple[list, int]:
    """Token ids and loss masks of the usable conversations (drops counted into `dropped`).
    -> kept (ids, mask) rows, how many were cut to max_length."""
    kept, truncated = [], 0
    encoded = encode_conversations(tokenizer, conversations, eot, s.max_length, s.enable_thinking)
    for r in tqdm(encoded, total=len(conversations), desc="tokenize", unit="conv", mininterval=BAR_INTERVAL):
        if isinstance(r, str):
            dropped[r] += 1
        elif sum(r[1]) < s.min_supervised_tokens:
            dropped["too_few_supervised_tokens"] += 1
        else:
            kept.append(r)
            truncated += len(r[0]) == s.max_length
    return kept, truncated


def split_rows(s: PrepareSettings, kept: list, old: dict | None) -> tuple[dict[str, list], int]:
    """-> ({train, val} or {all}: rows, rows of `kept` already in `old`). Grown onto `old` with
    append_to, else a train/val split when asked."""
    if old is not None:
        return append_rows(old, kept)
    n = len(kept)
    val_size = s.val_size or (max(1, round(s.val_fraction * n)) if s.val_fraction else 0)
    if val_size >= n:
        raise UserError(f"a validation split of {val_size} rows leaves no training rows ({n} kept)")
    train_idx, val_idx = split_indices(n, s.shuffle, s.seed, val_size)
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
