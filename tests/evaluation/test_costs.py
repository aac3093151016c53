"""The concurrency cost model's context axis (issue 20): synthetic devices where the answer is
known, the measured grid and what the report says about it, and the measurement itself."""


import numpy as np
import pytest
import torch

from dflash_train.evaluation import speed
from dflash_train.evaluation.costs import measure_costs
from dflash_train.evaluation.run import EvalSettings
from dflash_train.evaluation.summary import cost_grid, device_costs_model, predictions
from dflash_train.evaluation.sweep import Sample

# A synthetic device: a fixed cost, a per-token cost, a per-context-token cost (each request's KV
# cache read and copied) and a per-attended-pair cost (a query against a key, padded tree included).
A, B, C, D = 5.0, 0.05, 0.004, 1e-4
P0 = 100
WIDTHS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
CONTEXT_WIDTHS = [1, 16, 256]


def batched(requests: int, width: int, context: int) -> float:
    """ms of one verify forward of `requests` requests of `width` tokens after `context` each."""
    N, w, P = requests, width, context
    return A + B * N * w + C * N * P + D * N * w * (P + w)


def curves_for(contexts: list[int]) -> speed.Curves:
    """What measure_costs would measure on the synthetic device: one request at every width after
    P0 tokens, and at CONTEXT_WIDTHS after each of `contexts` (none: the old width-only curve)."""
    return speed.Curves(WIDTHS, np.array([[batched(1, w, P0) for w in WIDTHS]]), [1, 4],
                        np.array([[1.0, 1.5]]), P0, contexts, CONTEXT_WIDTHS if contexts else [],
                        np.array([[[batched(1, w, t) for w in CONTEXT_WIDTHS] for t in contexts]])
                        if contexts else None)


@pytest.mark.parametrize("requests,width", [(16, 1), (4, 1), (4, 64), (4, 65), (16, 64), (16, 4), (16, 257)])
def test_n_requests_cost_n_contexts(requests, width):
    """16 plain-decoding requests read 16 KV caches: the width-only curve misses that (the 5.3x
    of issue 20), the context axis measured at 4 and 16 x the context gets it exactly, and wide
    batches (16 x 64) no longer pay for attention pairs that only one wide request would compute,
    between measured widths and beyond the widest (16 x 257 = 4112) too."""
    truth = batched(requests, width, P0)
    old, new = curves_for([]), curves_for([4 * P0, 16 * P0])
    assert new.verify_at(requests, width)[0] == pytest.approx(truth, rel=1e-9)
    assert new.per_pair_ms()[0] == pytest.approx(D)
    assert abs(old.verify_at(requests, width)[0] / truth - 1) > 0.15  # the width curve alone is off
    # one request: the curve itself
    assert new.verify_at(1, width)[0] == pytest.approx(old.verify_at(1, width)[0])


def test_context_between_measured_totals_is_interpolated():
    """Totals between measured ones: linear in context, exact for this device."""
    new = curves_for([4 * P0, 16 * P0])
    assert new.verify_at(8, 4)[0] == pytest.approx(batched(8, 4, P0))  # T = 800: between 400 and 1600
    assert new.extrapolated(8, 4) == []
    assert new.extrapolated(32, 4) == ["context"]  # T = 3200 > 1600, along the last segment
    assert new.extrapolated(4, 300) == ["width"] + ["width at context"]  # 1200 > 1024, 1200 > 256
    assert new.verify_at(32, 4)[0] == pytest.approx(batched(32, 4, P0))  # linear device: still exact


def test_ar_slows_with_context_so_speculation_gains_more():
    """16 requests: AR's verify forward grows by 16 contexts; a budget-15 tree's forward grows
    less in proportion, so the predicted speedup goes up once the context axis is measured."""
    tau = np.full((4, 1), 3.0)
    st = {"draft": np.full((4, 1), 1.0), "host": np.full((4, 1), 0.1),
          "verify": np.full((4, 1), batched(1, 16, P0))}
    ar = {"draft": np.zeros((4, 1)), "host": np.full((4, 1), 0.05),
          "verify": np.full((4, 1), batched(1, 1, P0))}
    draws, curves = speed.resample(4, 1), curves_for([4 * P0, 16 * P0])
    old = speed.predicted_speedup(tau, st, ar, "ddtree", 15, 16, curves_for([]), draws)[0]
    new = speed.predicted_speedup(tau, st, ar, "ddtree", 15, 16, curves, draws)[0]
    draft = curves.draft_factor(16)[0]  # the drafter pass for 16 requests / for one
    expected = 3.0 * (16 * 0.05 + batched(16, 1, P0)) / (draft + 16 * 0.1 + batched(16, 16, P0))
    assert new == pytest.approx(expected, rel=1e-6) and abs(old / expected - 1) > 0.1


