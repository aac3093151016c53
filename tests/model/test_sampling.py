"""sample_rows: draws that follow each row's distribution (a chi-square test against the probabilities
themselves), never a token of probability 0, and the same draws for the same generator state."""

import math

import torch

from dflash_train.model import sampling
from dflash_train.model.sampling import sample_rows


def chi2_limit(dof: int) -> float:
    # Wilson-Hilferty: the chi-square quantile at p = 1e-3
    return dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3


def test_draws_follow_each_row_and_skip_zero_probabilities():
    p = torch.tensor([[0.3, 0.0, 0.2, 0.05, 0.0, 0.15, 0.1, 0.2, 0.0, 0.0],    # zeros inside and at the end
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],     # one certain token, last
                      [0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    p[0] = p[0] / p[0].sum() * 0.999  # a row summing to a little under 1 (float32 softmax rows do)
    N = 20000
    draws = sample_rows(p.repeat(N, 1), torch.Generator().manual_seed(0)).view(N, 3)
    for r in range(3):
        counts = torch.bincount(draws[:, r], minlength=10).double()
        assert counts[p[r] == 0].sum() == 0, (r, counts)
        keep = p[r] > 0
        expected = N * p[r].double()[keep] / p[r].double().sum()
        if keep.sum() > 1:
            chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
            assert chi2 < chi2_limit(int(keep.sum()) - 1), (r, chi2, counts.tolist())
        else:
            assert counts[keep].item() == N


def test_same_generator_state_same_draws():
    p = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(1)) * 3, -1)
    a = sample_rows(p, torch.Generator().manual_seed(7))
    b = sample_rows(p, torch.Generator().manual_seed(7))
    assert a.tolist() == b.tolist() and a.dtype == torch.long and a.shape == (5,)


def test_u_rounded_up_to_the_total_takes_the_last_token_with_probability(monkeypatch):
    """u * total can round to the total when u is within ~1e-16 of 1: the draw must still be a token
    of positive probability (the last one), not the index past the end or a trailing zero."""
    monkeypatch.setattr(sampling.torch, "rand",
                        lambda n, generator=None, dtype=None: torch.ones(n, dtype=dtype))
    p = torch.tensor([[0.25, 0.5, 0.25, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    assert sample_rows(p, None).tolist() == [2, 4]
