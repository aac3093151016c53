"""benchmarks/gpu_costs.py (at the tiny shape, on CPU) measures what dflash-eval's --verify-times
needs for issue 20: the verify cost's context axis and the scored trees' and chain walks' costs."""

import importlib.util
import json
from pathlib import Path

import numpy as np

from dflash_train.eval import device_costs_model

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_run_writes_the_context_axis_and_scored_costs(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_costs", ROOT / "benchmarks" / "gpu_costs.py")
    gpu_costs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_costs)
    out = tmp_path / "c.json"
    gpu_costs.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--repeats", "1", "--context", "64",
                    "--widths", "1,4,16", "--budgets", "4", "--draft-batches", "1", "--contexts", "32,256",
                    "--context-widths", "1,4", "--out", str(out)])
    costs = json.loads(out.read_text())
    assert costs["verify_ms_by_context"].keys() == {"256"}  # 32 is not longer than --context
    assert costs["verify_ms_by_context"]["256"].keys() == {"1", "4"}
    keys = {"dspark-vanilla", "dspark-gated", "dspark-rnn", "dflash2"}
    assert costs["tree_build_ms_by_scores"].keys() == keys and costs["chain_walk_ms_by_scores"].keys() == keys
    assert all(t > 0 for k in keys for t in [*costs["tree_build_ms_by_scores"][k].values(),
                                             costs["chain_walk_ms_by_scores"][k]])
    curves, _ = device_costs_model(costs, 2, 1)  # the eval reads it: 4 requests after 64 tokens = 1 after 256
    assert curves.contexts == [256] and curves.context == 64
    assert np.isfinite(curves.verify_at(4, 1)[0]) and curves.verify_at(4, 1)[0] > 0
    assert curves.extrapolated(4, 1) == [] and curves.extrapolated(8, 1) == ["context", "width at context"]

