"""The frozen target: loading it safely, choosing tap layers and reading the taps.

Index convention (z-lab DFlash, see shared/reference/dflash.md): tap layer k is the raw
output of decoder layer k, which is `output_hidden_states[k + 1]` in transformers
(index 0 is the embedding output). The last entry of `output_hidden_states` is the
final-normed state in transformers, not a raw layer output, so the last decoder layer
cannot be tapped (the Speculators format cannot carry it either).
"""

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from dflash_train.core.errors import UserError
from dflash_train.core.outputs import MARKER
from dflash_train.core.paths import ROOT, display_path, is_hub_id, model_source, resolve_input

SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<sha>[0-9a-f]{40})")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default taps: one per drafter layer, evenly spaced over decoder layers 1..N-3.
    Qwen3-8B (36 layers) with 5 drafter layers -> [1, 9, 17, 25, 33]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def check_tap_layers(layer_ids: list[int], num_target_layers: int) -> None:
    if not layer_ids:
        raise UserError("model.target_layer_ids is empty: the drafter needs at least one tap")
    if len(set(layer_ids)) != len(layer_ids):
        raise UserError(f"model.target_layer_ids {layer_ids} has duplicates (the target has "
                        f"{num_target_layers} layers; use more layers or give distinct taps)")
    bad = [k for k in layer_ids if not 0 <= k <= num_target_layers - 2]
    if bad:
        raise UserError(f"model.target_layer_ids {bad} out of range: taps must be decoder layers "
                        f"0..{num_target_layers - 2} of this {num_target_layers}-layer target "
                        "(the last layer cannot be tapped)")


@dataclass
class Target:
    model: nn.Module  # a transformers *ForCausalLM, eval mode, no grads
    tokenizer: PreTrainedTokenizerBase
    name_or_path: str
    revision: str | None

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def embed(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()


TARGET_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def round_weights_to_bf16(model: nn.Module) -> None:
    """Round every floating-point parameter of `model` to its nearest bf16 value, kept in fp32: bf16
    weights with fp32 activations and sums, the way a CPU without native bf16 serves a bf16 checkpoint
    (llama.cpp's BF16 type does the same). The streaming linear then keeps a bf16 copy of each weight
    and reads half the bytes (dflash_train/model/cpu_linear.py); the model's numbers are those of the
    rounded weights in every forward, so lossless stays exact against its own plain decoding."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.bfloat16())


def native_bf16(device: str | torch.device) -> bool:
    """bf16 matmuls run natively: a CUDA GPU with bf16, or a CPU with AVX-512 BF16 / AMX (oneDNN)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def target_dtype(choice: str, device: str | torch.device) -> torch.dtype:
    """The frozen target's weights: `fp32`, `bf16`, or `auto` = bf16 on a GPU that has it, else fp32.
    A CPU with AVX-512 BF16 runs a bf16 forward about 3x faster (shared/reference/real-target.md), but
    bf16 there is asked for by name: it changes the target's numbers, which tests and lossless checks
    compare against. `native_bf16` says whether asking pays."""
    if choice == "auto":
        device = torch.device(device)
        return torch.bfloat16 if device.type == "cuda" and native_bf16(device) else torch.float32
    return TARGET_DTYPES[choice]


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# What transformers raises for a folder or Hub repo that is not a loadable model: missing files,
# a config it cannot parse or validate, a damaged safetensors file.
LOAD_ERRORS = (OSError, ValueError, StrictDataclassError, SafetensorError)


def load_target(name_or_path: str, *, revision: str | None = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", trust_remote_code: bool = False) -> Target:
    """Load a causal LM and its tokenizer, safetensors only, frozen. A local folder is recorded by its
    absolute path, a Hub id as given. A target whose weights do not fill its config exactly (missing,
    unexpected or mis-shaped tensors) is refused: transformers would initialise the gaps at random
    and only warn, and a drafter trained against that is worthless."""
    source = model_source(name_or_path, "target")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision,
                                                  trust_remote_code=trust_remote_code)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report is a table; ours is the line below
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                source, revision=revision, dtype=dtype, use_safetensors=True,
                trust_remote_code=trust_remote_code,
                attn_implementation="sdpa", output_loading_info=True, ignore_mismatched_sizes=True)
        finally:
            hf_logging.set_verbosity(verbosity)
    except LOAD_ERRORS as e:
        raise UserError(f"cannot load target '{name_or_path}': {first_line(e)}") from e
    bad = [(what, sorted(k if isinstance(k, str) else k[0] for k in info[key]))
           for what, key in [("missing", "missing_keys"), ("unexpected", "unexpected_keys"),
                             ("of the wrong shape", "mismatched_keys")] if info[key]]
    if bad:
        detail = "; ".join(f"{len(keys)} {what} (e.g. {keys[0]})" for what, keys in bad)
        raise UserError(f"target '{name_or_path}': its weights do not match its config.json: {detail}")
    model.to(device).eval().requires_grad_(False)
    return Target(model, tokenizer, source, revision)


