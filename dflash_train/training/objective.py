"""The recipe's objective on anchored blocks: the loss a training step backpropagates and
validation reports, with its named terms (the model's per-slot terms are in model/loss.py)."""

import torch

from dflash_train.model.loss import dflash_loss
from dflash_train.model.variants import VARIANTS
from dflash_train.training.blocks import BlockOutputs, target_labels
from dflash_train.training.config import RunConfig


def training_loss(o: BlockOutputs, target, model, cfg: RunConfig, normalizer,
                  with_alpha: bool = True) -> tuple[torch.Tensor, dict]:
    """The recipe's loss on the anchored blocks, with the variant's low-rank logit bias added in the
    loss's chunks (Variant.logit_bias), plus the variant's extra terms (Variant.extra_loss)."""
    bias = model.variant.logit_bias(model, o.heads)
    if model.lm_head is not None:  # a draft vocabulary: its own (cheap) step
        block_loss = draft_vocab_loss(o, target, model, cfg, normalizer,
                                      with_alpha or model.variant.needs_alpha(model, cfg))
    else:
        def block_loss(bias=None, grad=True):  # the block's loss again, with another low-rank bias
            with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
                return dflash_loss(o.draft_hidden, o.target_hidden, target.lm_head, o.tokens, o.valid,
                                   cfg.loss, normalizer=normalizer, markov_bias=bias)
    loss, m = block_loss(bias)
    return model.variant.extra_loss(o, model, target, cfg, normalizer, block_loss, loss, m)


def draft_vocab_loss(o: BlockOutputs, target, model, cfg: RunConfig, normalizer, with_alpha: bool):
    """The loss of a drafter with a draft vocabulary, in draft space: labels (the target's greedy
    tokens from the cache, or the data's) mapped into it, -1 outside it (left out of the loss, a
    miss for acceptance). The target's logits over the draft vocabulary (speculators' renormalised
    p) are computed only when a term or alpha needs them: a ce step touches only the N-wide head.
    -> block_loss(bias=None, grad=True) -> (loss, m), m["pred"] in draft indices (a variant's low-rank
    bias over the draft vocabulary rides in as the bias)."""
    given = target_labels(o, target) if cfg.loss.ce_labels == "target" else o.tokens
    need_p = with_alpha or bool(set(cfg.loss.terms) - {"ce"})
    labels = model.to_draft_ids(given)

    def block_loss(bias=None, grad=True):
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            loss, m = dflash_loss(o.draft_hidden, o.target_hidden if need_p else None, model.lm_head,
                                  o.tokens, o.valid, cfg.loss, normalizer=normalizer, markov_bias=bias,
                                  labels=labels)
        m["labels"] = given  # target ids: validation's trees are walked in the target's vocabulary
        return loss, m
    return block_loss


def term_names(cfg: RunConfig) -> list[str]:
    """The reported loss terms: the recipe's, then the variant's extra terms (Variant.extra_terms; a
    training step's record adds tree distillation's KL as "tree")."""
    return [*cfg.loss.terms] + VARIANTS[cfg.model.variant].extra_terms(cfg)
