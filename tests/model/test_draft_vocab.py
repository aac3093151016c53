"""A drafter with a draft vocabulary (model/drafter.py): its frozen N-row head, d2t / t2d buffers and id
maps against a hand-made vocabulary, and the draft-space loss (model/loss.py `labels=`) against the
full-vocabulary loss and a float64 recomputation."""

import math

import pytest
import torch

from dflash_train.checkpoint.folders import count_parameters
from dflash_train.model.drafter import DFlashDrafter, DrafterConfig
from dflash_train.model.loss import dflash_loss
from dflash_train.model.vocab import DraftVocab
from dflash_train.training.config import LossConfig

V, H = 40, 32
KEPT = [0, 3, 4, 11, 17, 18, 25, 38, 39]  # both ends of the vocabulary, runs and gaps
N = len(KEPT)


def make_drafter(draft_vocab_size, vocab_size=V) -> DFlashDrafter:
    return DFlashDrafter(DrafterConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       vocab_size=vocab_size, block_size=4, mask_token_id=vocab_size - 1,
                                       target_layer_ids=[1], num_target_layers=4,
                                       draft_vocab_size=draft_vocab_size))


@pytest.fixture
def pair():
    """(a drafter with the draft vocabulary KEPT, the target's head [V, H])."""
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    drafter = make_drafter(N)
    drafter.set_draft_vocab(DraftVocab(torch.tensor(KEPT), V), head.weight)
    return drafter, head


def test_full_logits_are_the_targets_on_kept_ids_and_minus_inf_elsewhere(pair):
    drafter, head = pair
    hidden = torch.randn(2, 3, H)
    full = drafter.full_logits(hidden, head)
    ref = head(hidden)
    assert full.shape == (2, 3, V)
    outside = [t for t in range(V) if t not in KEPT]
    torch.testing.assert_close(full[..., KEPT], ref[..., KEPT], rtol=1e-6, atol=1e-6)
    assert torch.isneginf(full[..., outside]).all()
    # the draft head's own logits are the kept columns, in draft-index order
    torch.testing.assert_close(drafter.logits_head(head)(hidden), ref[..., KEPT], rtol=1e-6, atol=1e-6)
    assert drafter.logits_head(head) is drafter.lm_head
    # the argmax can only be a kept id: the best kept one
    best = torch.tensor(KEPT)[ref[..., KEPT].argmax(-1)]
    assert torch.equal(full.argmax(-1), best)


def test_without_a_draft_vocabulary_everything_is_the_identity(pair):
    _, head = pair
    plain = make_drafter(None)
    hidden = torch.randn(4, H)
    assert plain.lm_head is None and plain.draft_vocab is None and plain.logits_head(head) is head
    assert torch.equal(plain.full_logits(hidden, head), head(hidden))
    ids = torch.tensor([[5, -1, 39]])
    assert torch.equal(plain.to_draft_ids(ids), ids) and torch.equal(plain.to_target_ids(ids), ids)
    assert not {"lm_head.weight", "d2t", "t2d"} & set(plain.state_dict())


def test_id_maps_round_trip_and_minus_one(pair):
    drafter, _ = pair
    every = torch.arange(V)
    expected = torch.tensor([KEPT.index(t) if t in KEPT else -1 for t in range(V)])
    assert torch.equal(drafter.to_draft_ids(every), expected)
    assert torch.equal(drafter.to_target_ids(torch.arange(N)), torch.tensor(KEPT))
    kept = torch.tensor(KEPT)
    assert torch.equal(drafter.to_target_ids(drafter.to_draft_ids(kept)), kept)
    # -1 (padding / an unknown label) stays -1, in any shape, for int32 ids too
    ids = torch.tensor([[-1, 3, 5], [39, -1, 0]], dtype=torch.int32)
    assert drafter.to_draft_ids(ids).tolist() == [[-1, 1, -1], [8, -1, 0]]
    assert drafter.draft_vocab.kept.tolist() == KEPT and drafter.draft_vocab.vocab_size == V


