"""Paired speedups, bootstrap intervals, advice that admits ties and the concurrency cost model,
on synthetic numbers with known answers (no timing here: timings belong in benchmarks/)."""

import numpy as np
import pytest

from dflash_train.evaluation import speed


def test_paired_ratio_cancels_load_that_hits_both_methods():
    """Per prompt the method is s_i times faster than AR; from prompt 10 on the machine is 3x
    slower for both (as when every prompt runs all methods back to back). The paired median is
    the median of s_i whatever the load."""
    rng = np.random.default_rng(0)
    s = rng.uniform(1.5, 2.5, size=20)
    load = np.where(np.arange(20) >= 10, 3.0, 1.0)
    ar = (rng.uniform(0.8, 1.2, size=20) * load)[:, None]  # [n, R=1] seconds per token
    method = ar / s[:, None]
    draws = speed.resample(20)
    got = speed.paired_speedup(ar, method, draws)
    assert got[0] == pytest.approx(np.median(s))
    lo, hi = speed.interval(got)
    assert s.min() <= lo <= np.median(s) <= hi <= s.max()


def test_resamples_start_with_the_data_and_are_reproducible():
    prompts, reps = speed.resample(5, 3, resamples=50, seed=4)
    assert prompts.shape == (51, 5) and reps.shape == (51, 5, 3)
    assert prompts[0].tolist() == [0, 1, 2, 3, 4] and reps[0].tolist() == [[0, 1, 2]] * 5
    again = speed.resample(5, 3, resamples=50, seed=4)
    assert np.array_equal(prompts, again[0]) and np.array_equal(reps, again[1])
    values = np.arange(15, dtype=float).reshape(5, 3)
    assert speed.median_over(values, (prompts, reps))[0] == 7.0


def test_repeat_noise_widens_the_interval_even_for_one_prompt():
    draws = speed.resample(1, 8)
    noisy = np.array([[1.8, 2.2, 1.9, 2.1, 2.0, 1.7, 2.3, 2.0]])
    lo, hi = speed.interval(speed.median_over(noisy, draws))
    assert 1.7 <= lo < 2.0 < hi <= 2.3
    assert speed.interval(speed.median_over(np.full((1, 8), 2.0), draws)) == [2.0, 2.0]


def test_nan_samples_are_left_out():
    values = np.array([[1.0], [np.nan], [3.0]])
    assert speed.median_over(values, speed.resample(3))[0] == 2.0
    assert np.isnan(speed.median_over(np.full((2, 1), np.nan), speed.resample(2))).all()


def _resampled(center: float, spread: float, n: int = 400, seed: int = 0) -> np.ndarray:
    """A resampled statistic: point `center`, resamples center * (1 + spread * noise)."""
    noise = np.random.default_rng(seed).standard_normal(n)
    return np.concatenate([[center], center * (1 + spread * noise)])


def test_verdict_names_a_clear_winner():
    ones = np.ones(401)
    common = np.random.default_rng(1).standard_normal(400)  # shared prompt noise: paired
    values = {("ar", 0): ones, ("dflash", 7): np.concatenate([[2.0], 2.0 * (1 + 0.1 * common)]),
              ("ddtree", 16): np.concatenate([[2.6], 2.6 * (1 + 0.1 * common)])}
    v = speed.verdict(values)
    assert v["recommended"] == {"method": "ddtree", "budget": 16} and v["indistinguishable"] == []
    assert v["speedup"] == 2.6 and v["interval"][0] < 2.6 < v["interval"][1]
    assert speed.verdict_text(v).startswith("DDTree budget **16**: 2.60x over plain decoding (90% interval")


