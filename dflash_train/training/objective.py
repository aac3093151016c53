"""The recipe's objective on anchored blocks: the loss a training step backpropagates and
validation reports, with its named terms (the model's per-slot terms are in model/loss.py)."""

import torch

from dflash_train.model.loss import dflash_loss, exp_weights
from dflash_train.model.variants.dflash2 import selector_loss
from dflash_train.model.variants import VARIANTS
from dflash_train.model.variants.dspark import confidence_loss
from dflash_train.training.blocks import BlockOutputs, target_labels
from dflash_train.training.config import RunConfig


def training_loss(o: BlockOutputs, target, model, cfg: RunConfig, normalizer,
                  with_alpha: bool = True) -> tuple[torch.Tensor, dict]:
    """The recipe's loss on the anchored blocks (a DSpark drafter's logits carry its Markov bias),
    plus, for DSpark's confidence head, loss.confidence_weight x its BCE toward the detached
    per-slot acceptance rate alpha, with DFlash's exp slot weights (as speculators weighs it) and
    the same normaliser; for DFlash2, loss.selector_weight x the selector's candidate CE (the
    terms' slot weights, the same normaliser), reported as the term "selector", and the chain's
    hits are then the selector walk's (teacher-forced, dflash2.selector_loss); for XPress, the consistency
    rounds and the base anchor (xpress.XPress.extra_loss)."""
    bias = None if o.markov_u is None else (o.markov_u, model.variant.bias_weight(model))
    if model.lm_head is not None:  # a draft vocabulary: its own (cheap) step
        block_loss = draft_vocab_loss(o, target, model, cfg, normalizer, with_alpha)
        loss, m = block_loss(bias)
        return model.variant.extra_loss(o, model, cfg, block_loss, loss, m)
    def block_loss(extra_bias=None, grad=True):  # the block's loss again, another low-rank bias (XPress)
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            return dflash_loss(o.draft_hidden, o.target_hidden, target.lm_head, o.tokens, o.valid, cfg.loss,
                               normalizer=normalizer, markov_bias=extra_bias)
    loss, m = block_loss(bias)
    if o.confidence_logits is not None and cfg.loss.confidence_weight:
        w = exp_weights(o.valid.shape[-1], cfg.loss.gamma, o.valid.device) * o.valid
        loss = loss + cfg.loss.confidence_weight * confidence_loss(o.confidence_logits, m["alpha"], w,
                                                                   normalizer)
    if model.candidate_selector is not None:
        # [b, A, B] the data's tokens, slots 0..B-1
        block_tokens = torch.cat([o.bonus[..., None], o.tokens], dim=-1)
        sel, correct, _ = selector_loss(model.candidate_selector, o.draft_hidden, block_tokens,
                                        target.lm_head, m["labels"], o.valid, cfg.loss, normalizer)
        m["terms"] = torch.cat([m["terms"], sel.detach().reshape(1).to(m["terms"].dtype)])
        m["correct"] = correct
        loss = loss + cfg.loss.selector_weight * sel
    return model.variant.extra_loss(o, model, cfg, block_loss, loss, m)


def draft_vocab_loss(o: BlockOutputs, target, model, cfg: RunConfig, normalizer, with_alpha: bool):
    """The loss of a drafter with a draft vocabulary, in draft space: labels (the target's greedy
    tokens from the cache, or the data's) mapped into it, -1 outside it (left out of the loss, a
    miss for acceptance). The target's logits over the draft vocabulary (speculators' renormalised
    p) are computed only when a term or alpha needs them: a ce step touches only the N-wide head.
    -> block_loss(bias=None, grad=True) -> (loss, m), m["pred"] in draft indices (XPress's refiner
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
    """The reported loss terms: the recipe's, then DFlash2's selector CE or a variant's extra terms
    (XPress: consistency, base_anchor; a training step's record adds tree distillation's KL as "tree")."""
    return ([*cfg.loss.terms] + ["selector"] * (cfg.model.variant == "dflash2")
            + VARIANTS[cfg.model.variant].extra_terms(cfg))
