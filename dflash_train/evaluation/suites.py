"""Evaluation prompt suites: names from eval/suites.yaml, local files, Hub datasets.

A suite is a list of prompts; a prompt is an optional system message and one or more user
turns (the target writes every assistant turn itself during evaluation).

    --suite tinychat                 bundled, offline (the default)
    --suite gsm8k                    the Hub dataset named in eval/suites.yaml
    --suite gsm8k=rows.jsonl         a local file with that dataset's fields
    --suite tinychat=my.jsonl        (a messages suite) a local file of messages rows
    --suite my_prompts.jsonl         {"messages": [...]} rows, like the training data
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import yaml
from datasets import load_dataset
from pydantic import Field, model_validator

from dflash_train.core.errors import UserError
from dflash_train.core.paths import ROOT
from dflash_train.core.schema import Open, Strict, validated

SUITES_FILE = ROOT / "eval" / "suites.yaml"
DEFAULT_SUITE = "tinychat"


@dataclass
class Prompt:
    turns: list[str]  # user turns, in order
    system: str | None = None


class SuiteDef(Strict):
    """One entry of eval/suites.yaml (its header explains the keys): a bundled `file` of messages
    rows, or a Hub `dataset` whose `field` is the user turn."""
    file: str | None = None
    dataset: str | None = None
    config: str | None = None
    split: str | None = None
    field: str | None = None
    extra_field: str | None = None
    turns: bool = False
    samples: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _one_source(self):
        if (self.file is None) == (self.dataset is None):
            raise ValueError("needs exactly one of 'file' or 'dataset'")
        if self.dataset and not (self.split and self.field):
            raise ValueError("a Hub dataset suite needs 'split' and 'field'")
        return self


class Message(Open):
    role: Annotated[str, Field(min_length=1)]
    content: str


class MessagesRow(Open):
    messages: Annotated[list[Message], Field(min_length=1)]


def suite_definitions() -> dict:
    defs = yaml.safe_load(SUITES_FILE.read_text())
    if not isinstance(defs, dict):
        raise UserError(f"'{SUITES_FILE}' must map suite names to their definitions")
    for name, d in defs.items():
        validated(SuiteDef, d, f"'{SUITES_FILE}' suite '{name}'")
    return defs


def prompts_from_messages(rows: list[dict], where: str) -> list[Prompt]:
    prompts = []
    for i, row in enumerate(rows):
        messages = validated(MessagesRow, row, f"{where} row {i + 1}").messages
        system = next((m.content for m in messages if m.role == "system"), None)
        turns = [m.content for m in messages if m.role == "user"]
        if turns:
            prompts.append(Prompt(turns, system))
    return prompts


def prompts_from_rows(rows, spec: dict, where: str) -> list[Prompt]:
    """Rows of a Hub dataset (or a local file in its schema) -> prompts, per the suite spec."""
    field, extra = spec["field"], spec.get("extra_field")
    prompts = []
    for i, row in enumerate(rows):
        if field not in row:
            raise UserError(f"suite rows have no field '{field}' (fields: {sorted(row)})")
        value = row[field]
        ok = (isinstance(value, list) and value
              and all(isinstance(t, str) for t in value)) if spec.get("turns") \
            else isinstance(value, str)
        if not ok:
            raise UserError(f"{where} row {i + 1}: field '{field}' must be "
                            f"{'a list of texts (user turns)' if spec.get('turns') else 'text'}, got "
                            f"{value!r:.60}")
        turns = list(value) if spec.get("turns") else [value]
        if extra and row.get(extra):
            turns[0] = f"{turns[0]}\n\n{row[extra]}"
        prompts.append(Prompt([str(t) for t in turns]))
    return prompts


def _read_local(path: Path) -> list[dict]:
    """The rows of a local .jsonl (read line by line, so a bad line is named), .json or .parquet."""
    if path.is_dir():
        raise UserError(f"suite file '{path}' is a folder, not a file")
    if not path.is_file():
        raise UserError(f"suite file '{path}' not found")
    if path.suffix != ".parquet" and not path.read_bytes().strip():
        raise UserError(f"suite file '{path}' is empty")
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    raise UserError(f"suite file '{path}' line {n} is not JSON") from None
                if not isinstance(rows[-1], dict):
                    raise UserError(f"suite file '{path}' line {n} is not a JSON object")
        return rows
    kind = "parquet" if path.suffix == ".parquet" else "json"
    try:
        return list(load_dataset(kind, data_files=str(path), split="train"))
    except Exception as e:  # datasets raises many types for unreadable files
        raise UserError(f"suite file '{path}' is not readable {kind}: {type(e).__name__}") from e


def load_suite(spec: str, limit: int | None = None) -> tuple[str, list[Prompt]]:
    """Resolve one --suite argument -> (suite name, prompts)."""
    defs = suite_definitions()
    name, _, local = spec.partition("=")
    if name in defs and "file" in defs[name]:  # a messages suite: bundled, or NAME=file in the same form
        definition = defs[name]
        path = Path(local or definition["file"])
        path = path if local or path.is_absolute() else SUITES_FILE.parents[1] / path
        prompts = prompts_from_messages(_read_local(path), f"suite file '{path}'")
    elif name in defs:
        definition = defs[name]
        if local:
            rows = _read_local(Path(local))
        else:
            try:
                rows = load_dataset(definition["dataset"], definition.get("config"),
                                    split=definition["split"])
            except Exception as e:  # offline, missing, gated: say which suite and why, in one line
                raise UserError(f"cannot load suite '{name}' ({definition['dataset']}): "
                                f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
                                ) from e
            rows = rows.shuffle(seed=0)
        prompts = prompts_from_rows(rows, definition, f"suite '{name}' ({local or definition['dataset']})")
    elif Path(spec).suffix in (".jsonl", ".json", ".parquet"):
        name, definition = Path(spec).stem, {}
        prompts = prompts_from_messages(_read_local(Path(spec)), f"suite file '{spec}'")
    else:
        raise UserError(f"unknown suite '{spec}' (known: {', '.join(defs)}; or a .jsonl of messages)")
    n = limit or definition.get("samples") or len(prompts)
    if not prompts:
        raise UserError(f"suite '{name}' has no prompt with a user turn")
    return name, prompts[:n]
