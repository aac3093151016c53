"""The objective library against speculators 0.9.0's eager losses and D-PACE weighting, a float64
recomputation, AUF's mask, and the chunked loss against the unchunked one (values and gradients)."""

import math
from functools import partial

import pytest
import torch
from speculators.losses import eager
from speculators.losses.utils import compound_loss, dflash_loss_decay, dpace_loss_decay

from dflash_train.model.loss import (TERMS, acceptance_counts, acceptance_metrics, dflash_loss, dpace_weights,
                                     exp_weights, loss_divisor, slot_terms, until_first_failure)
from dflash_train.training.config import LossConfig

SPECULATORS = {"ce": eager.ce_loss, "kl": eager.kl_div_loss, "rkl": eager.reverse_kl_div_loss,
               "jsd": eager.js_div_loss, "tv": eager.tv_loss, "nla": eager.neg_log_acceptance_loss,
               "lk_hybrid": partial(eager.lk_hybrid_loss, eta=2.5)}
SHAPES = [(2, 3, 5, 11), (1, 4, 7, 64), (3, 2, 3, 257)]  # b, A, K, V


def random_case(shape, seed, one_hot=False):
    """Draft and target logits [b, A, K, V] (float64), a validity mask with holes and empty blocks."""
    g = torch.Generator().manual_seed(seed)
    b, A, K, V = shape
    draft = 2.0 * torch.randn(shape, generator=g, dtype=torch.float64)
    target = 3.0 * torch.randn(shape, generator=g, dtype=torch.float64)
    if one_hot:  # p is exactly one-hot: exp(-1e4) is 0 in float32 and float64
        target = torch.where(torch.nn.functional.one_hot(target.argmax(-1), V).bool(), 0.0, -1e4).double()
    valid = torch.rand((b, A, K), generator=g) > 0.25
    valid[0, 0] = False  # a whole invalid block
    valid[-1, -1] = True
    return draft, target, valid


def with_anchor_slot(x: torch.Tensor, fill=0):
    """[n, K, ...] -> speculators' packed layout [1, n * (K + 1), ...] with slot 0 (the anchor) in front."""
    pad = torch.full_like(x[:, :1], fill)
    y = torch.cat([pad, x], dim=1)
    return y.reshape(1, -1, *x.shape[2:])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("one_hot", [False, True])