def max_positions(source: str, revision: str | None = None, trust_remote_code: bool = False) -> int | None:
    """The target's max_position_embeddings, read from its config alone (no weights: a bound is
    checked before a multi-GB load). None for a local folder with no config.json (dflash-prepare
    takes a tokenizer-only folder) or a config that names no limit."""
    if Path(source).is_dir() and not (Path(source) / "config.json").is_file():
        return None
    try:
        config = AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    except LOAD_ERRORS as e:
        raise UserError(f"cannot load the config of target '{source}': {first_line(e)}") from e
    return config_positions(config)


def config_positions(config) -> int | None:
    # the text model's limit (a multimodal config nests it); an architecture may name none
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def check_positions(n: int, what: str, limit: int | None, target: str) -> None:
    """`n` tokens (a length, the new tokens of one reply) fit in the target's positions: past its
    max_position_embeddings its RoPE runs on angles it was never trained on (transformers only
    warns, or says nothing), so the states and answers there are not the target's."""
    if limit is not None and n > limit:
        raise UserError(f"{what} {n} is past the {limit} positions of target '{target}' (its "
                        f"max_position_embeddings): give at most {limit}")


def taps_from_hidden_states(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Concatenate decoder-layer outputs k (= hidden_states[k + 1]) -> [b, t, n*H]."""
    return torch.cat([hidden_states[k + 1] for k in layer_ids], dim=-1)


@torch.no_grad()
def target_forward(target: Target, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target trunk once. Returns taps [b, t, n*H] and the final-normed last
    hidden state [b, t, H]; apply `target.lm_head` only where logits are needed."""
    out = target.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                     output_hidden_states=True, use_cache=False)
    return taps_from_hidden_states(out.hidden_states, layer_ids), out.last_hidden_state


def model_identity(name_or_path: str, revision: str | None) -> tuple[str, str | None]:
    """(name, revision) to tell whether two mentions are the same model, without reading weights:
    a Hub cache snapshot folder is its repo id at its commit, another local folder its absolute path."""
    local = resolve_input(name_or_path)
    if Path(local).is_dir():
        m = SNAPSHOT.search(local)
        return (f"{m['org']}/{m['name']}", m["sha"]) if m else (local, None)
    return name_or_path, revision


