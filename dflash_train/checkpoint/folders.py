"""Save and load drafter folders (our training format), and training checkpoints for an exact
resume. Building a drafter for a target: training/build.py.

A drafter folder holds:
    model.safetensors  the trainable weights only, Speculators names (fc, hidden_norm, layers.N.*, norm)
    config.json        {"format": "dflash-train", "drafter": DrafterConfig,
                        "target": {name_or_path, revision}}
    recipe.yaml        the recipe that trained it (when it came from training)
Folders are written to a temporary sibling and renamed, so a reader never sees half a drafter.
"""

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash_train.checkpoint.formats import drafter_config_from, read_config
from dflash_train.core.errors import UserError
from dflash_train.core.outputs import match_umask, write_atomically
from dflash_train.core.paths import model_source
from dflash_train.core.schema import read_json, validated
from dflash_train.model.drafter import DFlashDrafter, DrafterConfig
from dflash_train.model.target import Target, first_line
from dflash_train.model.vocab import draft_vocab_from_tensors

FORMAT = "dflash-train"
# Tensors a Speculators checkpoint may carry that belong to the verifier, not the drafter.
SPECULATORS_VERIFIER_KEYS = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                             "verifier_norm.weight", "d2t", "t2d"}


def mask_token_text(tokenizer, mask_id: int) -> str | None:
    return tokenizer.convert_ids_to_tokens(mask_id) if mask_id < len(tokenizer) else None


def check_matches_target(cfg: DrafterConfig, target: Target) -> None:
    """A drafter only works with a target of the same hidden size, vocabulary and depth."""
    tc = target.model.config
    for name, mine, theirs in [("hidden size", cfg.hidden_size, tc.hidden_size),
                               ("vocabulary size", cfg.vocab_size, tc.vocab_size),
                               ("layer count", cfg.num_target_layers, tc.num_hidden_layers)]:
        if mine is not None and mine != theirs:
            raise UserError(f"drafter does not match target '{target.name_or_path}': {name} {mine} vs "
                            f"{theirs}")


def write_drafter(folder: Path, drafter: DFlashDrafter, target: Target, recipe_yaml: str | None = None,
                  state: dict | None = None) -> None:
    """`state` overrides drafter.state_dict(): under FSDP / ZeRO-3 the full weights come from
    accelerator.get_state_dict, gathered by every process."""
    state = {k: v.detach().to("cpu").contiguous() for k, v in (state or drafter.state_dict()).items()}
    meta = {"format": FORMAT, "drafter": drafter.config.to_dict(),
            "target": {"name_or_path": target.name_or_path, "revision": target.revision},
            # None when the mask is an embedding row beyond the tokenizer (Qwen3's 151669)
            "mask_token": mask_token_text(target.tokenizer, drafter.config.mask_token_id)}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    if recipe_yaml is not None:
        (folder / "recipe.yaml").write_text(recipe_yaml)


def save_drafter(out: Path, drafter: DFlashDrafter, target: Target, recipe_yaml: str | None = None,
                 state: dict | None = None) -> None:
    write_atomically(out, lambda tmp: write_drafter(tmp, drafter, target, recipe_yaml, state), "drafter")


def trained_for(folder: Path) -> dict:
    """What a drafter folder's training recipe (ours: recipe.yaml; an export: training_recipe.yaml)
    says it was trained for: {"deploy_budget": int or None, "tree_distill": its section or None,
    "distilled": distilled_steps(folder) when the recipe distils trees, else None}."""
    import yaml

    recipe = {}
    for name in ("recipe.yaml", "training_recipe.yaml"):
        if (folder / name).is_file():
            recipe = yaml.safe_load((folder / name).read_text()) or {}
            break
    trained = recipe_trained_for(recipe)
    return trained | {"distilled": distilled_steps(folder) if trained["tree_distill"] else None}


def distilled_steps(folder: Path) -> dict | None:
    """How many optimizer steps distilled trees into a drafter folder of a training run (final/: the
    whole run; checkpoints/step_N/: steps up to N), from the run's metrics.jsonl, where a step whose
    trees had nodes carries tree_agree -> {"distilled": n, "steps": m}. None where no run's metrics
    are beside the folder (a copy, an export, a Hub drafter): a recipe says what was asked, only
    the metrics say what happened."""
    folder = Path(folder).resolve()
    if folder.name == "final":
        run, last = folder.parent, None
    elif folder.parent.name == "checkpoints" and CHECKPOINT_NAME.fullmatch(folder.name):
        run, last = folder.parent.parent, int(CHECKPOINT_NAME.fullmatch(folder.name)[1])
    else:
        return None
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        steps = [r for r in map(json.loads, filter(str.strip, lines)) if last is None or r["step"] <= last]
        return {"distilled": sum("tree_agree" in r for r in steps), "steps": len(steps)}
    except (OSError, ValueError, TypeError, KeyError):  # absent or damaged: unknown, not zero
        return None


