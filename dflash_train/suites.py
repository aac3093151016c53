"""Evaluation prompt suites: names from eval/suites.yaml, local files, Hub datasets.

A suite is a list of prompts; a prompt is an optional system message and one or more user
turns (the target writes every assistant turn itself during evaluation).

    --suite tinychat                 bundled, offline (the default)
    --suite gsm8k                    the Hub dataset named in eval/suites.yaml
    --suite gsm8k=rows.jsonl         a local file with that dataset's fields
    --suite my_prompts.jsonl         {"messages": [...]} rows, like the training data
"""

from dataclasses import dataclass
from pathlib import Path

import yaml
from datasets import load_dataset

from dflash_train.errors import UserError

SUITES_FILE = Path(__file__).resolve().parents[1] / "eval" / "suites.yaml"
DEFAULT_SUITE = "tinychat"


@dataclass
class Prompt:
    turns: list[str]  # user turns, in order
    system: str | None = None


def suite_definitions() -> dict:
    return yaml.safe_load(SUITES_FILE.read_text())


def prompts_from_messages(rows) -> list[Prompt]:
    prompts = []
    for messages in rows:
        system = next((m["content"] for m in messages if m["role"] == "system"), None)
        turns = [m["content"] for m in messages if m["role"] == "user"]
        if turns:
            prompts.append(Prompt(turns, system))
    return prompts


def prompts_from_rows(rows, spec: dict) -> list[Prompt]:
    """Rows of a Hub dataset (or a local file in its schema) -> prompts, per the suite spec."""
    field, extra = spec["field"], spec.get("extra_field")
    prompts = []
    for row in rows:
        if field not in row:
            raise UserError(f"suite rows have no field '{field}' (fields: {sorted(row)})")
        value = row[field]
        turns = list(value) if spec.get("turns") else [value]
        if extra and row.get(extra):
            turns[0] = f"{turns[0]}\n\n{row[extra]}"
        prompts.append(Prompt([str(t) for t in turns]))
    return prompts


def _read_local(path: Path):
    if not path.is_file():
        raise UserError(f"suite file '{path}' not found")
    kind = "parquet" if path.suffix == ".parquet" else "json"
    try:
        return load_dataset(kind, data_files=str(path), split="train")
    except Exception as e:  # datasets raises many types for unreadable files
        raise UserError(f"suite file '{path}' is not readable {kind}: {type(e).__name__}") from e


def load_suite(spec: str, limit: int | None = None) -> tuple[str, list[Prompt]]:
    """Resolve one --suite argument -> (suite name, prompts)."""
    defs = suite_definitions()
    name, _, local = spec.partition("=")
    if name in defs and "file" in defs[name] and not local:
        local, definition = defs[name]["file"], defs[name]
        path = Path(local) if Path(local).is_absolute() else SUITES_FILE.parents[1] / local
        prompts = prompts_from_messages(_read_local(path)["messages"])
    elif name in defs:
        definition = defs[name]
        if local:
            rows = _read_local(Path(local))
        else:
            try:
                rows = load_dataset(definition["dataset"], definition.get("config"), split=definition["split"])
            except Exception as e:  # offline, missing, gated: say which suite and why, in one line
                raise UserError(f"cannot load suite '{name}' ({definition['dataset']}): "
                                f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from e
            rows = rows.shuffle(seed=0)
        prompts = prompts_from_rows(rows, definition)
    elif Path(spec).suffix in (".jsonl", ".json", ".parquet"):
        name, definition = Path(spec).stem, {}
        rows = _read_local(Path(spec))
        if "messages" not in rows.column_names:
            raise UserError(f"suite file '{spec}' has no 'messages' field (columns: {rows.column_names})")
        prompts = prompts_from_messages(rows["messages"])
    else:
        raise UserError(f"unknown suite '{spec}' (known: {', '.join(defs)}; or a .jsonl of messages)")
    n = limit or definition.get("samples") or len(prompts)
    if not prompts:
        raise UserError(f"suite '{name}' has no prompt with a user turn")
    return name, prompts[:n]