def test_terms_equal_speculators_eager(shape, one_hot):
    draft, target, _ = random_case(shape, seed=sum(shape), one_hot=one_hot)
    V = shape[-1]
    values, alpha = slot_terms(draft, target, target.argmax(-1), TERMS, lk_eta=2.5)
    for name in TERMS:
        ref = SPECULATORS[name](draft.reshape(1, -1, V), target.reshape(1, -1, V)).reshape(shape[:-1])
        # speculators computes in float32; ours is float64 here: agreement to float32's precision
        torch.testing.assert_close(values[name], ref.double(), rtol=1e-6, atol=1e-6, msg=name)
    torch.testing.assert_close(alpha, 1 - eager.tv_loss(draft.reshape(1, -1, V), target.reshape(1, -1, V))
                               .reshape(shape[:-1]).double(), rtol=1e-6, atol=1e-6)
    if one_hot:  # a point-mass target: KL and NLA are the CE, alpha is q(label)
        torch.testing.assert_close(values["kl"], values["ce"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(values["nla"], values["ce"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_slot_weights_equal_speculators(shape):
    draft, target, valid = random_case(shape, seed=7 + sum(shape))
    b, A, K, V = shape
    n = b * A
    pos = with_anchor_slot(torch.arange(1, K + 1).expand(n, K))  # 0 1 .. K 0 1 .. K
    mask = with_anchor_slot(valid.reshape(n, K))
    torch.testing.assert_close(exp_weights(K, 2.5).expand(n, K),
                               dflash_loss_decay(pos.float(), 2.5).reshape(n, K + 1)[:, 1:])
    ce = slot_terms(draft, target, target.argmax(-1), ["ce"])[0]["ce"].reshape(n, K)
    for a in (0.5, 0.2, 1.0):
        ref = dpace_loss_decay(pos, mask, K + 1, a, with_anchor_slot(ce * valid.reshape(n, K)))
        torch.testing.assert_close(dpace_weights(ce, valid.reshape(n, K), a),
                                   ref.reshape(n, K + 1)[:, 1:].double(), rtol=1e-6, atol=1e-6)


def spec_loss(draft, target, valid, spec_terms: dict, decay_fn):
    """speculators' compound_loss on the packed layout of our blocks (slot 0 masked)."""
    b, A, K, V = draft.shape
    n = b * A
    logits, targets = (with_anchor_slot(x.reshape(n, K, V)) for x in (draft, target))
    mask = with_anchor_slot(valid.reshape(n, K))
    pos = with_anchor_slot(torch.arange(1, K + 1).expand(n, K))
    fns = {name: (SPECULATORS[name], w) for name, w in spec_terms.items()}
    decay_fn = partial(decay_fn, loss_mask=mask, block_size=K + 1)
    loss, _ = compound_loss(logits, targets, mask, pos, fns, decay_fn=decay_fn)
    return loss


@pytest.mark.parametrize("shape", SHAPES)
def test_weighted_losses_equal_speculators(shape):
    """Whole losses: speculators divides by the count of valid slots (+1e-5); ours takes that as
    the normalizer (its default for dpace; exp divides by the weight sum, checked below)."""
    draft, target, valid = random_case(shape, seed=3 + sum(shape))
    count = valid.sum().double() + 1e-5
    mix = {"ce": 0.1, "tv": 0.9}
    for terms, weighting, decay in [
        (mix, "exp", lambda pos, **kw: dflash_loss_decay(pos, gamma=3.0)),
        ({"kl": 1.0}, "exp", lambda pos, **kw: dflash_loss_decay(pos, gamma=3.0)),
        ({"ce": 1.0}, "dpace", partial(dpace_loss_decay, dpace_alpha=0.5)),  # speculators: dpace only with ce
        ({"lk_hybrid": 1.0}, "uniform", lambda pos, **kw: torch.ones_like(pos)),
    ]:
        cfg = LossConfig(terms=terms, position_weight=weighting, gamma=3.0, lk_eta=2.5, chunk_slots=0)
        ours, _ = dflash_loss(draft, target, torch.nn.Identity(), target.argmax(-1), valid, cfg,
                              normalizer=count)
        torch.testing.assert_close(ours, spec_loss(draft, target, valid, terms, decay).double(), rtol=1e-6,
                                   atol=1e-6)


def test_loss_matches_float64_recomputation():
    """Default normalisation (exp: the weight sum), ce to the data's tokens, term shares."""
    torch.manual_seed(0)
    b, A, K, V = 2, 3, 5, 11
    draft, target = torch.randn(b, A, K, V, dtype=torch.float64), torch.randn(b, A, K, V, dtype=torch.float64)
    tokens = torch.randint(0, V, (b, A, K))
    valid = torch.rand(b, A, K) > 0.3
    cfg = LossConfig(terms={"ce": 0.7, "kl": 0.3}, ce_labels="data", gamma=2.0)
    loss, m = dflash_loss(draft, target, torch.nn.Identity(), tokens, valid, cfg)
    num = den = ce_sum = 0.0
    for i in range(b):
        for j in range(A):
            for k in range(K):
                if not valid[i, j, k]:
                    continue
                w = math.exp(-k / 2.0)
                logq = draft[i, j, k] - torch.logsumexp(draft[i, j, k], 0)
                logp = target[i, j, k] - torch.logsumexp(target[i, j, k], 0)
                ce = -logq[tokens[i, j, k]].item()
                kl = (logp.exp() * (logp - logq)).sum().item()
                num, den, ce_sum = num + w * (0.7 * ce + 0.3 * kl), den + w, ce_sum + w * ce
    assert math.isclose(loss.item(), num / den, rel_tol=1e-12)
    assert math.isclose(m["terms"][0].item(), ce_sum / den, rel_tol=1e-12)
    assert torch.equal(m["labels"], tokens)


def test_until_first_failure_mask():
    correct = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 0, 0, 1, 0]],
                           dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 1, 1, 1]],
                         dtype=torch.bool)
    keep = until_first_failure(correct, valid)
    assert keep.long().tolist() == [[1, 1, 1, 0, 0],  # through the miss at slot 3
                                    [1, 0, 0, 0, 0],  # a miss at slot 1: only slot 1
                                    [1, 1, 1, 1, 1],
                                    [1, 0, 1, 0, 0]]  # an invalid slot is passed over, not a miss