def recipe_trained_for(r: dict) -> dict:
    """trained_for from a recipe already read (a dict)."""
    td = r.get("tree_distill") or {}
    return {"deploy_budget": (r.get("eval") or {}).get("deploy_budget"),
            "tree_distill": td if td.get("weight") else None}


def resolve_folder(path_or_id: str | Path) -> Path:
    """A local folder, or a Hub id fetched (safetensors and json only) into the Hub cache."""
    source = model_source(str(path_or_id), "drafter")
    if Path(source).is_dir():
        return Path(source)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # offline, missing, gated
        raise UserError(f"drafter '{path_or_id}' is not a local folder and cannot be fetched from the Hub: "
                        f"{type(e).__name__}") from e


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:  # truncated, garbage, unreadable
        raise UserError(f"'{path}' is not a readable safetensors file ({first_line(e)})") from None


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards listed in model.safetensors.index.json."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"'{index}' is not a safetensors index (no weight_map)") from e
        return {k: v for shard in shards for k, v in read_safetensors(folder / shard).items()}
    if not (folder / "model.safetensors").is_file():
        raise UserError(f"'{folder}' is not a drafter folder (no model.safetensors)")
    return read_safetensors(folder / "model.safetensors")


def _tokens_kept(name: str, t: torch.Tensor) -> int:
    if name == "t2d":  # [V] marks of the kept target ids
        return int(t.sum())
    return t.shape[0] if t.dim() else 1  # d2t [N], lm_head [N, H]


def check_no_draft_vocab_tensors(state: dict[str, torch.Tensor], cfg: DrafterConfig, path) -> None:
    """A config without a draft vocabulary, weights with one (a Speculators config that lost its
    draft_vocab_size): the drafter would be read as a full-vocabulary one, its own head and maps
    dropped as the verifier's. Tensors of the whole vocabulary (the verifier's head, identity maps:
    speculators ignores those too) say nothing against the config."""
    if cfg.draft_vocab_size is not None:
        return
    V = cfg.vocab_size
    found = {name: _tokens_kept(name, state[name]) for name in ("d2t", "t2d", "lm_head.weight")
             if name in state}
    smaller = [n for n in found.values() if n < V]
    if smaller:
        raise UserError(f"'{path}': the config and the weights disagree: the config gives "
                        f"no draft vocabulary (no draft_vocab_size below {V}), the weights carry one of "
                        f"{max(smaller)} tokens ({', '.join(sorted(found))}): set draft_vocab_size in its "
                        f"config.json, or drop them")


def load_drafter(path: str | Path) -> tuple[DFlashDrafter, dict]:
    """Load a drafter in our format, the Speculators format or the native DFlash format
    (a folder or a Hub id). Every weight name and shape must match its config.
    Returns the drafter and its provenance (format, target, mask token)."""
    folder = resolve_folder(path)
    cfg, meta = drafter_config_from(read_config(folder))
    drafter = DFlashDrafter(cfg)
    state = read_weights(folder)
    expected = drafter.state_dict()
    check_no_draft_vocab_tensors(state, cfg, path)
    # Speculators may also save verifier-owned tensors (embeddings, LM head): not ours to load,
    # unless the drafter has a draft vocabulary, whose lm_head / d2t / t2d are its own.
    state = {k: v for k, v in state.items() if k not in SPECULATORS_VERIFIER_KEYS or k in expected}
    missing, extra = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing or extra:
        raise UserError(f"'{path}' weights do not match its config: missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(extra)[:3]}")
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise UserError(f"'{path}' weight {k} has shape {tuple(v.shape)}, config says "
                            f"{tuple(expected[k].shape)}")
    if cfg.draft_vocab_size is not None:  # a d2t / t2d pair that disagrees would serve wrong tokens
        draft_vocab_from_tensors(state["d2t"], state["t2d"], f"'{path}'")
    drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return drafter, meta


