"""DSpark drafters for tests: config, random weights, and its block logits from speculators'
DSparkDraftModel and from ours."""

import pytest
import torch

from dflash_train.model.drafter import DFlashDrafter
from dflash_train.model.target import target_forward
from dflash_train.model.variants import dspark
from dflash_train.training.build import drafter_config_for
from dflash_train.training.config import ModelConfig
from helpers import Captured

B = 6


def dspark_config(target, head_type="vanilla", rank=16, block_size=B, confidence=True, num_layers=2):
    return drafter_config_for(target, ModelConfig(num_layers=num_layers, block_size=block_size,
                                                  variant="dspark", markov_rank=rank,
                                                  markov_head_type=head_type, confidence_head=confidence))


def random_dspark(target, head_type, seed=0, **kw) -> DFlashDrafter:
    """Random, non-trivial weights everywhere (norms included)."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(dspark_config(target, head_type, **kw)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    return drafter


def speculators_block_logits(spec, target, ids, anchors, monkeypatch):
    """Run speculators' DSparkDraftModel.forward on `ids` [1, T] with our anchors [A] and return the
    Markov-corrected logits [A, B, V] and confidence logits [A, B] it hands to its loss."""
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core

    A, T = anchors.shape[0], ids.shape[1]
    monkeypatch.setattr(dflash_core, "select_anchors",
                        lambda loss_mask, n, bs: (anchors, torch.ones(n, dtype=torch.bool)))
    seen = {}

    def capture(logits, targets, confidence_logits, *args, **kwargs):
        seen["logits"], seen["confidence"] = logits, confidence_logits
        raise Captured

    monkeypatch.setattr(dspark_core, "compute_metrics", capture)
    # speculators indexes hidden_states by its own aux ids directly (no +1)
    out = target.model.get_decoder()(input_ids=ids, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i] for i in spec.config.aux_hidden_state_layer_ids], -1)
    with pytest.raises(Captured):
        spec(hidden_states=taps, input_ids=ids, loss_mask=torch.ones_like(ids),
             verifier_last_hidden_states=torch.zeros(1, T, target.model.config.hidden_size),
             document_ids=torch.zeros_like(ids), max_anchors=A)
    conf = None if seen["confidence"] is None else seen["confidence"].view(A, -1)
    return seen["logits"].view(A, spec.config.block_size, -1), conf


def our_block_logits(drafter, target, ids, anchors):
    """Our training forward + teacher-forced heads -> logits [A, B-1, N] (N: the draft vocabulary, or V),
    confidence [A, B-1]."""
    cfg = drafter.config
    A, Bs = anchors.shape[0], cfg.block_size
    taps, _ = target_forward(target, ids, torch.ones_like(ids), cfg.target_layer_ids)
    block = torch.full((1, A, Bs), cfg.mask_token_id)
    block[:, :, 0] = ids[0, anchors]
    hidden = drafter(target.embed(block.view(1, A * Bs)), taps, anchors[None],
                     torch.ones_like(ids, dtype=torch.bool))
    hidden = hidden.view(1, A, Bs, -1)
    true_tokens = ids[0, anchors[:, None] + torch.arange(Bs)][None]  # [1, A, B]
    u, conf = dspark.teacher_forced(drafter, hidden, true_tokens)
    head = drafter.logits_head(target.lm_head)
    logits = dspark.markov_logits(head, drafter.markov_head, hidden[:, :, 1:], u)
    return logits[0], None if conf is None else conf[0]