@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_until_first_failure_supervises_exactly_through_the_first_miss(weighting):
    """Through dflash_loss: the gradient reaches every valid slot up to the first argmax miss
    and none after it; the divisor stays the one of all valid slots."""
    draft, target, valid = random_case((2, 4, 6, 9), seed=5)
    labels = target.argmax(-1)
    # make the drafter right on a known prefix of each block: slots < r are correct, slot r is a miss
    g = torch.Generator().manual_seed(1)
    first_miss = torch.randint(0, 6, (2, 4), generator=g)
    k = torch.arange(6)
    correct = k < first_miss[..., None]
    one_hot = torch.nn.functional.one_hot(labels, 9).double()
    draft = torch.where(correct[..., None], draft.abs().amax() * 2 * one_hot, draft - 50 * one_hot)
    draft.requires_grad_()
    cfg = LossConfig(terms={"ce": 1.0, "tv": 1.0}, position_weight=weighting, until_first_failure=True,
                     chunk_slots=0)
    loss, m = dflash_loss(draft, target, torch.nn.Identity(), labels, valid, cfg)
    assert torch.equal(m["correct"], correct & valid)
    loss.backward()
    reached = draft.grad.abs().sum(-1) > 0
    # the first *valid* miss: invalid slots are passed over
    ok = correct | ~valid
    expect = valid & (torch.cumprod(torch.cat([torch.ones_like(ok[..., :1]), ok[..., :-1]], -1).long(),
                                    -1) > 0)
    assert torch.equal(reached, expect) and (expect.sum() < valid.sum())
    without = cfg.model_copy(update={"until_first_failure": False})
    full, _ = dflash_loss(draft, target, torch.nn.Identity(), labels, valid, without)
    assert loss < full  # same divisor, fewer slots in the numerator


@pytest.mark.parametrize("terms, weighting, auf", [({"ce": 1.0}, "exp", False),
                                                    ({"ce": 0.1, "tv": 0.9}, "dpace", True),
                                                    ({n: 1.0 for n in TERMS}, "uniform", False),
                                                    ({"kl": 1.0, "lk_hybrid": 0.5}, "dpace", False)])
@pytest.mark.parametrize("chunk_slots", [1, 6, 13])
def test_chunked_loss_equals_unchunked(terms, weighting, auf, chunk_slots):
    """Hidden states through a frozen LM head: chunks of 1, 2 and 4 blocks (K = 3) give the
    unchunked value, metrics and gradient (float64, so equal to rounding)."""
    g = torch.Generator().manual_seed(len(terms) + chunk_slots)
    b, A, K, H, V = 2, 5, 3, 8, 97
    head = torch.nn.Linear(H, V, bias=False, dtype=torch.float64).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=torch.float64))
    h = torch.randn(b, A, K, H, generator=g, dtype=torch.float64)
    th = torch.randn(b, A, K, H, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (b, A, K), generator=g)
    valid = torch.rand(b, A, K, generator=g) > 0.2
    out = {}
    for c in (0, chunk_slots):
        cfg = LossConfig(terms=terms, position_weight=weighting, until_first_failure=auf, chunk_slots=c)
        x = h.clone().requires_grad_()
        loss, m = dflash_loss(x, th, head, tokens, valid, cfg,
                              normalizer=torch.tensor(7.0, dtype=torch.float64))
        (3.0 * loss).backward()
        out[c] = (loss.detach(), x.grad, m)
    (l0, g0, m0), (l1, g1, m1) = out[0], out[chunk_slots]
    torch.testing.assert_close(l1, l0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g1, g0, rtol=1e-10, atol=1e-12)
    assert g0.abs().sum() > 0
    for key in ("terms", "alpha"):
        torch.testing.assert_close(m1[key], m0[key], rtol=1e-12, atol=1e-12)
    assert torch.equal(m1["labels"], m0["labels"]) and torch.equal(m1["correct"], m0["correct"])
    with torch.no_grad():  # validation's path: no gradient kept, same numbers
        nog, m2 = dflash_loss(h, th, head, tokens, valid, cfg,
                              normalizer=torch.tensor(7.0, dtype=torch.float64))
    torch.testing.assert_close(nog, l0, rtol=1e-12, atol=1e-12)


