"""Chat rows -> OpenAI messages -> token ids with an assistant-only loss mask (dflash-prepare's library).

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

Used by dflash-prepare (cli/prepare.py) and by training's jsonl loader (data/dataset.py).
"""

import gzip
import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset, Features, List, Value, load_dataset

from dflash_train.core.errors import UserError

FORMATS = {  # format -> (messages field, role field, content field)
    "messages": ("messages", "role", "content"),
    "sharegpt": ("conversations", "from", "value"),
    "ultrachat": ("messages", "role", "content"),
    "nemotron": ("messages", "role", "content"),
}
ROLE_NAMES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user",
              "gpt": "assistant"}
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
        raise Malformed(f"turn {n} has role {name!r} (known: {', '.join(sorted(fields.roles))}; see "
                        "--role-map)")
    message = {"role": fields.roles[name],
               "content": _text(turn.get(fields.content), f"turn {n} '{fields.content}'")}
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
                    [_message(t, fields, i) for i, t in enumerate(prompt)] if isinstance(prompt, list)
                    else None)
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
        raise UserError(f"input '{source}' is a folder: give a .jsonl, .json or .parquet file or a Hub "
                        "dataset id")
    if path.is_file():
        if path.stat().st_size == 0:
            raise UserError(f"input file '{source}' is empty")
        return "parquet" if path.suffix == ".parquet" else "json"
    if (path.suffix in (".jsonl", ".json", ".parquet") or source.startswith((".", "/", "~"))
            or source.count("/") != 1):
        raise UserError(f"input file '{source}' not found")
    return "hub"


def _json_rows(path: Path) -> Iterator[tuple[int, object]]:
    """A JSON array (rows numbered from 1), else JSON lines (numbered by line); a line that is not
    JSON comes as a Malformed. A `.gz` file is read through gzip (the committed corpora)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            head = f.read(8192)
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise UserError(f"input file '{path}' cannot be read: {e}") from None
    if b"\x00" in head:
        raise UserError(f"input file '{path}' is binary, not JSON")
    try:
        with opener(path, "rt", encoding="utf-8") as f:
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
    except (OSError, EOFError) as e:  # a gzip file cut short
        raise UserError(f"input file '{path}' cannot be read: {e}") from None


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


def tokenizer_sha256(tokenizer) -> str:
    """What turns text into ids, for --append-to's key: the fast tokenizer's whole definition (vocab,
    merges, normalizer, pre-tokenizer, added tokens; less the truncation and padding a call sets on it)
    and which tokens are special. Two copies of one tokenizer hash the same wherever they are."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    text = json.dumps([spec, tokenizer.special_tokens_map], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def chat_text(tokenizer, messages: list[dict], enable_thinking: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                         enable_thinking=enable_thinking)


