"""Files read from the user go through a pydantic model before use; a violation is one line
naming the file and the field (a UserError: `error: ...`, exit 2). The models live beside
their readers (drafter configs in formats.py, eval reports in report.py, suites in suites.py,
manifests in data/hs_cache.py, trainer state in checkpoint/folders.py)."""

import json
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_train.core.errors import UserError


# config.json's counts: a size (at least 1), an index or a count that may be 0
Size = Annotated[int, Field(ge=1)]
Index = Annotated[int, Field(ge=0)]


class Strict(BaseModel):
    """A file part we write ourselves: an unknown key is an error."""
    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    """A file part others write too (speculators, z-lab, newer versions): unknown keys are kept, unread."""
    model_config = ConfigDict(extra="allow")


def describe(e: ValidationError) -> str:
    """The first violation as `field 'a.b.0': what is wrong (got value)`."""
    err = e.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if err["type"] == "extra_forbidden":
        return f"unknown field '{key}'"
    if err["type"] == "missing":
        return f"field '{key}' is missing"
    if err["type"] in ("value_error", "assertion_error"):  # our own checks: the message names the values
        return f"field '{key}': {msg}" if key else msg
    got = repr(err["input"])
    got = got if len(got) <= 60 else got[:57] + "..."
    return f"field '{key}': {msg} (got {got})" if key else msg


def validated(model: type[BaseModel], data, where: str):
    """model.model_validate(data), or a UserError `<where>: <the violation>`."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise UserError(f"{where}: {describe(e)}") from None


def load_json(path: Path, unreadable: str | None = None):
    """A JSON file -> its object, unchecked; unreadable, truncated or malformed -> one UserError line
    naming the file: `<unreadable> (<error type>)` where the caller says what the file should have
    been (an eval report, a costs JSON), else ours for the files we write (read_json's)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: truncated or not JSON (or not UTF-8)
        if unreadable is not None:
            raise UserError(f"{unreadable} ({type(e).__name__})") from None
        if isinstance(e, OSError):
            raise UserError(f"cannot read '{path}' ({e.strerror or type(e).__name__})") from None
        raise UserError(f"'{path}' is not valid JSON ({e}): it is damaged or was not written by "
                        "dflash-train") from None


def read_json(path: Path, model: type[BaseModel]):
    """A JSON file we wrote (a manifest, a checkpoint's state) -> `model`; unreadable, truncated or
    malformed -> one UserError line naming the file (and the field)."""
    return validated(model, load_json(path), f"'{path}'")
