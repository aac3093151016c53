"""Drafter checkpoint formats: ours, Speculators (`vllm serve <dir>`) and native DFlash (z-lab,
vLLM `method: dflash`). All three store the same tensors under the same names
(fc, hidden_norm, layers.N.*, norm); only config.json differs. DSpark drafters add
markov_head.* and confidence_head.* and travel as ours or Speculators `dspark` (served by
vLLM as `method: dspark`); DFlash2 drafters add layers.N.{attention_conv, mlp_conv}.* and
candidate_selector.* and travel as ours or Speculators `dflash2` (vLLM 0.33 reads it as
`DFlash2DraftModel`, method dflash); XPress drafters add refiner_head.* and travel as ours or
Speculators `xpress` (no released vLLM serves it); the native DFlash format has no place for these.

Layer ids: ours and native DFlash store z-lab `target_layer_ids` (tap k = decoder layer k =
transformers hidden_states[k+1]); Speculators stores `aux_hidden_state_layer_ids` = those + 1.

In-block attention, as vLLM 0.33 derives it (`_dflash_layer_causal` in qwen3_dflash.py: the
draft config's top-level `is_causal` wins, then `dflash_config.causal`, then "causal only for
sliding-window layers"; for Speculators configs `update_dflash` sets `dflash_config.causal =
not sliding_window_non_causal`, defaulting to True when the key is absent). So both exports
state it explicitly: `is_causal` (in transformer_layer_config for Speculators, top level for
native), `dflash_config.causal` (native) and `sliding_window_non_causal = not causal`
(Speculators). speculators' own DFlash model only applies causality to sliding-window
layers, so it runs a causal drafter's full-attention layers bidirectionally.
"""

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from dflash_train.core.errors import UserError
from dflash_train.core.schema import Index, Open, Size, Strict, validated
from dflash_train.model.drafter import DrafterConfig
from dflash_train.model.variants import VARIANTS, VariantName, variant_bases

OURS, SPECULATORS, NATIVE = "dflash-train", "speculators", "dflash"

# DrafterConfig fields that are plain Qwen3 config fields of the drafter's layers
QWEN3_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                "rope_parameters", "attention_bias")


# --- schemas: every config.json is checked before it is read (read_config) --------------------

def check_sizes(vocab: int, mask_id: int, taps: list[int], layers: int | None) -> None:
    """What the tensors need: the mask is an embedding row, the taps are layers of the target (a variant's
    fields: Variant.check, check_speculators)."""
    if mask_id >= vocab:
        raise ValueError(f"mask_token_id {mask_id} is not a row of the {vocab}-token vocabulary")
    if layers is not None and max(taps) >= layers:
        raise ValueError(f"tapped layer {max(taps)} is beyond the target's {layers} layers")


def check_draft_vocab(size: int | None, vocab: int, variant: str) -> None:
    """A draft vocabulary is 2..V tokens, for the variants that draft in one (Variant.draft_vocab: not
    DFlash2, whose selector's codebook is a [V, r] table over the full vocabulary)."""
    if size is None:
        return
    if not 2 <= size < vocab:  # N = V is written as no draft vocabulary (null)
        raise ValueError(f"draft_vocab_size {size} must be in 2..{vocab - 1} (below the verifier's "
                         "vocabulary)")
    if not VARIANTS[variant].draft_vocab:
        raise ValueError(f"a {variant} drafter drafts over the full vocabulary: draft_vocab_size {size} < "
                         f"{vocab}")


class BackboneFields(Strict):
    """Ours: config.json's `drafter`, BackboneConfig field for field (model/drafter.py says what each
    means)."""
    hidden_size: Size
    intermediate_size: Size
    num_hidden_layers: Size
    num_attention_heads: Size
    num_key_value_heads: Size
    head_dim: Size
    vocab_size: Size
    block_size: Annotated[int, Field(ge=2)]
    mask_token_id: Index
    target_layer_ids: Annotated[list[Index], Field(min_length=1)]
    num_target_layers: Size | None
    rms_norm_eps: Annotated[float, Field(gt=0)] = 1e-6
    max_position_embeddings: Size = 40960
    rope_parameters: dict = {"rope_type": "default", "rope_theta": 1e6}
    attention_bias: bool = False
    block_attention: Literal["bidirectional", "causal"] = "bidirectional"
    variant: VariantName = "dflash"


class DrafterFields(*variant_bases("drafter_keys"), BackboneFields):
    """Ours: config.json's `drafter`, DrafterConfig field for field: the backbone's, each variant's
    (Variant.drafter_keys), the draft vocabulary."""
    draft_vocab_size: Annotated[int, Field(ge=2)] | None = None

    @model_validator(mode="after")
    def _fits(self):
        check_draft_vocab(self.draft_vocab_size, self.vocab_size, self.variant)
        VARIANTS[self.variant].check(self)
        check_sizes(self.vocab_size, self.mask_token_id, self.target_layer_ids, self.num_target_layers)
        return self


class TargetRef(Open):
    name_or_path: str | None = None
    revision: str | None = None


class OursFile(Open):
    format: Literal["dflash-train"]
    drafter: DrafterFields
    target: TargetRef | None = None
    mask_token: str | None = None