def test_verdict_lists_what_it_cannot_tell_apart():
    values = {("ar", 0): np.ones(401), ("dflash", 7): _resampled(2.0, 0.1, seed=2),
              ("ddtree", 16): _resampled(2.1, 0.1, seed=3), ("ddtree", 64): _resampled(1.2, 0.02, seed=4)}
    v = speed.verdict(values)
    assert v["recommended"] is None and v["best"] == {"method": "ddtree", "budget": 16}
    assert v["indistinguishable"] == [{"method": "ddtree", "budget": 16}, {"method": "dflash", "budget": 7}]
    text = speed.verdict_text(v)
    assert text.startswith("no single best: budget 16 and the DFlash chain are indistinguishable")


def test_verdict_can_prefer_plain_decoding():
    values = {("ar", 0): np.ones(401), ("dflash", 7): _resampled(0.6, 0.05),
              ("ddtree", 16): _resampled(0.4, 0.05)}
    v = speed.verdict(values)
    assert v["recommended"] == {"method": "ar", "budget": 0}
    assert speed.verdict_text(v) == "**plain decoding**: no speculative method is faster here."


def test_cost_at_width_is_linear_between_and_beyond_measured_widths():
    widths, table = [1, 4, 16], np.array([[10.0, 10.0, 22.0]])
    assert speed.at_width(widths, table, 1)[0] == 10.0
    assert speed.at_width(widths, table, 10)[0] == pytest.approx(16.0)  # halfway from 4 to 16
    assert speed.at_width(widths, table, 28)[0] == pytest.approx(34.0)  # last segment's slope, 1 ms/token
    assert speed.at_width([1], np.array([[3.0]]), 4)[0] == 12.0  # one point: proportional


def _stages(draft, host, verify, shape=(6, 2)):
    return {k: np.full(shape, v) for k, v in [("draft", draft), ("host", host), ("verify", verify)]}


def test_prediction_at_one_request_is_the_measured_ratio():
    rng = np.random.default_rng(5)
    n, R = 6, 2
    tau = rng.uniform(2, 5, size=(n, R))
    st = {k: rng.uniform(0.5, 3, size=(n, R)) for k in ["draft", "host", "verify"]}
    ar = {"draft": np.zeros((n, R)), "host": rng.uniform(0.1, 0.3, (n, R)),
          "verify": rng.uniform(5, 8, (n, R))}
    curves = speed.Curves([1, 2, 1024], np.array([[5.0, 5.5, 90.0]]), [1, 4], np.array([[1.0, 2.0]]))
    draws = speed.resample(n, R)
    got = speed.predicted_speedup(tau, st, ar, "ddtree", 16, 1, curves, draws)
    ar_tpot = ar["host"] + ar["verify"]  # one token per AR round
    tpot = (st["draft"] + st["host"] + st["verify"]) / tau
    assert np.allclose(got, speed.paired_speedup(ar_tpot, tpot, draws))


def test_prediction_for_concurrent_requests_by_hand():
    """4 requests of budget 15: drafter pass at batch 4, 4 x host work, one verify of width 64;
    AR: 4 x host, one verify of width 4. Stage times equal to the curve's own values, so the
    anchored model is the absolute one written out here."""
    verify = lambda w: 4.0 + 0.25 * w  # noqa: E731  affine, so linear interpolation is exact
    widths = [1, 2, 4, 8, 16, 32, 64]
    curves = speed.Curves(widths, np.array([[verify(w) for w in widths]]), [1, 4], np.array([[1.5, 2.5]]))
    tau = np.full((6, 2), 3.0)
    st = _stages(1.5, 0.2, verify(16))
    ar = _stages(0.0, 0.05, verify(1))
    got = speed.predicted_speedup(tau, st, ar, "ddtree", 15, 4, curves, speed.resample(6, 2))
    expected = 3.0 * (4 * 0.05 + verify(4)) / (2.5 + 4 * 0.2 + verify(64))
    assert got[0] == pytest.approx(expected) and speed.interval(got) == [round(expected, 3)] * 2
    ar_self = speed.predicted_speedup(np.ones((6, 2)), ar, ar, "ar", 0, 4, curves, speed.resample(6, 2))
    assert np.allclose(ar_self, 1.0)