def _by_method():
    samples = []
    for i in range(4):
        samples.append(Sample(0, i, 0, "ar", 0, accept_lengths=[1] * 12, decoded=12, stage_s={
            "draft": 0.0, "tree": 0.0, "verify": 12 * batched(1, 1, P0) / 1e3, "commit": 0.0}))
        samples.append(Sample(0, i, 0, "ddtree", 16, accept_lengths=[4] * 3, decoded=12, stage_s={
            "draft": 0.003, "tree": 0.0, "verify": 3 * batched(1, 17, P0) / 1e3, "commit": 0.0}))
    return {m: [x for x in samples if (x.method, x.budget) == m] for m in [("ar", 0), ("ddtree", 16)]}


def test_report_says_which_grid_points_were_measured():
    """report.json's costs: every measured (width, context) point and the model; each prediction:
    whether, and along which axis, it reads beyond them."""
    rounds = 3
    costs = {"context": P0, "widths": WIDTHS, "batches": [1, 4],
             "verify_ms": [[batched(1, w, P0) for w in WIDTHS]] * rounds, "draft_ms": [[1.0, 1.5]] * rounds,
             "contexts": [4 * P0, 16 * P0], "context_widths": CONTEXT_WIDTHS,
             "context_verify_ms": [[[batched(1, w, t) for w in CONTEXT_WIDTHS]
                                    for t in [4 * P0, 16 * P0]]] * rounds}
    curves = speed.Curves.from_rounds(costs, resamples=20)
    grid = cost_grid(costs, curves)
    assert [1024, P0] in grid["measured_grid"] and [256, 16 * P0] in grid["measured_grid"]
    assert [1024, 16 * P0] not in grid["measured_grid"]
    assert grid["verify_ms_by_context"]["1600"]["16"] == pytest.approx(batched(1, 16, 1600), abs=1e-4)
    assert grid["per_pair_ms"] == pytest.approx(D) and "context" in grid["model"]

    from dflash_train.evaluation.summary import measured_stages
    settings = EvalSettings(drafter="d", output="o", temperature=0.0, repeats=1, concurrency=[1, 4, 16, 32])
    rows, _ = predictions(_by_method(), [("ar", 0), ("ddtree", 16)], 4, settings, speed.resample(4, 1, 20),
                          curves, measured_stages(4, 1))
    tree = rows[("ddtree", 16)]
    assert tree["4"]["extrapolated"] is False and tree["4"]["extrapolated_axes"] == []
    assert tree["16"]["extrapolated_axes"] == ["width at context"]  # 272 wide: beyond 256 at 1600 tokens
    assert tree["32"]["extrapolated_axes"] == ["context", "width at context"]  # 3200 tokens > 1600
    assert rows[("ar", 0)]["32"]["extrapolated_axes"] == ["context"]


def test_width_only_costs_say_so():
    """No context axis (an old costs JSON): the model says the cost grows by width only."""
    costs = {"context": P0, "widths": WIDTHS, "batches": [1],
             "verify_ms": [[batched(1, w, P0) for w in WIDTHS]], "draft_ms": [[1.0]]}
    grid = cost_grid(costs, speed.Curves.from_rounds(costs, resamples=5))
    assert grid["measured_grid"] == [[w, P0] for w in WIDTHS] and "width only" in grid["model"]
    old = curves_for([])  # also with no context at all (a width-only costs JSON from --verify-times)
    old.context = None
    assert old.extrapolated(4, 300) == ["width"] and old.extrapolated(4, 3) == []


