"""XPress drafters for tests: our anchored-block pass and speculators' XPressDraftModel.forward."""

import pytest
import torch
from torch import nn

from dflash_train.data.dataset import Batch
from dflash_train.training.blocks import anchored_blocks
from helpers import Captured

B = 6


def our_blocks(drafter, target, ids, anchors):
    """Our anchored-block pass (training's) over ids [1, T] at anchors [A]."""
    batch = Batch(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
    c = drafter.config
    return anchored_blocks(drafter, target, batch, anchors[None],
                           torch.ones(1, len(anchors), dtype=torch.bool), c.target_layer_ids, c.block_size,
                           c.mask_token_id)


def speculators_forward(spec, target, ids, anchors, monkeypatch, capture=True, **kwargs):
    """speculators' XPressDraftModel.forward on ids [1, T] with our anchors [A]: with `capture`, the
    logits it hands to its loss (teacher-forced [A, B, V], the rounds, base), else its loss (eager terms;
    verifier_norm made the identity so that the target's final-normed states give its targets)."""
    import speculators.models.dflash.core as dflash_core
    import speculators.models.xpress.core as xpress_core
    from dflash_train.model.target import target_forward

    A = anchors.shape[0]
    monkeypatch.setattr(dflash_core, "select_anchors",
                        lambda loss_mask, n, bs: (anchors, torch.ones(n, dtype=torch.bool)))
    seen = {}

    def grab(logits_tf, round_logits, base_logits, *args, **kw):
        seen.update(tf=logits_tf, rounds=round_logits, base=base_logits)
        raise Captured

    if capture:
        monkeypatch.setattr(xpress_core, "compute_metrics", grab)
    out = target.model.get_decoder()(input_ids=ids, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i] for i in spec.config.aux_hidden_state_layer_ids], -1)
    _, last = target_forward(target, ids, torch.ones_like(ids), [0])
    spec.verifier_norm = nn.Identity()
    args = dict(hidden_states=taps, input_ids=ids, loss_mask=torch.ones_like(ids),
                verifier_last_hidden_states=last, document_ids=torch.zeros_like(ids), max_anchors=A, **kwargs)
    if not capture:
        return spec(**args)[1]
    with pytest.raises(Captured):
        spec(**args)
    view = lambda x: x.view(A, B, -1)  # noqa: E731
    return view(seen["tf"]), [view(r) for r in seen["rounds"]], view(seen["base"])