def end_of_turn(tokenizer) -> str:
    """The special token the chat template writes right after an assistant reply."""
    if tokenizer.chat_template is None:
        raise UserError(f"the target's tokenizer ('{tokenizer.name_or_path}') has no chat template")
    try:
        text = chat_text(tokenizer,
                         [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": PROBE}],
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
                         enable_thinking: bool,
                         batch: int = 256) -> Iterator[tuple[list[int], list[int]] | str]:
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


# --- train / val split ---------------------------------------------------------------------------

def split_indices(n: int, shuffle: bool, seed: int, val_size: int) -> tuple[list[int], list[int]]:
    """Train and val row indices: val is a seeded random sample (whether or not --shuffle), each part
    in input order, or shuffled with --shuffle."""
    order = list(range(n))
    if shuffle:
        random.Random(seed).shuffle(order)
    val = set(random.Random(seed + 1).sample(range(n), val_size)) if val_size else set()
    return [i for i in order if i not in val], [i for i in order if i in val]


# --- growing a prepared dataset ------------------------------------------------------------------

# prepare_info.json fields that must agree for rows of two prepare runs to sit in one dataset.
SAME_ROWS = ("format", "enable_thinking", "max_length", "min_supervised_tokens")


def read_prepared(folder: Path) -> tuple[dict, dict[str, list[tuple[list[int], list[int]]]]]:
    """A dflash-prepare output -> (its prepare_info, {split: rows}) with splits train + val, or all."""
    info = read_prepare_info(folder)
    splits = {}
    for name in info["splits"]:
        path = folder if name == "all" else folder / name
        try:
            ds = Dataset.load_from_disk(str(path))
            splits[name] = list(zip(ds["input_ids"], ds["loss_mask"]))
        except Exception as e:  # datasets raises many types for damaged folders
            raise UserError(f"--append-to '{folder}': split {name} cannot be read "
                            f"({type(e).__name__})") from None
    if not splits:
        raise UserError(f"--append-to '{folder}': its {INFO_FILE} names no splits")
    return info, splits


def weights_key(pin: dict | None) -> str | None:
    """A target's weights as resolve_pin pins them: the SHA-256 of a local folder's safetensors, else
    the Hub repo at its commit (or the explicit revision)."""
    if not isinstance(pin, dict):
        return None
    if pin.get("kind") == "content_sha256":
        return f"sha256 {str(pin.get('sha256'))[:12]}"
    return f"{pin.get('name_or_path')}@{pin.get('revision')}"


def read_prepare_info(folder: Path) -> dict:
    """--append-to's prepare_info.json, with the parts read of it in the shape dflash-prepare writes
    them: a cut or edited file is one line, not a traceback."""
    if not (folder / INFO_FILE).is_file():
        raise UserError(f"--append-to '{folder}' is not a dflash-prepare output (no {INFO_FILE} in it)")
    try:
        info = json.loads((folder / INFO_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"--append-to '{folder}': its {INFO_FILE} is damaged ({type(e).__name__}: {e}); "
                        "prepare it again") from None
    shaped = (isinstance(info, dict) and isinstance(info.get("splits"), dict)
              and set(info["splits"]) <= {"all", "train", "val"}
              and all(isinstance(info.get(k, {}), dict) for k in ("template", "target", "tokenizer")))
    if not shaped:
        raise UserError(f"--append-to '{folder}': its {INFO_FILE} is damaged (its splits, template, target "
                        "or tokenizer are not what dflash-prepare writes); prepare it again")
    return info


def check_appendable(info: dict, mine: dict, folder: Path) -> None:
    """The rows of `info`'s prepare run and of this one (`mine`: the same fields) must be the same kind:
    the same chat template, tokenizer and target weights (by content, not by path: a copy of the target
    elsewhere appends, other weights under the same path do not), and the same settings."""
    name = info.get("target", {}).get("name_or_path")
    if info.get("template", {}).get("sha256") != mine["template"]["sha256"]:
        raise UserError(f"--append-to '{folder}' was prepared with another chat template (target '{name}')")
    old_tok = info.get("tokenizer", {}).get("sha256")
    if old_tok is None:
        raise UserError(f"--append-to '{folder}' records no tokenizer hash (an older dflash-prepare wrote "
                        "it): prepare it again to append to it")
    if old_tok != mine["tokenizer"]["sha256"]:
        raise UserError(f"--append-to '{folder}' was prepared with another tokenizer (target '{name}', "
                        f"tokenizer sha256 {old_tok[:12]} vs {mine['tokenizer']['sha256'][:12]})")
    old_w, new_w = weights_key(info.get("target", {}).get("weights")), weights_key(mine["target"]["weights"])
    if old_w is None:
        raise UserError(f"--append-to '{folder}' records no pin of its target's weights (an older "
                        "dflash-prepare, or weights it could not pin): prepare it again to append to it")
    if new_w is None:
        raise UserError(f"--append-to: the weights of target '{mine['target']['name_or_path']}' cannot be "
                        "pinned here (no safetensors to hash, or a Hub id not in the local cache: pass "
                        "--target-revision), so they cannot be checked against the earlier output's")
    if old_w != new_w:
        raise UserError(f"--append-to '{folder}' was prepared from other target weights ('{name}' {old_w} vs "
                        f"'{mine['target']['name_or_path']}' {new_w})")
    differ = [f"{k} {info.get(k)} vs {mine[k]}" for k in SAME_ROWS if info.get(k) != mine[k]]
    if differ:
        raise UserError(f"--append-to '{folder}' was prepared with other settings ({', '.join(differ)})")


def append_rows(old: dict[str, list], kept: list) -> tuple[dict[str, list], int]:
    """New rows go after the old training rows (after 'all' when unsplit); rows already in any old split
    are left out, so the grown corpus itself can be passed. The old val stays as it was, so validation
    stays comparable and a cache of the old train rows is a prefix of the new (dflash-cache --append).
    -> ({split: rows}, rows left out)."""
    seen = {(tuple(ids), tuple(mask)) for rows in old.values() for ids, mask in rows}
    new = [r for r in kept if (tuple(r[0]), tuple(r[1])) not in seen]
    grow = "train" if "train" in old else "all"
    return {name: rows + new if name == grow else rows for name, rows in old.items()}, len(kept) - len(new)
