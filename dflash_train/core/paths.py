"""Paths in: where an input is, and where the checkout is (`ROOT`).

Inputs: a relative path is taken from the current folder, else from the dflash-train checkout
(the bundled recipes/, data/ and eval/), so the defaults work from any folder. A local model or
drafter is recorded by its absolute path; a Hub id stays an id.
"""

from pathlib import Path

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from dflash_train.core.errors import UserError
from dflash_train.core.markers import KINDS, marker_kind

# the checkout: recipes/, data/, eval/ (dflash_train/core/paths.py)
ROOT = Path(__file__).resolve().parents[2]


# --- inputs ----------------------------------------------------------------------------------------

def resolve_input(value: str) -> str:
    """An existing local path -> its absolute path (relative ones from the current folder, else from
    the checkout); anything else (a Hub id, a missing path) as given."""
    path = Path(value).expanduser()
    for candidate in ([path] if path.is_absolute() else [Path.cwd() / path, ROOT / path]):
        if candidate.exists():
            return str(candidate.resolve())
    return value


def display_path(value, keep_outside: bool = False) -> str:
    """A path as written into what travels (a card, an exported recipe or eval report): relative to the
    checkout when inside it, which any clone resolves the same (resolve_input), else `<local>/NAME`
    (or, keep_outside, as given), never this machine's absolute path. Relative paths, Hub ids and other
    text stay as given."""
    path = Path(str(value)).expanduser()
    if not path.is_absolute():
        return str(value)
    try:
        return path.resolve().relative_to(ROOT).as_posix() or "."
    except ValueError:
        return str(value) if keep_outside else f"<local>/{path.name}"


def is_hub_id(value: str) -> bool:
    """`name` or `owner/name` as the Hub spells them, and not a typo in a local path (`data/tiny-targt`
    when `data/` is a local folder)."""
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    owner = value.split("/")[0]
    return "/" not in value or not any((base / owner).is_dir() for base in (Path.cwd(), ROOT))


TARGET_FLAGS = ("target", "model.target", "verifier")  # a target LLM folder, never one of our outputs


def _refuse_non_target(folder: Path, value: str, what: str) -> None:
    """A drafter, run, dataset or cache folder given as the target: say what it is, before the
    loader's own error (cut mid-sentence: "Couldn't instantiate the backend tokenizer from one of:")."""
    kind = marker_kind(folder)
    if kind in KINDS:  # our outputs; a model make real-target converted (kind "real-target") is a target
        raise UserError(f"{what} '{value}' holds {KINDS[kind]} written by dflash-train, not a target model")
    if not any((folder / name).is_file()
               for name in ("config.json", "tokenizer_config.json", "tokenizer.json")):
        raise UserError(f"{what} '{value}' is not a model folder: it has no config.json and no tokenizer")


def model_source(value: str, what: str) -> str:
    """A model or drafter given as a folder or a Hub id -> the folder's absolute path or the id.
    A path that is not there is 'not found', never a Hub error."""
    resolved = resolve_input(value)
    if Path(resolved).is_dir():
        if what in TARGET_FLAGS:
            _refuse_non_target(Path(resolved), value, what)
        return resolved
    if Path(resolved).exists():
        raise UserError(f"{what} '{value}' is a file, not a model folder")
    if not is_hub_id(value):
        raise UserError(f"{what} not found: '{value}' (no such folder)")
    return value
