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

Formats (all normalised to [{"role": system|user|assistant, "content": str}, ...]):
  messages   `messages`: [{role, content}] (OpenAI)
  sharegpt   `conversations`: [{from, value}], from in human/gpt/system (user/assistant too)
  ultrachat  `messages`: [{role, content}] (ultrachat_200k), or `data`: [user, assistant, ...] strings
  nemotron   `messages`: [{role, content}] (Nemotron-Post-Training-Dataset v1/v2), or the older
             Llama-Nemotron layout: `input` (a list of {role, content}, or one user string) +
             `output` (the answer) + optional `system_prompt`. Other columns (reasoning, category,
             tool_calls) are ignored; rows with roles such as `tool` are malformed unless mapped.
--messages-field/--role-field/--content-field and --role-map NAME=ROLE override the names.

Loss mask: the conversation is rendered once as text. Each message's content is located in that
text in order, each search starting where the previous message ended (also tried trimmed; an
assistant reply also without its <think> block, as Qwen3 renders history). A reply must be
directly followed by the template's end-of-turn token (found by rendering a probe reply, e.g.
`<|im_end|>`, `<|eot_id|>`). The text is tokenized with offsets, and a token is supervised when
its characters lie inside [reply start, end-of-turn token end]; so the supervised tokens of a
turn decode to exactly its reply plus the end-of-turn token, whatever the template puts around
it (role headers, an empty `<think>\\n\\n</think>` block). Rows where a turn cannot be located
(the template rewrites it), or a token crosses the edge of a reply, are dropped and counted.
A reply cut by --max-new-tokens (--regenerate --keep-truncated) ends the conversation and is
supervised up to the cut, with no end-of-turn token after it.

