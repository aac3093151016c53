"""Regeneration: the target rewrites every assistant turn, so the drafter learns to predict the
target's own text (DFlash trains on target-regenerated answers). Used by `dflash-prepare --regenerate`:

    dflash-prepare --input prompts.jsonl --format messages --target Qwen/Qwen3-8B --output data/qwen3 \
        --regenerate --temperature 0 --max-new-tokens 2048 [--backend vllm]

- Turn by turn: the prompt for answer k is the conversation's system/user turns up to user turn k
  with the target's own answers 1..k-1 as history (never the dataset's answers). A conversation
  ending with a user turn gets an answer for it too, so prompt-only data works.
- Batches: conversations are cut into fixed chunks of `batch_size`; each chunk answers turn 1 of
  all its rows in one `generate` call (left padding), then turn 2 of those that have one, ...
  The random seed of a call depends only on (seed, chunk start, turn), so a chunk's answers are
  the same however often the run is interrupted.
- Resume: every finished chunk is appended to `<work_dir>/done.jsonl` (one line per conversation,
  keyed by its index and a hash of its input turns) and flushed; a rerun with the same input and
  settings skips the conversations found there. Other settings or input stop with an error.
- The work folder (`OUT.work` beside dflash-prepare's OUT) carries the toolkit's marker
  (core/outputs.py, kind "regenerate"): a folder there that this toolkit did not write, a file,
  or one holding an input is refused before anything is read, written or deleted.
- Drops (the conversation is dropped, counted by reason): `empty_generation` (an answer with no
  text), `hit_max_new_tokens` (an answer cut by --max-new-tokens before the end-of-turn token,
  unless --keep-truncated), `no_user_turn`.
- --keep-truncated: a cut answer ends the conversation (no later turn is answered after it) and is
  stored as {"role": "assistant", "content": ..., "truncated": true}; dflash-prepare then
  supervises its tokens up to the cut and no end-of-turn token after it, since the target never
  wrote one there (chat.encode_conversations).
- Backends: `transformers` (batched `generate`), `static` (engine.py: continuous batching over a static KV
  cache, CPU; same greedy output) or `vllm` (when importable; same output).
"""

import hashlib
import importlib
import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from dflash_train.core.errors import UserError
from dflash_train.core.outputs import (KINDS, MARKER, Inputs, check_folder_path, is_empty, marker_kind,
                                       refuse_overlap, write_marker)
from dflash_train.core.progress import BAR_INTERVAL
from dflash_train.model.target import Target

DONE_FILE = "done.jsonl"  # one finished conversation per line
SETTINGS_FILE = "settings.json"  # what the lines in DONE_FILE were made with


@dataclass(frozen=True)
class Sampling:
    backend: str  # "transformers", "static" (engine.py) or "vllm"
    temperature: float  # 0 = greedy
    top_p: float  # nucleus sampling (only when temperature > 0)
    max_new_tokens: int  # per assistant turn
    seed: int
    batch_size: int  # conversations per generate call; fixes each chunk's seed, so part of the resume key
    enable_thinking: bool  # passed to the chat template (Qwen3 thinking mode)
    keep_truncated: bool  # keep answers cut by max_new_tokens instead of dropping the conversation


@dataclass
class Generation:
    tokens: list[int]  # the answer, stop token excluded
    stopped: bool  # ended with a stop token (False: cut by max_new_tokens)


# (prompt token ids per row, seed) -> one Generation per row
GenerateFn = Callable[[list[list[int]], int], list[Generation]]


def transformers_generate(target: Target, stop_ids: list[int], s: Sampling) -> GenerateFn:
    tok, model = target.tokenizer, target.model
    pad = tok.pad_token_id if tok.pad_token_id is not None else stop_ids[0]
    sample = s.temperature > 0
    # Only temperature and top-p shape the samples: the model's generation_config defaults (top_k,
    # min_p, repetition_penalty) are switched off, so both backends sample what prepare_info.json records.
    config = GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=sample, eos_token_id=stop_ids,
                              pad_token_id=pad, repetition_penalty=1.0,
                              **({"temperature": s.temperature, "top_p": s.top_p, "top_k": 0, "min_p": 0.0}
                                 if sample else {}))

    @torch.no_grad()
    def generate(prompts: list[list[int]], seed: int) -> list[Generation]:
        T = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), T), pad, dtype=torch.long)
        attn = torch.zeros((len(prompts), T), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at T, where answers start
            ids[i, T - len(p):] = torch.tensor(p)
            attn[i, T - len(p):] = 1
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids.to(model.device), attention_mask=attn.to(model.device),
                             generation_config=config)[:, T:].tolist()  # [b, new]
        gens = []
        for row in out:
            end = next((j for j, t in enumerate(row) if t in stop_ids), None)
            gens.append(Generation(row, False) if end is None else Generation(row[:end], True))
        return gens

    return generate