def test_chunked_loss_needs_a_frozen_head():
    head = torch.nn.Linear(4, 10, bias=False)
    h = torch.randn(1, 2, 3, 4, requires_grad=True)
    with pytest.raises(ValueError, match="frozen LM head"):
        dflash_loss(h, h.detach(), head, torch.zeros(1, 2, 3, dtype=torch.long),
                    torch.ones(1, 2, 3, dtype=torch.bool), LossConfig(chunk_slots=3))


def test_split_batches_with_the_step_divisor_sum_to_the_whole():
    """What keeps accumulation and data parallelism exact for D-PACE and AUF: their weights are
    per block and the divisor is known before the forward, so the losses (and gradients) of
    two halves with the whole step's divisor add up to the whole batch's."""
    draft, target, valid = random_case((4, 3, 5, 13), seed=11)
    labels = target.argmax(-1)
    for cfg in [LossConfig(terms={"ce": 1.0, "kl": 0.5}, position_weight="dpace", chunk_slots=4),
                LossConfig(terms={"ce": 0.1, "tv": 0.9}, until_first_failure=True, chunk_slots=0)]:
        D = loss_divisor(valid, cfg, torch.float64)
        x = draft.clone().requires_grad_()
        whole, _ = dflash_loss(x, target, torch.nn.Identity(), labels, valid, cfg, normalizer=D)
        whole.backward()
        y = draft.clone().requires_grad_()
        parts = [dflash_loss(y[s], target[s], torch.nn.Identity(), labels[s], valid[s], cfg, normalizer=D)[0]
                 for s in (slice(0, 1), slice(1, 4))]
        sum(parts).backward()
        torch.testing.assert_close(sum(parts), whole, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(y.grad, x.grad, rtol=1e-12, atol=1e-12)
        assert math.isclose(D.item(), sum(loss_divisor(valid[s], cfg, torch.float64).item()
                                          for s in (slice(0, 1), slice(1, 4))), rel_tol=1e-12)


def test_acceptance_metrics_count_the_chain():
    # three blocks, K = 4 slots
    correct = torch.tensor([[1, 1, 0, 1],   # accepts 2 (stops at the first miss)
                            [1, 1, 1, 1],   # accepts 4
                            [0, 1, 1, 1]], dtype=torch.bool)  # accepts 0
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)  # block 2 ends after 3
    alpha = torch.tensor([[0.5, 0.25, 0.0, 1.0], [1.0, 0.75, 0.5, 0.9], [0.0, 0.5, 0.5, 0.5]])
    m = acceptance_metrics(acceptance_counts(correct, valid, alpha))
    assert m["blocks"] == 3
    assert math.isclose(m["eal"], 1 + (2 + 3 + 0) / 3)
    assert m["acc_per_position"] == [2 / 3, 1.0, 2 / 3, 1.0]
    assert m["alpha_per_position"] == pytest.approx([0.5, 0.5, 1 / 3, 0.75])  # the 0.9 is past block 2's end
    # counts from two halves add up to the whole
    c = (acceptance_counts(correct[:1], valid[:1], alpha[:1]) + acceptance_counts(correct[1:], valid[1:],
                                                                                  alpha[1:]))
    assert acceptance_metrics(c) == m
