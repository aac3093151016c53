import math

import torch

from dflash_train.loss import acceptance_counts, acceptance_metrics, dflash_loss, position_weights


def test_position_weights():
    w = position_weights(8, gamma=4.0)
    assert w.shape == (7,)
    assert w[0] == 1.0 and math.isclose(w[3].item(), math.exp(-3 / 4), rel_tol=1e-6)


def test_loss_matches_float64_recomputation():
    torch.manual_seed(0)
    b, A, K, V = 2, 3, 5, 11
    draft, target = torch.randn(b, A, K, V), torch.randn(b, A, K, V)
    labels = torch.randint(0, V, (b, A, K))
    valid = torch.rand(b, A, K) > 0.3
    loss, _ = dflash_loss(draft, labels, valid, gamma=2.0, ce_weight=0.7, kl_weight=0.3, target_logits=target)
    # reference, written out slot by slot in float64
    num = den = 0.0
    d64, t64 = draft.double(), target.double()
    for i in range(b):
        for j in range(A):
            for k in range(K):
                if not valid[i, j, k]:
                    continue
                w = math.exp(-k / 2.0)
                logq = d64[i, j, k] - torch.logsumexp(d64[i, j, k], 0)
                logp = t64[i, j, k] - torch.logsumexp(t64[i, j, k], 0)
                ce = -logq[labels[i, j, k]].item()
                kl = (logp.exp() * (logp - logq)).sum().item()
                num += w * (0.7 * ce + 0.3 * kl)
                den += w
    assert math.isclose(loss.item(), num / den, rel_tol=1e-5)


def test_kl_is_zero_for_identical_distributions():
    x = torch.randn(1, 2, 3, 7)
    loss, _ = dflash_loss(x, x.argmax(-1), torch.ones(1, 2, 3, dtype=torch.bool), 4.0, ce_weight=0.0,
                          kl_weight=1.0, target_logits=x.clone())
    assert abs(loss.item()) < 1e-6


def test_acceptance_metrics_count_the_chain():
    # three blocks, K = 4 slots
    correct = torch.tensor([[1, 1, 0, 1],   # accepts 2 (stops at the first miss)
                            [1, 1, 1, 1],   # accepts 4
                            [0, 1, 1, 1]], dtype=torch.bool)  # accepts 0
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)  # block 2 ends after 3
    m = acceptance_metrics(acceptance_counts(correct, valid))
    assert m["blocks"] == 3
    assert math.isclose(m["eal"], 1 + (2 + 3 + 0) / 3)
    assert m["acc_per_position"] == [2 / 3, 1.0, 2 / 3, 1.0]
    # counts from two halves add up to the whole
    c = acceptance_counts(correct[:1], valid[:1]) + acceptance_counts(correct[1:], valid[1:])
    assert acceptance_metrics(c) == m