Output: OUT (no split) or OUT/train and OUT/val, with columns input_ids and loss_mask, one row
per conversation in input order (unless --shuffle); OUT/prepare_info.json records the input,
target, template hash, settings and counts; OUT/regenerated.jsonl the target's conversations.
Bad input stops with one `error:` line and exit code 2, and leaves no OUT behind.
"""

import argparse
import hashlib
import json
import random
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path

import torch
from datasets import Dataset, Features, List, Value, load_dataset
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from dflash_train import regenerate as regen
from dflash_train.errors import OneLineArgumentParser, UserError, cli_guard
from dflash_train.outputs import model_source, require_free_output, resolve_input, write_atomically
from dflash_train.progress import BAR_INTERVAL
from dflash_train.target import LOAD_ERRORS, first_line, load_target, target_dtype

FORMATS = {  # format -> (messages field, role field, content field)
    "messages": ("messages", "role", "content"),
    "sharegpt": ("conversations", "from", "value"),
    "ultrachat": ("messages", "role", "content"),
    "nemotron": ("messages", "role", "content"),
}
ROLE_NAMES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}
# Why a conversation is dropped, in pipeline order (all appear in prepare_info.json, zeros too).
DROP_REASONS = ("no_user_turn", "empty_generation", "hit_max_new_tokens",  # regeneration only
                "no_assistant_turn", "template_error", "turn_not_located", "token_crosses_turn_edge",
                "too_few_supervised_tokens")
PROBE = "dflash-prepare probe reply"  # a reply no template rewrites
INFO_FILE = "prepare_info.json"
FEATURES = Features({"input_ids": List(Value("int32")), "loss_mask": List(Value("int8"))})


# --- rows -> OpenAI messages ---------------------------------------------------------------------

@dataclass(frozen=True)
class Fields:
    messages: str  # the row's list of turns
    role: str  # a turn's speaker
    content: str  # a turn's text
    roles: dict  # speaker name in the data -> system / user / assistant


class Malformed(ValueError):
    """A row that does not fit the format (skipped and counted, or an error with --strict)."""


def _text(value, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)  # OpenAI content parts, text only
    raise Malformed(f"{what} is {type(value).__name__}, not text")


def _message(turn, fields: Fields, n: int) -> dict:
    if not isinstance(turn, dict):
        raise Malformed(f"turn {n} is {type(turn).__name__}, not an object")
    name = turn.get(fields.role)
    if not isinstance(name, str) or name not in fields.roles:
        raise Malformed(f"turn {n} has role {name!r} (known: {', '.join(sorted(fields.roles))}; see --role-map)")
    message = {"role": fields.roles[name], "content": _text(turn.get(fields.content), f"turn {n} '{fields.content}'")}
    if message["role"] == "assistant" and turn.get("truncated") is True:
        message["truncated"] = True  # cut by --max-new-tokens (regenerated.jsonl): see encode_conversations
    return message


def normalize(row: dict, fmt: str, fields: Fields) -> list[dict]:
    """One row of the dataset -> [{"role", "content"}, ...]; raises Malformed."""
    turns = row.get(fields.messages)
    if fmt == "ultrachat" and turns is None and isinstance(row.get("data"), list):
        # The original UltraChat layout: alternating user / assistant strings.
        return [{"role": ("user", "assistant")[i % 2], "content": _text(t, f"data[{i}]")}
                for i, t in enumerate(row["data"])]
    if fmt == "nemotron" and turns is None and "input" in row:
        prompt = row["input"]
        messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else
                    [_message(t, fields, i) for i, t in enumerate(prompt)] if isinstance(prompt, list) else None)
        if messages is None:
            raise Malformed(f"'input' is {type(prompt).__name__}, not a list of turns or a string")
        system = row.get("system_prompt")
        if system:
            messages.insert(0, {"role": "system", "content": _text(system, "'system_prompt'")})
        if row.get("output"):
            messages.append({"role": "assistant", "content": _text(row["output"], "'output'")})
        return messages
    if not isinstance(turns, list):
        raise Malformed(f"no '{fields.messages}' list (fields: {', '.join(sorted(row))})")
    return [_message(t, fields, i) for i, t in enumerate(turns)]


# --- reading -------------------------------------------------------------------------------------

def input_kind(source: str) -> str:
    """'json', 'parquet' or 'hub'; raises for a missing or empty local file."""
    path = Path(source)
    if path.is_dir():
        raise UserError(f"input '{source}' is a folder: give a .jsonl, .json or .parquet file or a Hub dataset id")
    if path.is_file():
        if path.stat().st_size == 0:
            raise UserError(f"input file '{source}' is empty")
        return "parquet" if path.suffix == ".parquet" else "json"
    if path.suffix in (".jsonl", ".json", ".parquet") or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise UserError(f"input file '{source}' not found")
    return "hub"


def _json_rows(path: Path) -> Iterator[tuple[int, object]]:
    """A JSON array (rows numbered from 1), else JSON lines (numbered by line); a line that is not
    JSON comes as a Malformed."""
    with open(path, "rb") as f:
        head = f.read(8192)
    if b"\x00" in head:
        raise UserError(f"input file '{path}' is binary, not JSON")
    try:
        with open(path, encoding="utf-8") as f:
            first = head.decode("utf-8", errors="ignore").lstrip()[:1]
            if not first:
                raise UserError(f"input file '{path}' is empty")
            if first == "[":
                try:
                    rows = json.load(f)
                except json.JSONDecodeError as e:
                    raise UserError(f"input file '{path}' is not valid JSON: {e}") from None
                yield from enumerate(rows, 1)
                return
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as e:
                    yield n, Malformed(f"not JSON ({e})")
    except UnicodeDecodeError:
        raise UserError(f"input file '{path}' is not UTF-8 text (a binary file?)") from None


def read_rows(source: str, kind: str, split: str, config: str | None) -> Iterator[tuple[int, object]]:
    """(row number from 1, row) for a local file or a Hub dataset."""
    if kind == "json":
        yield from _json_rows(Path(source))
        return
    try:
        if kind == "parquet":
            ds = load_dataset("parquet", data_files=source, split="train")
        else:
            ds = load_dataset(source, name=config, split=split)
    except Exception as e:  # datasets raises many types (offline, missing, bad file)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = f"input file '{source}' is not readable parquet" if kind == "parquet" else \
            f"cannot load dataset '{source}' (split '{split}') from the Hub"
        raise UserError(f"{where}: {first}") from None
    yield from enumerate(ds, 1)


@dataclass
class ReadCounts:
    read: int = 0  # rows read
    malformed: int = 0  # rows that do not fit the format (not JSON, missing fields, unknown roles)
    not_json: int = 0  # of which: not JSON at all
    examples: list[str] = field(default_factory=list)  # the first few "row N: why"


def read_conversations(rows: Iterator[tuple[int, object]], fmt: str, fields: Fields, strict: bool,
                       source: str) -> tuple[list[list[dict]], ReadCounts]:
    conversations, counts = [], ReadCounts()
    for n, row in rows:
        counts.read += 1
        try:
            if isinstance(row, Malformed):
                counts.not_json += 1
                raise row
            if not isinstance(row, dict):
                raise Malformed(f"{type(row).__name__}, not an object")
            conversations.append(normalize(row, fmt, fields))
        except Malformed as e:
            if strict:
                raise UserError(f"row {n} of '{source}' is malformed: {e}") from None
            counts.malformed += 1
            if len(counts.examples) < 5:
                counts.examples.append(f"row {n}: {e}")
    if counts.read == 0:
        raise UserError(f"input '{source}' has no rows")
    if counts.not_json == counts.read:
        raise UserError(f"input file '{source}' is not JSON lines ({counts.examples[0]})")
    return conversations, counts


# --- messages -> token ids + loss mask -----------------------------------------------------------

def template_sha256(tokenizer) -> str:
    template = tokenizer.chat_template
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def chat_text(tokenizer, messages: list[dict], enable_thinking: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                         enable_thinking=enable_thinking)


def end_of_turn(tokenizer) -> str:
    """The special token the chat template writes right after an assistant reply."""
    if tokenizer.chat_template is None:
        raise UserError(f"the target's tokenizer ('{tokenizer.name_or_path}') has no chat template")
    try:
        text = chat_text(tokenizer, [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": PROBE}],
                         enable_thinking=False)
    except Exception as e:  # a template may raise anything (jinja errors, raise_exception)
        raise UserError(f"the target's chat template fails on a user/assistant exchange: "
                        f"{type(e).__name__}: {e}") from None
    after = text[text.rfind(PROBE) + len(PROBE):] if PROBE in text else ""
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    found = sorted((t for t in specials if after.startswith(t)), key=len)
    if not found:
        raise UserError(f"cannot find the end-of-turn token of the target's chat template: an assistant "
                        f"reply is followed by {after[:20]!r}, not by a special token")
    return found[-1]


def _first_match(text: str, candidates: list[str], start: int, suffix: str) -> tuple[int, int] | None:
    """Earliest (begin, end) at or after `start` of a non-empty candidate directly followed by `suffix`."""
    best = None
    for c in dict.fromkeys(candidates):
        i = text.find(c + suffix, start) if c else -1
        if i >= 0 and (best is None or i < best[0]):
            best = (i, i + len(c))
    return best


def assistant_spans(text: str, messages: list[dict], eot: str) -> list[tuple[int, int]] | None:
    """Character spans [reply start, end-of-turn end) of the assistant turns in the rendered
    `text`, or None when a turn cannot be located (an assistant reply must be directly followed
    by `eot`). Every turn is located, in order, each search starting where the previous turn
    ended, so a reply is never matched inside an earlier turn."""
    spans, pos = [], 0
    for m in messages:
        content = m["content"]
        if not content.strip():
            continue  # nothing to supervise or to anchor the search on
        # Templates may trim a turn, and Qwen3's drops the <think> block of replies in history.
        candidates = [content, content.strip()]
        if m["role"] == "assistant" and "</think>" in content:
            candidates.append(content.split("</think>")[-1].strip())
        found = _first_match(text, candidates, pos, eot if m["role"] == "assistant" else "")
        if found is None:
            return None
        if m["role"] == "assistant":
            spans.append((found[0], found[1] + (0 if m.get("truncated") else len(eot))))
        pos = found[1] + (len(eot) if m["role"] == "assistant" else 0)
    return spans


def mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int] | None:
    """1 on tokens inside a span, 0 elsewhere; None when a token crosses a span's edge (its
    supervised tokens would not decode to exactly the reply + end-of-turn token)."""
    mask, k = [0] * len(offsets), 0
    for i, (a, b) in enumerate(offsets):
        while k < len(spans) and a >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        s, e = spans[k]
        if b <= s:
            continue
        if a < s or b > e:
            return None
        mask[i] = 1
    return mask


def encode_conversations(tokenizer, conversations: list[list[dict]], eot: str, max_length: int,
                         enable_thinking: bool, batch: int = 256) -> Iterator[tuple[list[int], list[int]] | str]:
    """Per conversation, in order: (input_ids, loss_mask) truncated to max_length, or a drop reason.
    A reply marked "truncated" (cut by --max-new-tokens) ends the conversation where the target
    stopped: the text is cut right after it, so its end-of-turn token is neither labelled nor
    input, and later turns are left out."""
    for lo in range(0, len(conversations), batch):
        results, texts, where = [], [], []
        for messages in conversations[lo:lo + batch]:
            cut = next((k for k, m in enumerate(messages) if m.get("truncated")), None)
            messages = messages if cut is None else messages[:cut + 1]
            if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
                results.append("no_assistant_turn")
                continue
            try:
                text = chat_text(tokenizer, messages, enable_thinking)
            except Exception:  # e.g. a template that raises on roles out of order
                results.append("template_error")
                continue
            spans = assistant_spans(text, messages, eot)
            results.append(spans if spans is not None else "turn_not_located")
            if spans is not None and cut is not None:
                text = text[:spans[-1][1]]
            if spans is not None:
                texts.append(text)
                where.append(len(results) - 1)
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True) if texts else None
        for j, r in enumerate(where):
            mask = mask_from_offsets(enc["offset_mapping"][j], results[r])
            results[r] = ("token_crosses_turn_edge" if mask is None else
                          (enc["input_ids"][j][:max_length], mask[:max_length]))
        yield from results


def to_dataset(rows: list[tuple[list[int], list[int]]]) -> Dataset:
    return Dataset.from_dict({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows]},
                             features=FEATURES)


# --- split and CLI -------------------------------------------------------------------------------

def split_indices(n: int, shuffle: bool, seed: int, val_size: int) -> tuple[list[int], list[int]]:
    """Train and val row indices: val is a seeded random sample (whether or not --shuffle), each part
    in input order, or shuffled with --shuffle."""
    order = list(range(n))
    if shuffle:
        random.Random(seed).shuffle(order)
    val = set(random.Random(seed + 1).sample(range(n), val_size)) if val_size else set()
    return [i for i in order if i not in val], [i for i in order if i in val]


def parse_args(argv):
    p = OneLineArgumentParser(prog="dflash-prepare", description=__doc__.splitlines()[0],
                              epilog="Then: dflash-train data.train=OUT/train data.val=OUT/val")
    p.add_argument("--input", required=True, help="a .jsonl/.json/.parquet file, or a Hub dataset id (owner/name)")
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
    p.add_argument("--strict", action="store_true", help="a malformed row is an error (default: skipped, counted)")
    p.add_argument("--target", required=True, help="target folder or Hub id (its tokenizer and chat template)")
    p.add_argument("--target-revision", default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=False,
                   help="passed to the chat template as enable_thinking (Qwen3); DFlash drafters are trained "
                        "with thinking off (default)")
    p.add_argument("--max-length", type=int, default=3072, help="tokens per conversation; longer ones are cut "
                                                                 "(default 3072, DFlash's)")
    p.add_argument("--min-supervised-tokens", type=int, default=32,
                   help="drop conversations with fewer assistant tokens after cutting (default 32 = 2 x DFlash's "
                        "block size 16, as DFlash drops them)")
    p.add_argument("--shuffle", action="store_true", help="shuffle rows (seeded); default: input order")
    p.add_argument("--seed", type=int, default=0, help="for shuffling, the val sample and sampling")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=float, default=None, help="hold out this fraction as OUT/val")
    val.add_argument("--val-size", type=int, default=None, help="hold out this many rows as OUT/val")
    p.add_argument("--output", required=True, help="output folder (OUT, or OUT/train + OUT/val with a split)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    g = p.add_argument_group("regeneration (the target writes the assistant turns; see dflash_train/regenerate.py)")
    g.add_argument("--regenerate", action="store_true", help="replace every assistant turn by the target's answer")
    g.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-new-tokens", type=int, default=2048, help="per assistant turn")
    g.add_argument("--keep-truncated", action="store_true",
                   help="keep answers cut by --max-new-tokens, supervised up to the cut with no end-of-turn token; "
                        "a cut answer ends its conversation (default: drop the conversation)")
    g.add_argument("--batch-size", type=int, default=16, help="conversations per generate call")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (transformers backend)")
    g.add_argument("--target-dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="the target's weights while it answers: auto = bf16 on a GPU that has it, else fp32; "
                        "bf16 on a CPU with AVX-512 BF16 is ~2x faster")
    args = p.parse_args(argv)
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        p.error("--val-fraction must be in (0, 1)")
    for name in ["val_size", "max_rows", "max_length", "max_new_tokens", "batch_size"]:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.min_supervised_tokens < 0 or args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error("--min-supervised-tokens and --temperature must be >= 0, --top-p in (0, 1]")
    return args


def fields_from(args) -> Fields:
    messages, role, content = FORMATS[args.format]
    roles = dict(ROLE_NAMES)
    for item in args.role_map:
        name, _, role_to = item.partition("=")
        if role_to not in ("system", "user", "assistant"):
            raise UserError(f"--role-map '{item}' must be NAME=system, NAME=user or NAME=assistant")
        roles[name] = role_to
    return Fields(args.messages_field or messages, args.role_field or role, args.content_field or content, roles)


def load_tokenizer(args):
    try:
        return AutoTokenizer.from_pretrained(args.target, revision=args.target_revision,
                                             trust_remote_code=args.trust_remote_code)
    except LOAD_ERRORS as e:
        raise UserError(f"cannot load the tokenizer of target '{args.target}': {first_line(e)}") from None


def run_regeneration(args, tokenizer, conversations, eot: str, out: Path):
    """The target answers every turn (regenerate.py). Returns per conversation the new messages
    or a drop reason, the settings and counts for prepare_info.json, and the work folder."""
    s = regen.Sampling(args.backend, args.temperature, args.top_p, args.max_new_tokens, args.seed, args.batch_size,
                       args.enable_thinking, args.keep_truncated)
    if args.backend == "vllm":
        stops = regen.stop_token_ids(tokenizer, eot)
        generate = regen.vllm_generate(args.target, args.target_revision, args.trust_remote_code, stops, s)
    else:
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        target = load_target(args.target, revision=args.target_revision, device=device,
                             dtype=target_dtype(args.target_dtype, device), trust_remote_code=args.trust_remote_code)
        stops = regen.stop_token_ids(tokenizer, eot, target.model.generation_config.eos_token_id)
        generate = regen.transformers_generate(target, stops, s)
    record = asdict(s) | {"target": args.target, "target_revision": args.target_revision,
                          "template_sha256": template_sha256(tokenizer), "stop_token_ids": stops}
    work = out.with_name(f"{out.name}.work")
    results, stats = regen.regenerate(conversations, tokenizer, generate, s, work, record)
    return results, record | {"stats": stats}, work


@cli_guard
def main(argv=None):
    args = parse_args(argv)
    out = Path(args.output)
    require_free_output(out, args.overwrite, "prepare", [("--input", args.input), ("--target", args.target)])
    args.input, args.target = resolve_input(args.input), model_source(args.target, "target")
    if args.regenerate and args.backend == "vllm":
        regen.import_vllm()  # fail before reading anything
    elif args.backend == "vllm":
        raise UserError("--backend applies to --regenerate only")
    kind = input_kind(args.input)
    fields = fields_from(args)
    tokenizer = load_tokenizer(args)
    eot = end_of_turn(tokenizer)

    # --- read and normalise ----------------------------------------------------------------------
    rows = read_rows(args.input, kind, args.split, args.config)
    conversations, counts = read_conversations(islice(rows, args.max_rows), args.format, fields, args.strict,
                                               args.input)
    dropped = Counter(dict.fromkeys(DROP_REASONS, 0))
    regeneration, work = None, None
    if args.regenerate:
        results, regeneration, work = run_regeneration(args, tokenizer, conversations, eot, out)
        dropped.update(r for r in results if isinstance(r, str))
        conversations = [r for r in results if not isinstance(r, str)]

    # --- tokenize and mask -----------------------------------------------------------------------
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
    summary = (f"{counts.read} rows read from {args.input}, {counts.malformed} malformed; kept {len(kept)}, dropped "
               f"{sum(dropped.values())}" + "".join(f", {k} {v}" for k, v in dropped.items() if v))
    if not kept:
        raise UserError(f"no usable conversation: {summary}"
                        + (f" (first malformed: {counts.examples[0]})" if counts.examples else ""))

    # --- split and write -------------------------------------------------------------------------
    n = len(kept)
    val_size = args.val_size or (max(1, round(args.val_fraction * n)) if args.val_fraction else 0)
    if val_size >= n:
        raise UserError(f"a validation split of {val_size} rows leaves no training rows ({n} kept)")
    train_idx, val_idx = split_indices(n, args.shuffle, args.seed, val_size)
    info = {
        "input": args.input, "split": args.split if kind == "hub" else None, "config": args.config,
        "format": args.format, "fields": asdict(fields),
        "target": {"name_or_path": args.target, "revision": args.target_revision},
        "template": {"sha256": template_sha256(tokenizer), "end_of_turn": eot},
        "enable_thinking": args.enable_thinking, "max_length": args.max_length,
        "min_supervised_tokens": args.min_supervised_tokens,
        "counts": {"read": counts.read, "malformed": counts.malformed, "kept": n, "dropped": dict(dropped),
                   "truncated_to_max_length": truncated},
        "malformed_examples": counts.examples,
        "splits": {"train": len(train_idx), "val": len(val_idx)} if val_size else {"all": n},
        "shuffle": args.shuffle, "seed": args.seed,
        "tokens": {"total": sum(len(r[0]) for r in kept), "supervised": sum(sum(r[1]) for r in kept)},
        "regeneration": regeneration,
    }

    def write(tmp: Path):
        if val_size:
            to_dataset([kept[i] for i in train_idx]).save_to_disk(str(tmp / "train"))
            to_dataset([kept[i] for i in val_idx]).save_to_disk(str(tmp / "val"))
        else:
            to_dataset([kept[i] for i in train_idx]).save_to_disk(str(tmp))
        if args.regenerate:
            with open(tmp / "regenerated.jsonl", "w") as f:
                for messages in conversations:
                    f.write(json.dumps({"messages": messages}) + "\n")
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")

    write_atomically(out, write, "prepare")
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)  # finished: nothing left to resume
    parts = f"train {len(train_idx)} / val {len(val_idx)}" if val_size else f"{n} rows"
    print(summary)
    print(f"wrote {parts}, {info['tokens']['total']:,} tokens ({info['tokens']['supervised']:,} supervised) to {out}")


if __name__ == "__main__":
    sys.exit(main())
