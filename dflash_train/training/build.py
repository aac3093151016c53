"""Build a drafter for a target from the recipe's model section (a fresh one, or `model.init_from`).

The drafter's shape follows the target (it shares its embeddings and LM head); the variant's
fields (Variant.drafter_fields) are checked against the target's config before anything is allocated.
"""

from dflash_train.checkpoint.folders import check_matches_target, load_drafter
from dflash_train.core.errors import UserError
from dflash_train.data.dataset import stop_token_ids
from dflash_train.model.drafter import DFlashDrafter, DrafterConfig
from dflash_train.model.target import Target, build_target_layer_ids, check_tap_layers
from dflash_train.model.variants import VARIANTS
from dflash_train.model.vocab import build_draft_vocab, check_size, count_supervised
from dflash_train.training.config import ModelConfig


def mask_token_id(target: Target, mask_token: str, given_id: int | None = None) -> int:
    rows = target.model.config.vocab_size
    if given_id is not None:
        if given_id >= rows:
            raise UserError(f"model.mask_token_id {given_id} is outside the target's embedding table ({rows} "
                            "rows)")
        return given_id
    tok = target.tokenizer
    ids = tok.convert_tokens_to_ids([mask_token])
    if ids[0] is None or ids[0] == tok.unk_token_id or mask_token not in tok.get_vocab():
        raise UserError(f"the target's tokenizer has no mask token '{mask_token}' (add it as a special "
                        "token, or give an unused embedding row as model.mask_token_id, e.g. 151669 for "
                        "Qwen3)")
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
        mask_token_id=mask_token_id(target, m.mask_token, m.mask_token_id), target_layer_ids=list(layer_ids),
        num_target_layers=tc.num_hidden_layers, rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings, rope_parameters=dict(tc.rope_parameters),
        attention_bias=tc.attention_bias, block_attention=m.block_attention,
        **VARIANTS[m.variant].drafter_fields(m, tc), draft_vocab_size=draft_vocab_size(m, tc),
    )


def draft_vocab_size(m: ModelConfig, tc) -> int | None:
    if m.draft_vocab_size is not None:
        check_size(m.draft_vocab_size, tc.vocab_size)
    return m.draft_vocab_size


def attach_draft_vocab(drafter: DFlashDrafter, target: Target, train_ds, val_ds=None) -> dict | None:
    """Build a fresh drafter's draft vocabulary from data.train's supervised tokens (a drafter that has
    one, from model.init_from, keeps it) and fill its frozen head with this target's rows. -> what was
    built (size, coverage of data.train's supervised tokens and of val_ds's: held out, the honest one)
    or None without a draft vocabulary."""
    if drafter.lm_head is None:
        return None
    counts = count_supervised(zip(train_ds["input_ids"], train_ds["loss_mask"]))
    if bool(drafter.t2d.any()):  # from model.init_from: its vocabulary is part of the trained drafter
        vocab = drafter.draft_vocab
    else:
        vocab = build_draft_vocab(counts, drafter.config.draft_vocab_size, drafter.config.vocab_size,
                                  stop_token_ids(target.model, target.tokenizer))
    # The head is the target's, frozen: an init_from drafter's rows are of the target it was trained
    # against, which may be another one of this shape (check_matches_target); the rows of this one.
    drafter.set_draft_vocab(vocab, target.lm_head.weight)
    out = {"size": vocab.size, "coverage": round(vocab.coverage(counts), 4)}
    if val_ds is not None:
        out["val_coverage"] = round(vocab.coverage(count_supervised(zip(val_ds["input_ids"],
                                                                        val_ds["loss_mask"]))), 4)
    return out


def copy_target_layers(drafter: DFlashDrafter, target: Target) -> list[int]:
    """Drafter layer i <- target decoder layer N-L+i, and the drafter's final norm <- the target's
    (model.init_layers_from_target). Every tensor of the target layer must land on a drafter tensor
    of its shape; the drafter's q_norm / k_norm may stay at their ones (Llama has none).
    -> the target layers copied."""
    decoder = target.model.get_decoder()
    L, N = len(drafter.layers), target.num_layers
    if L > N:
        raise UserError(f"model.init_layers_from_target: the drafter has {L} layers, the target only {N}")
    copied = list(range(N - L, N))
    for layer, k in zip(drafter.layers, copied):
        state = decoder.layers[k].state_dict()
        mine = layer.state_dict()
        bad = [n for n, t in state.items() if n not in mine or mine[n].shape != t.shape]
        if bad:
            raise UserError(f"model.init_layers_from_target: target layer {k}'s {bad[0]} has no drafter "
                            "tensor of its shape (another layer type?)")
        missing, _ = layer.load_state_dict(state, strict=False)
        assert all(n.endswith(("q_norm.weight", "k_norm.weight")) or "_conv." in n for n in missing), missing
    drafter.norm.load_state_dict(decoder.norm.state_dict())
    return copied


def init_drafter(target: Target, m: ModelConfig) -> DFlashDrafter:
    """A fresh drafter for the recipe, or the `model.init_from` one when its shape agrees.
    A DFlash drafter may start a DSpark or XPress recipe (its backbone, with fresh heads) or a DFlash2
    one (its weights, identity convolutions, so it computes what it computed, and a fresh selector).
    A variant without a draft vocabulary (DFlash2) grows from a drafter with one by dropping it: its
    frozen head (the target's rows) gives way to the target's whole head, the backbone is kept."""
    cfg = drafter_config_for(target, m)
    if m.init_from is None:
        drafter = DFlashDrafter(cfg)
        if m.init_layers_from_target:
            copy_target_layers(drafter, target)
        return drafter
    drafter, _ = load_drafter(m.init_from)
    check_matches_target(drafter.config, target)
    loaded, variant = drafter.config, VARIANTS[cfg.variant]
    grow = loaded.variant in variant.grows_from  # a DFlash drafter under the variant's fresh modules
    fields = [("num_layers", "num_hidden_layers"), ("block_size", "block_size"),
              ("target_layer_ids", "target_layer_ids"), ("mask_token", "mask_token_id"),
              ("block_attention", "block_attention"), ("variant", "variant"),
              ("draft_vocab_size", "draft_vocab_size")] + [(k, k) for k in drafter.variant.recipe_fields]
    drop_vocab = grow and not variant.draft_vocab and loaded.draft_vocab_size is not None
    for key, field in fields:
        if (key == "variant" and grow) or (key == "draft_vocab_size" and drop_vocab):
            continue
        if getattr(loaded, field) != getattr(cfg, field):
            raise UserError(f"model.init_from drafter has {field} {getattr(loaded, field)} but the recipe "
                            f"gives {getattr(cfg, field)}: set model.{key} to match")
    if grow:
        grown = DFlashDrafter(cfg)
        state = drafter.state_dict()
        if drop_vocab:  # the draft vocabulary's head and maps (model/vocab.py)
            print(f"model.init_from: its {loaded.draft_vocab_size}-token draft vocabulary is dropped: a "
                  f"{cfg.variant} drafter drafts over the target's whole vocabulary")
            state = {k: v for k, v in state.items() if k not in ("lm_head.weight", "d2t", "t2d")}
        missing, unexpected = grown.load_state_dict(state, strict=False)
        assert not unexpected and all(k.startswith(variant.grown) or "_conv." in k for k in missing)
        return grown
    loaded.num_target_layers = cfg.num_target_layers
    return drafter