def test_state_dict_holds_speculators_names_and_the_head_is_frozen(pair):
    drafter, head = pair
    sd = drafter.state_dict()
    plain = make_drafter(None).state_dict()
    assert set(sd) == set(plain) | {"lm_head.weight", "d2t", "t2d"}
    assert sd["lm_head.weight"].shape == (N, H) and sd["lm_head.weight"].dtype == torch.float32
    assert torch.equal(sd["lm_head.weight"], head.weight[KEPT])  # the target's rows of the kept ids
    assert sd["d2t"].dtype == torch.int64 and sd["d2t"].tolist() == [t - i for i, t in enumerate(KEPT)]
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].nonzero().flatten().tolist() == KEPT
    # a fresh drafter loading the state dict has the same vocabulary
    other = make_drafter(N)
    other.load_state_dict(sd)
    assert other.draft_vocab.kept.tolist() == KEPT
    # frozen: no gradient, and an optimizer step over all parameters leaves it as it was
    assert not drafter.lm_head.weight.requires_grad
    before = drafter.lm_head.weight.clone()
    opt = torch.optim.AdamW(drafter.parameters(), lr=0.1, weight_decay=0.5)
    hidden = drafter.fc.weight.sum() * torch.randn(5, H)  # logits that depend on a trained weight
    drafter.full_logits(hidden, head)[:, KEPT].logsumexp(-1).sum().backward()
    assert drafter.fc.weight.grad is not None and drafter.lm_head.weight.grad is None
    opt.step()
    assert torch.equal(drafter.lm_head.weight, before)


def test_count_parameters_leaves_the_frozen_head_out(pair):
    drafter, _ = pair
    plain = make_drafter(None)
    assert count_parameters(drafter) == count_parameters(plain) == sum(p.numel() for p in plain.parameters())
    assert sum(p.numel() for p in drafter.parameters()) == count_parameters(plain) + N * H


# --- the loss in draft space --------------------------------------------------------------------

def loss_case(seed, b=2, A=3, K=5):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, A, K, H, generator=g)
    th = torch.randn(b, A, K, H, generator=g)
    tokens = torch.randint(0, V, (b, A, K), generator=g)
    valid = torch.rand(b, A, K, generator=g) > 0.25
    valid[0, 0] = False
    valid[-1, -1] = True
    return h, th, tokens, valid


def loss_and_grad(h, *args, **kw):
    h = h.clone().requires_grad_()
    loss, m = dflash_loss(h, *args, **kw)
    loss.backward()
    return loss.detach(), h.grad, m


@pytest.mark.parametrize("weighting", ["exp", "dpace"])
@pytest.mark.parametrize("chunk_slots", [0, 6])
def test_identity_vocabulary_gives_the_full_vocabulary_loss(weighting, chunk_slots):
    """N = V with the identity vocabulary and labels = the target's argmax (mapped into it): the very
    loss and gradient of the full-vocabulary loss, with or without the target's hidden states."""
    torch.manual_seed(1)
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    drafter = make_drafter(V)
    drafter.set_draft_vocab(DraftVocab(torch.arange(V), V), head.weight)
    h, th, tokens, valid = loss_case(2)
    cfg = LossConfig(terms={"ce": 1.0}, position_weight=weighting, chunk_slots=chunk_slots)
    old, g_old, m_old = loss_and_grad(h, th, head, tokens, valid, cfg)
    labels = drafter.to_draft_ids(head(th).argmax(-1))
    for t_hidden in (th, None):
        new, g_new, m_new = loss_and_grad(h, t_hidden, drafter.lm_head, tokens, valid, cfg, labels=labels)
        torch.testing.assert_close(new, old, rtol=1e-6, atol=0)
        torch.testing.assert_close(g_new, g_old, rtol=1e-5, atol=1e-8)
        assert (torch.equal(m_new["correct"], m_old["correct"]) and torch.equal(m_new["labels"],
                                                                                m_old["labels"]))
        torch.testing.assert_close(m_new["terms"], m_old["terms"], rtol=1e-6, atol=0)
    assert bool((m_new["alpha"] == 0).all())  # no target logits: alpha reported as 0
    assert bool((m_old["alpha"] > 0).any())