def vllm_generate(target_id: str, revision: str | None, trust_remote_code: bool, stop_ids: list[int],
                  s: Sampling) -> GenerateFn:
    """vLLM also stops at the model's own EOS ids (from its generation_config)."""
    vllm = import_vllm()
    llm = vllm.LLM(model=target_id, revision=revision, trust_remote_code=trust_remote_code, seed=s.seed)

    def generate(prompts: list[list[int]], seed: int) -> list[Generation]:
        # One seed per request, so an answer does not depend on the batch it ran in.
        params = [vllm.SamplingParams(temperature=s.temperature, top_p=s.top_p if s.temperature > 0 else 1.0,
                                      max_tokens=s.max_new_tokens, stop_token_ids=stop_ids, seed=seed + i)
                  for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        gens = []
        for o in outs:
            tokens, stopped = list(o.outputs[0].token_ids), o.outputs[0].finish_reason == "stop"
            if tokens and tokens[-1] in stop_ids:
                tokens = tokens[:-1]
            gens.append(Generation(tokens, stopped))
        return gens

    return generate


def import_vllm():
    try:
        return importlib.import_module("vllm")
    except ImportError as e:
        raise UserError(f"--backend vllm needs the 'vllm' package, which is not importable here "
                        f"({type(e).__name__}: {e}); pip install vllm, or use --backend "
                        "transformers") from None


def answer_points(messages: list[dict]) -> list[list[dict]]:
    """The non-assistant turns before each answer the target writes: the conversation split at
    its assistant turns (consecutive ones count once), plus trailing turns if any."""
    points, cur = [], []
    for m in messages:
        if m["role"] == "assistant":
            if cur:
                points.append(cur)
            cur = []
        else:
            cur.append(m)
    if cur:
        points.append(cur)
    return points


def _batch_seed(seed: int, chunk_start: int, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}:{chunk_start}:{turn}".encode()).digest()
    return int.from_bytes(digest[:7], "little")  # < 2**56: a valid torch seed and vLLM seed base


def _prompt_ids(tokenizer, history: list[dict], enable_thinking: bool) -> list[int]:
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def regenerate_chunk(convs: list[list[dict]], tokenizer, generate: GenerateFn, s: Sampling,
                     chunk_start: int) -> list[dict]:
    """Answer every turn of a chunk of conversations -> per conversation
    {"messages": [...]} or {"dropped": reason}, plus "tokens" (generated tokens)."""
    points = [answer_points(c) for c in convs]
    history = [[] for _ in convs]
    dropped = [None if p else "no_user_turn" for p in points]
    cut = [False] * len(convs)  # ended by a truncated answer (--keep-truncated)
    tokens = [0] * len(convs)
    for k in range(max(len(p) for p in points)):
        active = [i for i, p in enumerate(points) if k < len(p) and dropped[i] is None and not cut[i]]
        if not active:
            break
        for i in active:
            history[i] += points[i][k]
        gens = generate([_prompt_ids(tokenizer, history[i], s.enable_thinking) for i in active],
                        _batch_seed(s.seed, chunk_start, k))
        for i, g in zip(active, gens):
            tokens[i] += len(g.tokens)
            text = tokenizer.decode(g.tokens, skip_special_tokens=True)
            if not text.strip():
                dropped[i] = "empty_generation"
            elif not g.stopped and not s.keep_truncated:
                dropped[i] = "hit_max_new_tokens"
            elif not g.stopped:
                history[i].append({"role": "assistant", "content": text, "truncated": True})
                cut[i] = True
            else:
                history[i].append({"role": "assistant", "content": text})
    return [({"dropped": d} if d else {"messages": h}) | {"tokens": n}
            for d, h, n in zip(dropped, history, tokens)]


def conversation_key(messages: list[dict]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]


def work_folder(out: Path) -> Path:
    """dflash-prepare's work folder for OUT: OUT.work beside it (`--output .` too)."""
    out = Path(out)
    if out.name in ("", ".", ".."):
        return Path(f"{os.path.abspath(out)}.work")
    return out.with_name(f"{out.name}.work")


def _unmarked_work_folder(work_dir: Path) -> bool:
    """A work folder from before the marker (an older dflash-prepare, or one seeded by data/corpus.py):
    nothing but a settings.json that is a JSON object and a done.jsonl. regenerate() marks it."""
    try:
        names = {p.name for p in work_dir.iterdir()}
        return names <= {SETTINGS_FILE, DONE_FILE} and SETTINGS_FILE in names and isinstance(
            json.loads((work_dir / SETTINGS_FILE).read_text()), dict)
    except (OSError, UnicodeDecodeError, ValueError):
        return False


def check_work_folder(work_dir: Path, inputs: Inputs = ()) -> None:
    """Before anything is read, written or deleted: `work_dir` is absent, empty, or a regeneration
    work folder this toolkit wrote (marked, or unmarked with only its two files); it is not a file,
    and no input is, holds or lies inside it."""
    flag = "the regeneration work folder"
    check_folder_path(work_dir, flag)
    refuse_overlap(work_dir, list(inputs), flag)
    if is_empty(work_dir):
        return
    kind = marker_kind(work_dir)
    if kind != "regenerate" and not (kind is None and _unmarked_work_folder(work_dir)):
        why = (f"holds {KINDS.get(kind, kind)}" if kind else
               f"was not written by dflash-prepare --regenerate (no {MARKER})")
        raise UserError(f"{flag} '{work_dir}' is not empty and {why}: move it away, or choose another "
                        "--output")


def conversations_done(work_dir: Path) -> int:
    """How many finished conversations `work_dir` holds (for the line of an interrupted run)."""
    try:
        lines = (Path(work_dir) / DONE_FILE).read_text().splitlines()
    except OSError:
        return 0
    n = 0
    for line in lines:
        try:
            n += isinstance(json.loads(line), dict)
        except json.JSONDecodeError:
            pass
    return n


def _damaged(work_dir: Path, what: str) -> UserError:
    return UserError(f"the regeneration work folder '{work_dir}' is damaged ({what}): delete it to start "
                     "over")


def _read_done(work_dir: Path, record: dict, keys: list[str]) -> dict[int, dict]:
    """Finished conversations of an earlier run with the same settings and input."""
    settings = work_dir / SETTINGS_FILE
    if settings.is_file():
        try:
            old = json.loads(settings.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _damaged(work_dir, f"{SETTINGS_FILE} does not parse: {e}") from None
        if not isinstance(old, dict):
            raise _damaged(work_dir, f"{SETTINGS_FILE} is not a JSON object")
        diff = [f"{k}: {old.get(k)!r} != {v!r}" for k, v in record.items() if old.get(k) != v]
        if diff:
            raise UserError(f"'{work_dir}' holds answers made with other settings ({'; '.join(diff)}): "
                            "rerun with the same settings to resume, or delete it to start over")
    done = {}
    if (work_dir / DONE_FILE).is_file():
        try:
            lines = (work_dir / DONE_FILE).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise _damaged(work_dir, f"{DONE_FILE} cannot be read: {e}") from None
        for n, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by the interruption: that conversation is answered again
            missing = ([k for k in ("i", "key", "tokens") if k not in row] if isinstance(row, dict)
                       else ["i"])
            if not missing and not ("messages" in row or "dropped" in row):
                missing = ["messages"]
            if missing or not isinstance(row["i"], int) or row["i"] < 0:
                raise _damaged(work_dir, f"{DONE_FILE} line {n} has no valid '{(missing or ['i'])[0]}'")
            i = row["i"]
            if i >= len(keys) or row["key"] != keys[i]:
                raise UserError(f"'{work_dir}' holds answers for other input (conversation {i} differs): "
                                "delete it to start over")
            done[i] = row
    return done


def _write_settings(work_dir: Path, record: dict) -> None:
    """settings.json, written beside and renamed: an interruption never leaves it cut short."""
    part = work_dir / f".{SETTINGS_FILE}.part"
    part.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(part, work_dir / SETTINGS_FILE)


def regenerate(conversations: list[list[dict]], tokenizer, generate: GenerateFn, s: Sampling, work_dir: Path,
               record: dict) -> tuple[list[list[dict] | str], dict]:
    """Regenerate all conversations, resuming from `work_dir`. `record` (settings, target, template)
    must match an earlier run's to resume. Returns per conversation the new messages or a drop
    reason, and counts."""
    keys = [conversation_key(c) for c in conversations]
    work_dir = Path(work_dir)
    check_work_folder(work_dir)
    done = _read_done(work_dir, record, keys)
    work_dir.mkdir(parents=True, exist_ok=True)
    write_marker(work_dir, "regenerate")
    _write_settings(work_dir, record)
    resumed = len(done)
    bar = tqdm(total=len(conversations), initial=resumed, desc="regenerate", unit="conv",
               mininterval=BAR_INTERVAL)
    with open(work_dir / DONE_FILE, "a") as f:
        if f.tell() and not (work_dir / DONE_FILE).read_bytes().endswith(b"\n"):
            f.write("\n")  # a line cut by an interruption stays alone on its line, not glued to the next
        for lo in range(0, len(conversations), s.batch_size):
            hi = min(lo + s.batch_size, len(conversations))
            if all(i in done for i in range(lo, hi)):
                continue
            # The whole chunk runs even if part of it was written: its batches, hence its seeds, stay the
            # same.
            results = regenerate_chunk(conversations[lo:hi], tokenizer, generate, s, lo)
            for i, r in zip(range(lo, hi), results):
                if i not in done:
                    done[i] = {"i": i, "key": keys[i]} | r
                    f.write(json.dumps(done[i]) + "\n")
                    bar.update(1)
            f.flush()
            os.fsync(f.fileno())
    bar.close()
    rows = [done[i] for i in range(len(conversations))]
    counts = Counter(r.get("dropped", "kept") for r in rows)
    stats = {"conversations": len(rows), "answered": counts.pop("kept", 0), "dropped": dict(counts),
             "ended_by_truncated_answer": sum("messages" in r and r["messages"][-1].get("truncated", False)
                                              for r in rows),
             "resumed": resumed, "generated_tokens": sum(r["tokens"] for r in rows)}
    return [r.get("messages", r.get("dropped")) for r in rows], stats
