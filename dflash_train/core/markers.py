"""The marker file every folder this toolkit writes carries (`.dflash-train.json`: the tool and the kind
of folder), and reading it. Writing it, and what an output may replace: core/outputs.py. Its own module
because inputs (core/paths.py: a drafter given as the target) and outputs both read it."""

import json
from pathlib import Path

MARKER = ".dflash-train.json"
KINDS = {"train": "a training run", "eval": "an eval report", "export": "an export",
         "prepare": "a prepared dataset", "cache": "a hidden-state cache", "drafter": "a drafter",
         "regenerate": "a regeneration work folder"}


def marker_kind(folder: Path) -> str | None:
    """The kind of output a folder holds, None when this toolkit did not write it."""
    try:
        return json.loads((Path(folder) / MARKER).read_text())["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