def drafter_fingerprint(drafter: torch.nn.Module) -> str:
    """SHA-256 over the drafter's tensors (name, dtype, shape, bytes) in name order. The three
    formats hold the same tensors under the same names, so an export of a drafter has the
    fingerprint of the drafter it came from: eval reports record it, the exporter checks it."""
    h = hashlib.sha256()
    for name, t in sorted(drafter.state_dict().items()):
        t = t.detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def count_parameters(drafter: torch.nn.Module) -> int:
    """Trainable parameters (a draft vocabulary's frozen head is the target's rows, not counted)."""
    return sum(p.numel() for p in drafter.parameters() if p.requires_grad)


# --- training checkpoints: everything an exact resume needs --------------------------------------

def write_checkpoint(folder: Path, drafter: DFlashDrafter, target: Target, recipe_yaml: str, state: dict,
                     weights: dict | None = None) -> None:
    """Into `folder` (a temporary folder the trainer renames to checkpoints/step_N/ when complete):
    the drafter (loadable like final/) plus `state` (step, optimizer, scheduler, data position,
    counters); trainer_state.json last, so it marks a complete checkpoint."""
    write_drafter(folder, drafter, target, recipe_yaml, weights)
    torch.save(state, folder / "trainer_state.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"step": state["step"]}) + "\n")
    match_umask(folder)  # safetensors writes 0600


CHECKPOINT_NAME = re.compile(r"step_(\d+)")  # as the trainer names them: step_000012


class StepMarker(BaseModel):
    """trainer_state.json: written last, it marks a complete checkpoint."""
    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=1)


class TrainerState(BaseModel):
    """trainer_state.pt: what an exact resume needs besides the weights."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    step: int = Field(ge=1)
    epoch: int = Field(ge=0)
    batches_in_epoch: int = Field(ge=0)
    tokens: int = Field(ge=0)
    train_time: float = Field(ge=0)
    scheduler: dict[str, Any]
    optimizer: dict[str, Any] | None  # None under DeepSpeed (its engine keeps its own)
    engine: Literal["single", "ddp", "fsdp", "deepspeed"]
    markov_embed: dict[str, Any] | None = None  # model.markov_w1_embed: SharedW1's optimizer and schedule


def newest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint: a folder named as the trainer names them (a copy such as
    step_000002.bak and temporary folders of interrupted writes are ignored)."""
    done = [p for p in (out / "checkpoints").glob("step_*")
            if CHECKPOINT_NAME.fullmatch(p.name) and (p / "trainer_state.json").is_file()]
    return max(done, key=lambda p: int(CHECKPOINT_NAME.fullmatch(p.name)[1]), default=None)


def load_checkpoint(folder: Path) -> tuple[dict, dict]:
    """-> (drafter weights, trainer state). The state holds tensors, numbers and dicts only, and
    is checked against TrainerState (a violation names the file and the field)."""
    marker = read_json(folder / "trainer_state.json", StepMarker)
    weights = read_safetensors(folder / "model.safetensors")
    try:
        state = torch.load(folder / "trainer_state.pt", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged pickle
        raise UserError(f"checkpoint '{folder}' is damaged ({type(e).__name__}: {first_line(e)}): "
                        "delete it to resume from the one before") from None
    validated(TrainerState, state, f"'{folder / 'trainer_state.pt'}'")
    if state["step"] != marker.step:
        raise UserError(f"checkpoint '{folder}' is damaged: trainer_state.pt is of step {state['step']}, "
                        f"trainer_state.json of step {marker.step}")
    return weights, state


def size_mismatch(sizes: list[tuple[str, int | None, int]]) -> tuple[str, int, int] | None:
    """The drafter-against-a-model shape check (resuming, exporting): sizes as (name, mine, theirs) ->
    the first that differs, or None. Mine None is a size the drafter does not record: not compared.
    The callers word the error, each for its own situation."""
    return next(((name, mine, theirs) for name, mine, theirs in sizes
                 if mine is not None and mine != theirs), None)


def check_resumable(folder: Path, drafter: DFlashDrafter) -> None:
    """A checkpoint resumes only into a drafter of its own shape (the target folder may have changed
    since: another hidden size would fail deep inside load_state_dict)."""
    saved, _ = drafter_config_from(read_config(folder))
    fields = [("hidden size", "hidden_size"), ("vocabulary size", "vocab_size"),
              ("intermediate size", "intermediate_size"), ("layer count", "num_hidden_layers")]
    differs = size_mismatch([(name, getattr(drafter.config, f), getattr(saved, f)) for name, f in fields])
    if differs:
        name, mine, theirs = differs
        raise UserError(f"cannot resume from {folder}: it holds a drafter of {name} {theirs}, the target "
                        f"now gives {mine} (the target changed since?)")