def hash_files(files: list[Path]) -> str:
    """SHA-256 over each file's name and bytes, in order."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def hash_cache_file() -> Path:
    """DFLASH_HASH_CACHE, else ~/.cache/dflash-train/weight_hashes.json (XDG_CACHE_HOME respected)."""
    if os.environ.get("DFLASH_HASH_CACHE"):
        return Path(os.environ["DFLASH_HASH_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME")
                or Path.home() / ".cache") / "dflash-train" / "weight_hashes.json"


def weights_sha256(files: list[Path]) -> str:
    """hash_files, remembered per (path, size, mtime) of every file: re-pinning a 16 GB local
    verifier on each export took minutes; a file rewritten or touched is hashed again."""
    key = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    path = hash_cache_file()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    cache = cache if isinstance(cache, dict) else {}
    if isinstance(cache.get(key), str):
        return cache[key]
    cache[key] = digest = hash_files(files)
    try:  # write then rename: a concurrent reader sees the old cache or the new one, never half
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError:  # a read-only home: hash again next time
        pass
    return digest


def converted_model(folder: Path) -> dict:
    """What `make real-target` recorded of a model folder it converted (hub_id, converted_from); {} for
    any other folder."""
    try:
        record = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict) or record.get("kind") != "real-target" or not isinstance(
            record.get("hub_id"), str) or not is_hub_id(record["hub_id"]):
        return {}
    return {k: record[k] for k in ("hub_id", "converted_from") if isinstance(record.get(k), str)}


def resolve_pin(verifier: str, revision: str | None) -> dict:
    """How the verifier is pinned: an explicit revision, the commit of a Hub cache snapshot, or
    (plain local folder) the SHA-256 of its safetensors files. A folder `make real-target` converted
    is named by its Hub id (as a published drafter names its verifier), pinned by that SHA-256:
    its weights are the converted ones, which the Hub's own files need not equal byte for byte."""
    if revision:
        return {"name_or_path": verifier, "kind": "revision", "revision": revision}
    local = Path(verifier)
    if local.is_dir():
        m = SNAPSHOT.search(str(local.resolve()))
        if m:
            return {"name_or_path": f"{m['org']}/{m['name']}", "kind": "hub_snapshot", "revision": m["sha"]}
        files = sorted(local.glob("*.safetensors"))
        if not files:
            raise UserError(f"cannot pin verifier '{verifier}': no safetensors weights to hash")
        about = converted_model(local)
        return {"name_or_path": about.get("hub_id", verifier), "kind": "content_sha256", "revision": None,
                "sha256": weights_sha256(files), "files": [f.name for f in files]} | (
                    {"converted_from": about["converted_from"]} if "converted_from" in about else {})
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(verifier, "config.json")
    m = SNAPSHOT.search(str(cached)) if isinstance(cached, str) else None
    if not m:
        raise UserError(f"cannot pin verifier '{verifier}': not in the local Hub cache; pass "
                        "--verifier-revision")
    return {"name_or_path": verifier, "kind": "hub_snapshot", "revision": m["sha"]}


def pinned_by_content(pin: dict | None) -> bool:
    return (isinstance(pin, dict) and pin.get("kind") == "content_sha256"
            and isinstance(pin.get("sha256"), str))


def matches_pin(folder: Path, pin: dict) -> bool:
    """The folder's safetensors files are the pinned ones: same names, same SHA-256."""
    files = sorted(folder.glob("*.safetensors"))
    return bool(files) and [f.name for f in files] == list(pin.get("files") or [f.name for f in files]) \
        and weights_sha256(files) == pin["sha256"]


CONVERTED_DIR = ROOT / "data" / "real"  # where `make real-target` converts models (data/real_target.py)


def local_candidates() -> list[Path]:
    """Where a converted verifier may be: the models `make real-target` wrote under data/real/."""
    base = CONVERTED_DIR
    return sorted(p for p in base.iterdir() if p.is_dir() and converted_model(p)) if base.is_dir() else []


def locate_verifier(name: str, pin: dict | None, flag: str) -> tuple[str, str | None]:
    """The folder or Hub id to load a drafter's verifier from -> (source, what was chosen, or None).
    A drafter exported against a model `make real-target` converted names it by Hub id and pins it by
    the converted weights' SHA-256, which the Hub's files do not have: the verifier is the local
    folder whose weights match that pin, on any machine. Anything else is loaded as named."""
    if not pinned_by_content(pin) or not is_hub_id(name) or Path(resolve_input(name)).exists():
        return name, None
    for folder in local_candidates():
        if matches_pin(folder, pin):
            return str(folder), (f"verifier {name}: the local folder {display_path(folder)}, whose weights "
                                 f"match its pin (sha256 {pin['sha256'][:12]})")
    how = f" ({pin['converted_from']})" if pin.get("converted_from") else ""
    raise UserError(f"verifier '{name}' is pinned by the sha256 of converted weights{how}, "
                    f"{pin['sha256'][:12]}..., and no local folder has them: run `make real-target`, or "
                    f"pass {flag} FOLDER")