def test_device_costs_with_a_context_axis():
    """--verify-times: a gpu_costs.py JSON with verify_ms_by_context predicts N contexts too."""
    dev = {"device": "GPU", "context": P0, "draft_ms": 1.0,
           "verify_ms_by_width": {str(w): batched(1, w, P0) for w in WIDTHS},
           "verify_ms_by_context": {str(t): {str(w): batched(1, w, t) for w in CONTEXT_WIDTHS}
                                    for t in [400, 1600]}}
    curves, _ = device_costs_model(dev, 4, 1)
    assert curves.verify_at(16, 1)[0] == pytest.approx(batched(16, 1, P0))
    del dev["verify_ms_by_context"]
    curves, _ = device_costs_model(dev, 4, 1)
    assert curves.verify_at(16, 1)[0] == pytest.approx(batched(1, 16, P0))  # width only, as before


def test_measure_costs_times_the_longer_contexts(tiny_target):
    """The measured grid: every width after `context`, CONTEXT_WIDTHS after each longer total,
    each round; totals not longer than `context` are dropped."""
    from dflash_train.training.build import drafter_config_for
    from dflash_train.training.config import ModelConfig
    from dflash_train.model.drafter import DFlashDrafter
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config_for(tiny_target, ModelConfig(num_layers=1, block_size=4))).eval()
    costs = measure_costs(tiny_target, drafter, 8, [1], widths=[1, 2, 4], rounds=2, contexts=[8, 32, 16],
                          context_widths=[1, 4])
    assert costs["contexts"] == [16, 32] and costs["context_widths"] == [1, 4]
    assert np.asarray(costs["context_verify_ms"]).shape == (2, 2, 2)
    assert (np.asarray(costs["verify_ms"]).shape == (2, 3)
            and (np.asarray(costs["context_verify_ms"]) > 0).all())


def test_device_costs_count_the_scored_tree_and_the_chain_walk():
    """A DSpark (or DFlash2) drafter on --verify-times: its DDTree costs the path-conditioned build
    and its chain the per-round walk, per request; a DFlash drafter still the plain build."""
    from types import SimpleNamespace

    from dflash_train.evaluation.summary import scorer_key
    dev = {"device": "GPU", "context": P0, "draft_ms": 1.0, "verify_ms_by_width": {"1": 10.0, "17": 11.0},
           "tree_build_ms_by_budget": {"16": 0.5}, "tree_build_ms_by_scores": {"dspark-gated": {"16": 2.0},
                                                                             "dflash2": {"16": 0.8}},
           "chain_walk_ms_by_scores": {"dspark-gated": 0.3, "dflash2": 0.1}}
    gated = SimpleNamespace(variant="dspark", markov_rank=256, markov_head_type="gated", selector_rank=0)
    plain = SimpleNamespace(variant="dflash", markov_rank=0, markov_head_type="vanilla", selector_rank=0)
    dflash2 = SimpleNamespace(variant="dflash2", markov_rank=0, markov_head_type="vanilla", selector_rank=256)
    assert scorer_key(gated, "conditional") == ("dspark-gated", "dspark-gated")
    assert scorer_key(gated, "marginal") == (None, "dspark-gated")  # the chain walks whatever the tree
    assert (scorer_key(dflash2, "conditional") == ("dflash2", "dflash2") and scorer_key(plain, "conditional")
            == (None, None))
    host = lambda scores, m: device_costs_model(dev, 2, 1, scores)[1](m, [])["host"][0, 0]  # noqa: E731
    assert host(scorer_key(gated, "conditional"), ("ddtree", 16)) == 2.0
    assert host(scorer_key(gated, "conditional"), ("dflash", 15)) == 0.3
    assert host(scorer_key(dflash2, "conditional"), ("ddtree", 16)) == 0.8
    assert host(scorer_key(gated, "marginal"), ("ddtree", 16)) == 0.5
    assert host(scorer_key(plain, "conditional"), ("ddtree", 16)) == 0.5
    assert host(scorer_key(plain, "conditional"), ("dflash", 15)) == 0.0


def test_widths_for_times_only_what_predictions_read():
    from dflash_train.evaluation.costs import CONTEXT_WIDTHS, VERIFY_WIDTHS, widths_for

    assert widths_for(8) == ([1, 2, 4, 8], [1, 8])          # the chain of a block-8 drafter, one request
    assert widths_for(65) == ([1, 2, 4, 8, 16, 32, 64, 128], [1, 32, 128])  # DDTree@64
    assert widths_for(260) == (VERIFY_WIDTHS[:10], [1, 32, 512])           # 4 requests x DDTree@64
    assert widths_for(16 * 257) == (VERIFY_WIDTHS, CONTEXT_WIDTHS)          # past 1024: the whole grid