def reference_loss(logits, labels, valid, weighting, gamma=4.0, a=0.5) -> float:
    """Float64 by hand: slots whose label is -1 add nothing to the numerator but stay in the divisor;
    under D-PACE such a slot is one the drafter can never hit (confidence exp(-inf) = 0)."""
    b, A, K, _ = logits.shape
    num = den = 0.0
    for i in range(b):
        for j in range(A):
            ce, s = [], []
            for k in range(K):
                row = logits[i, j, k].tolist()
                lse = max(row) + math.log(sum(math.exp(x - max(row)) for x in row))
                lab = int(labels[i, j, k])
                ce.append(lse - row[lab] if lab >= 0 else math.inf)
                s.append((1 - a) * math.exp(-ce[-1]) + a if valid[i, j, k] else 1.0)
            for k in range(K):
                if not valid[i, j, k]:
                    continue
                if weighting == "exp":
                    w = math.exp(-k / gamma)
                    den += w
                else:
                    w = sum(math.prod(s[: m + 1]) for m in range(k, K) if valid[i, j, m])
                    den += 1.0
                if labels[i, j, k] >= 0:
                    num += w * ce[k]
    return num / den


@pytest.mark.parametrize("weighting", ["exp", "dpace"])
@pytest.mark.parametrize("chunk_slots", [0, 8])
def test_labels_outside_the_vocabulary_add_nothing(weighting, chunk_slots):
    """Draft-space logits (an identity head over N columns, float64) with labels in 0..N-1 and -1:
    the loss equals the float64 recomputation, -1 slots are never correct, and their logits get no
    gradient of their own when nothing else reads them."""
    g = torch.Generator().manual_seed(5)
    b, A, K = 2, 3, 4
    logits = 2.0 * torch.randn(b, A, K, N, generator=g, dtype=torch.float64)
    labels = torch.randint(0, N, (b, A, K), generator=g)
    labels[torch.rand(b, A, K, generator=g) < 0.3] = -1
    labels[0, 1] = torch.tensor([-1, -1, 2, -1])
    valid = torch.rand(b, A, K, generator=g) > 0.2
    valid[0, 1] = True
    cfg = LossConfig(terms={"ce": 1.0}, position_weight=weighting, chunk_slots=chunk_slots)
    loss, grad, m = loss_and_grad(logits, None, torch.nn.Identity(), torch.zeros_like(labels), valid, cfg,
                                  labels=labels)
    assert loss.item() == pytest.approx(reference_loss(logits, labels, valid, weighting), rel=1e-10)
    assert not bool(m["correct"][labels < 0].any())
    assert torch.equal(m["labels"], labels)
    # the same loss through the target's hidden states given (a kl-capable call): unchanged
    with_p, _, _ = loss_and_grad(logits, torch.randn(b, A, K, N, generator=g, dtype=torch.float64),
                                 torch.nn.Identity(), torch.zeros_like(labels), valid, cfg, labels=labels)
    assert with_p.item() == pytest.approx(loss.item(), rel=1e-12)
    if weighting == "exp":  # exp weights do not couple slots: a -1 slot's logits get no gradient
        assert bool((grad[labels < 0] == 0).all()) and bool((grad[(labels >= 0) & valid] != 0).any())


@pytest.mark.parametrize("chunk_slots", [0, 8])
def test_without_target_hidden_only_ce_is_allowed(chunk_slots):
    h, th, tokens, valid = loss_case(7)
    head = torch.nn.Linear(H, N, bias=False).requires_grad_(False)
    labels = torch.randint(-1, N, tokens.shape)
    for terms in ({"kl": 1.0}, {"ce": 1.0, "tv": 0.0}):
        cfg = LossConfig(terms=terms, chunk_slots=chunk_slots)
        with pytest.raises(ValueError, match="need the target's logits"):
            dflash_loss(h.clone().requires_grad_(), None, head, tokens, valid, cfg, labels=labels)
    cfg = LossConfig(terms={"ce": 1.0}, position_weight="dpace", chunk_slots=chunk_slots)
    loss, _, m = loss_and_grad(h, None, head, tokens, valid, cfg, labels=labels)
    ref, _, _ = loss_and_grad(h, th, head, tokens, valid, cfg, labels=labels)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(ref.item(), rel=1e-6)
