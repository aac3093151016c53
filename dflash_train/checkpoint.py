"""Build a drafter for a target, and save/load drafter folders (our training format).

A drafter folder holds:
    model.safetensors  the trainable weights only, Speculators names (fc, hidden_norm, layers.N.*, norm)
    config.json        {"format": "dflash-train", "drafter": DrafterConfig, "target": {name_or_path, revision}}
    recipe.yaml        the recipe that trained it (when it came from training)
Folders are written to a temporary sibling and renamed, so a reader never sees half a drafter.
"""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_train.config import ModelConfig
from dflash_train.errors import UserError
from dflash_train.model import DFlashDrafter, DrafterConfig
from dflash_train.target import Target, build_target_layer_ids, check_tap_layers

FORMAT = "dflash-train"


def mask_token_id(target: Target, mask_token: str) -> int:
    tok = target.tokenizer
    ids = tok.convert_tokens_to_ids([mask_token])
    if ids[0] is None or ids[0] == tok.unk_token_id or mask_token not in tok.get_vocab():
        raise UserError(f"the target's tokenizer has no mask token '{mask_token}' "
                        "(add it as a special token, as DFlash does for Qwen3's <|MASK|>)")
    if ids[0] >= target.model.config.vocab_size:
        raise UserError(f"mask token '{mask_token}' id {ids[0]} is outside the target's "
                        f"embedding table ({target.model.config.vocab_size} rows)")
    return ids[0]


def drafter_config_for(target: Target, m: ModelConfig) -> DrafterConfig:
    """The drafter's shape follows the target (it shares its embeddings and LM head)."""
    tc = target.model.config
    layer_ids = m.target_layer_ids or build_target_layer_ids(tc.num_hidden_layers, m.num_layers)
    check_tap_layers(layer_ids, tc.num_hidden_layers)
    return DrafterConfig(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_hidden_layers=m.num_layers,
        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim, vocab_size=tc.vocab_size, block_size=m.block_size,
        mask_token_id=mask_token_id(target, m.mask_token), target_layer_ids=list(layer_ids),
        num_target_layers=tc.num_hidden_layers, rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings, rope_parameters=dict(tc.rope_parameters),
        attention_bias=tc.attention_bias,
    )


def check_matches_target(cfg: DrafterConfig, target: Target) -> None:
    """A drafter only works with a target of the same hidden size, vocabulary and depth."""
    tc = target.model.config
    for name, mine, theirs in [("hidden size", cfg.hidden_size, tc.hidden_size),
                               ("vocabulary size", cfg.vocab_size, tc.vocab_size),
                               ("layer count", cfg.num_target_layers, tc.num_hidden_layers)]:
        if mine != theirs:
            raise UserError(f"drafter does not match target '{target.name_or_path}': {name} {mine} vs {theirs}")


def write_atomically(out: Path, write) -> None:
    """Run write(tmp) on a temporary sibling folder, then rename it to `out`."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_drafter(folder: Path, drafter: DFlashDrafter, target: Target, recipe_yaml: str | None = None) -> None:
    state = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
    meta = {"format": FORMAT, "drafter": drafter.config.to_dict(),
            "target": {"name_or_path": target.name_or_path, "revision": target.revision}}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    if recipe_yaml is not None:
        (folder / "recipe.yaml").write_text(recipe_yaml)


def save_drafter(out: Path, drafter: DFlashDrafter, target: Target, recipe_yaml: str | None = None) -> None:
    write_atomically(out, lambda tmp: write_drafter(tmp, drafter, target, recipe_yaml))


def load_drafter(path: str | Path) -> tuple[DFlashDrafter, dict]:
    """Load a drafter folder; every weight name and shape must match its config."""
    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise UserError(f"'{path}' is not a drafter folder (needs config.json and model.safetensors)")
    meta = json.loads(cfg_file.read_text())
    if meta.get("format") != FORMAT:
        raise UserError(f"'{path}' is not a {FORMAT} drafter (config.json format: {meta.get('format')!r})")
    drafter = DFlashDrafter(DrafterConfig(**meta["drafter"]))
    state = load_file(weights)
    expected = drafter.state_dict()
    missing, extra = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing or extra:
        raise UserError(f"'{path}' weights do not match its config: missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(extra)[:3]}")
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise UserError(f"'{path}' weight {k} has shape {tuple(v.shape)}, config says {tuple(expected[k].shape)}")
    drafter.load_state_dict(state)
    return drafter, meta


def count_parameters(drafter: torch.nn.Module) -> int:
    return sum(p.numel() for p in drafter.parameters())
