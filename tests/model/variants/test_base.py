"""model/variants/base.py: the draft-vocabulary maps the variants read (against speculators' d2t / t2d
definitions), the CPU copy validation's tree scorers use, and plain DFlash's defaults."""

from types import SimpleNamespace

import torch
from torch import nn

from dflash_train.model.variants import VARIANTS
from dflash_train.model.variants.base import Variant, cpu_copy, kept_ids, w2_rows

KEPT = torch.tensor([2, 5, 6, 9])  # a draft vocabulary of 4 of 12 target ids
V = 12


def with_draft_vocab():
    # speculators: d2t[i] = target id of draft index i, minus i; t2d[t] whether target id t is kept
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[KEPT] = True
    return SimpleNamespace(lm_head=nn.Linear(8, len(KEPT)), d2t=KEPT - torch.arange(len(KEPT)), t2d=t2d)


def test_the_draft_vocabulary_maps_go_both_ways():
    drafter = with_draft_vocab()
    assert kept_ids(drafter).tolist() == KEPT.tolist()
    rows = w2_rows(drafter)
    assert rows.shape == (V,) and rows.device.type == "cpu"
    assert [int(rows[t]) for t in KEPT] == list(range(len(KEPT)))  # each kept id reads its own row
    outside = torch.ones(V, dtype=torch.bool)
    outside[KEPT] = False
    assert bool((rows[outside] >= 0).all() and (rows[outside] < len(KEPT)).all())  # a row, never past N
    full = SimpleNamespace(lm_head=None)
    assert kept_ids(full) is None and w2_rows(full) is None


def test_a_cpu_copy_holds_the_weights_in_fp32_in_eval_mode():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5)).to(torch.bfloat16).train()
    copy = cpu_copy(module, nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5)))
    assert not copy.training and copy[0].weight.dtype == torch.float32
    for name, value in module.state_dict().items():
        assert torch.equal(copy.state_dict()[name], value.float()), name
    x = torch.randn(3, 4)
    torch.testing.assert_close(copy(x), copy(x))  # eval: dropout off


def test_plain_dflash_drafts_each_slots_argmax_and_adds_nothing():
    dflash = VARIANTS["dflash"]
    assert type(dflash) is Variant and dflash.native_refusal is None
    logits = torch.randn(7, V)
    draft = dflash.chain(None, torch.randn(8, 16), logits, bonus=3)
    assert draft.tokens.tolist() == [int(row.argmax()) for row in logits]
    assert draft.confidence is None and draft.passes is None
    assert dflash.scorer(None, torch.randn(8, 16), 3) is None and dflash.extra_terms(None) == []
    for name, variant in VARIANTS.items():  # every other variant is refused by the native format
        assert (variant.native_refusal is None) == (name == "dflash"), name