class LayerFields(Open):
    """The Qwen3 fields of the drafter's layers (speculators' transformer_layer_config, native's top
    level)."""
    hidden_size: Size
    intermediate_size: Size
    num_hidden_layers: Size
    num_attention_heads: Size
    num_key_value_heads: Size
    head_dim: Size | None = None
    vocab_size: Size
    rms_norm_eps: Annotated[float, Field(gt=0)] = 1e-6
    max_position_embeddings: Size = 40960
    is_causal: bool | None = None


class ExtraFields(Open):  # the `dflash_train` block both exports carry
    num_target_layers: Size | None = None
    mask_token: str | None = None


class SpeculatorsCore(Open):
    """A Speculators config.json's keys every variant has (SpeculatorsFile adds each variant's)."""
    speculators_model_type: VariantName
    transformer_layer_config: LayerFields
    block_size: Annotated[int, Field(ge=2)]
    mask_token_id: Index
    aux_hidden_state_layer_ids: Annotated[list[Size], Field(min_length=1)]  # taps + 1
    dflash_train: ExtraFields | None = None
    verifier_pin: dict | None = None
    sample_from_anchor: bool | None = None
    draft_vocab_size: Size | None = None


class SpeculatorsFile(*variant_bases("speculators_keys"), SpeculatorsCore):
    """Each variant's keys (Variant.speculators_keys) after the core's."""

    @model_validator(mode="after")
    def _fits(self):
        extra = self.dflash_train or ExtraFields()
        check_sizes(self.transformer_layer_config.vocab_size, self.mask_token_id,
                    [i - 1 for i in self.aux_hidden_state_layer_ids], extra.num_target_layers)
        VARIANTS[self.speculators_model_type].check_speculators(self)
        return self


class NativeBlock(Open):  # dflash_config
    mask_token_id: Index
    target_layer_ids: Annotated[list[Index], Field(min_length=1)]
    causal: bool | None = None
    block_size: Annotated[int, Field(ge=2)] | None = None


class NativeFile(LayerFields):
    architectures: list[str]
    dflash_config: NativeBlock
    block_size: Annotated[int, Field(ge=2)] | None = None
    num_target_layers: Size | None = None
    verifier_pin: dict | None = None
    dflash_train: ExtraFields | None = None

    @model_validator(mode="after")
    def _fits(self):
        if self.block_size is None and self.dflash_config.block_size is None:
            raise ValueError("no block_size (neither top level nor in dflash_config)")
        check_sizes(self.vocab_size, self.dflash_config.mask_token_id, self.dflash_config.target_layer_ids,
                    self.num_target_layers)
        return self


SCHEMAS = {OURS: OursFile, SPECULATORS: SpeculatorsFile, NATIVE: NativeFile}


def detect_format(config: dict) -> str:
    if config.get("format") == OURS:
        return OURS
    if config.get("speculators_model_type") in VARIANTS:
        return SPECULATORS
    if "DFlashDraftModel" in (config.get("architectures") or []) and "dflash_config" in config:
        return NATIVE
    raise UserError("config.json is not a DFlash drafter in any known format "
                    f"(dflash-train, speculators {', '.join(map(repr, VARIANTS))}, or "
                    f"native DFlashDraftModel)")


def _block_attention(causal) -> str:
    return "causal" if causal else "bidirectional"


def _qwen3(fields: dict) -> dict:
    out = {k: fields[k] for k in QWEN3_FIELDS if k in fields}
    if "rope_parameters" not in out and "rope_theta" in fields:  # configs written before transformers 5
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": fields["rope_theta"]}
    out.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    return out


def drafter_config_from(config: dict) -> tuple[DrafterConfig, dict]:
    """config.json of any format -> (DrafterConfig, provenance: target, recipe, pin, format)."""
    fmt = detect_format(config)
    try:
        if fmt == OURS:
            return (DrafterConfig(**config["drafter"]),
                    {"format": fmt, **{k: config.get(k) for k in ("target", "mask_token")}})
        if fmt == SPECULATORS:
            tl = config["transformer_layer_config"]
            extra = config.get("dflash_train", {})
            # speculators runs full-attention layers bidirectionally; an explicit is_causal (ours) says
            # otherwise
            cfg = DrafterConfig(**_qwen3(tl), block_size=config["block_size"],
                                mask_token_id=config["mask_token_id"],
                                target_layer_ids=[i - 1 for i in config["aux_hidden_state_layer_ids"]],
                                num_target_layers=extra.get("num_target_layers"),
                                block_attention=_block_attention(tl.get("is_causal")),
                                **VARIANTS[config["speculators_model_type"]].from_speculators(config),
                                draft_vocab_size=_speculators_draft_vocab(config))
            verifier = config.get("speculators_config", {}).get("verifier", {})
            pin = config.get("verifier_pin") or {}
            return cfg, {"format": fmt, "target": {"name_or_path": verifier.get("name_or_path"),
                                                   "revision": pin.get("revision"), "pin": pin or None},
                         "mask_token": extra.get("mask_token")}
        dflash = config["dflash_config"]
        block = config.get("block_size") or dflash["block_size"]
        # as vLLM resolves it for full-attention layers: is_causal, then dflash_config.causal, else non-causal
        causal = config.get("is_causal")
        cfg = DrafterConfig(**_qwen3(config), block_size=block, mask_token_id=dflash["mask_token_id"],
                            target_layer_ids=list(dflash["target_layer_ids"]),
                            num_target_layers=config.get("num_target_layers"),
                            block_attention=_block_attention(dflash.get("causal") if causal is None
                                                             else causal))
        pin = config.get("verifier_pin") or {}
        return cfg, {"format": fmt,
                     "target": {"name_or_path": pin.get("name_or_path"), "revision": pin.get("revision"),
                                "pin": pin or None},
                     "mask_token": (config.get("dflash_train") or {}).get("mask_token")}
    except (KeyError, TypeError) as e:
        raise UserError(f"{fmt} config.json is missing or has a malformed field: {e}") from e


def _speculators_draft_vocab(config: dict) -> int | None:
    """A Speculators config's draft vocabulary: None when it is the verifier's whole vocabulary."""
    vocab, size = config["transformer_layer_config"]["vocab_size"], config.get("draft_vocab_size")
    if size is None or size == vocab:
        return None
    if size > vocab:
        raise UserError(f"Speculators config has draft_vocab_size {size} above the verifier's vocabulary "
                        f"({vocab})")
    return size  # below it: a variant without one (DFlash2) refuses it in its from_speculators


def speculators_config(cfg: DrafterConfig, verifier: str, verifier_architectures: list[str], pin: dict,
                       mask_token: str | None):
    """The Speculators config, built with speculators' own classes (what vLLM reads): the variant's
    (Variant.speculators_config_class: DFlash, DSpark, DFlash2 or XPress SpeculatorConfig)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    causal = cfg.block_attention == "causal"
    layer_config = cfg.qwen3_config()
    layer_config.is_causal = causal  # vLLM reads it before anything else (see the module docstring)
    config_class = VARIANTS[cfg.variant].speculators_config_class()
    return config_class(
        **VARIANTS[cfg.variant].speculators_fields(cfg),
        transformer_layer_config=layer_config,
        # full vocabulary: no lm_head / d2t / t2d are saved; a draft vocabulary's are (vLLM reads
        # d2t as draft_id_to_target_id and would fall back to the verifier's full head without lm_head)
        draft_vocab_size=cfg.draft_vocab_size or cfg.vocab_size,
        block_size=cfg.block_size,
        target_hidden_size=cfg.hidden_size,
        aux_hidden_state_layer_ids=[k + 1 for k in cfg.target_layer_ids],
        mask_token_id=cfg.mask_token_id,
        sample_from_anchor=False,  # block slot 0 is the bonus token: B-1 speculative tokens
        # vLLM: dflash_config.causal = not this (absent: causal); speculators: SWA layers only
        sliding_window_non_causal=not causal,
        speculators_config=SpeculatorsConfig(
            algorithm=cfg.variant,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=cfg.block_size - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=verifier_architectures),
        ),
        # speculators' VerifierConfig has no revision field: the pin rides along as extra keys
        verifier_pin=pin,
        dflash_train={"num_target_layers": cfg.num_target_layers, "mask_token": mask_token},
    )


def native_config(cfg: DrafterConfig, pin: dict, mask_token: str | None) -> dict:
    """The z-lab DFlash config.json: Qwen3 fields of the drafter + block_size + dflash_config.
    No auto_map: we do not ship z-lab's modelling code (vLLM reads `architectures`)."""
    qwen3 = cfg.qwen3_config()
    # the fields that differ from Qwen3's defaults, plus the shape fields written out explicitly
    q = {**qwen3.to_diff_dict(), **{k: getattr(qwen3, k) for k in QWEN3_FIELDS},
         "hidden_act": qwen3.hidden_act}
    for k in ("architectures", "auto_map", "transformers_version", "dtype", "torch_dtype"):
        q.pop(k, None)
    causal = cfg.block_attention == "causal"
    return {"architectures": ["DFlashDraftModel"], **q, "model_type": "qwen3", "block_size": cfg.block_size,
            "num_target_layers": cfg.num_target_layers, "tie_word_embeddings": False,
            "is_causal": causal,  # vLLM reads it first; z-lab configs omit it (non-causal full layers)
            "dflash_config": {"mask_token_id": cfg.mask_token_id,
                              "target_layer_ids": list(cfg.target_layer_ids), "causal": causal},
            "verifier_pin": pin, "dflash_train": {"mask_token": mask_token}}


def read_config(folder: Path) -> dict:
    """config.json, checked against its format's schema (unknown variant, sizes that do not fit:
    one line naming the file and the field, before any tensor is built)."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"'{folder}' is not a drafter folder (no readable config.json)") from e
    if not isinstance(config, dict):
        raise UserError(f"'{path}' is not a JSON object")
    try:
        fmt = detect_format(config)
    except UserError as e:
        raise UserError(f"'{path}': {e}") from None
    validated(SCHEMAS[fmt], config, f"{fmt} config '{path}'")
    return config
