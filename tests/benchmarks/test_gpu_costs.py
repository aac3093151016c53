"""benchmarks/gpu_costs.py runs end to end on the tiny shape on CPU and writes every JSON key, and
measures what dflash-eval's --verify-times needs for issue 20: the verify cost's context axis and the
scored trees' and chain walks' costs. (The full-size GPU run is never part of the test suite.)"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np

from conftest import ROOT
from dflash_train.evaluation.summary import device_costs_model


def test_tiny_cpu_run_writes_all_costs(tmp_path):
    out = tmp_path / "c.json"
    # One intra-op thread: on a few busy cores torch's worker threads wait on each other and
    # a run that takes seconds can take half a minute.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_costs.py"), "--tiny", "--device", "cpu",
         "--dtype", "float32", "--repeats", "2", "--widths", "1,2,4", "--budgets", "4,8", "--draft-batches",
         "1,3", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    costs = json.loads(out.read_text())
    for key in ["device", "torch", "cuda", "driver", "context"]:
        assert key in costs
    assert costs["context"] == 512
    assert set(costs["verify_ms_by_width"]) == {"1", "2", "4"}
    assert set(costs["tree_build_ms_by_budget"]) == {"4", "8"}
    assert set(costs["ddtree_step_ms_by_budget"]) == {"4", "8"}
    assert set(costs["draft_ms_by_batch"]) == {"1", "3"}
    times = [*costs["verify_ms_by_width"].values(), costs["draft_ms"], *costs["draft_ms_by_batch"].values(),
             *costs["tree_build_ms_by_budget"].values(),
             costs["chain_step_ms"], *costs["ddtree_step_ms_by_budget"].values()]
    assert all(isinstance(t, float) and t > 0 for t in times), times


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
    keys = {"dspark-vanilla", "dspark-gated", "dspark-rnn", "dflash2", "xpress"}
    assert costs["tree_build_ms_by_scores"].keys() == keys and costs["chain_walk_ms_by_scores"].keys() == keys
    assert all(t > 0 for k in keys for t in [*costs["tree_build_ms_by_scores"][k].values(),
                                             costs["chain_walk_ms_by_scores"][k]])
    curves, _ = device_costs_model(costs, 2, 1)  # the eval reads it: 4 requests after 64 tokens = 1 after 256
    assert curves.contexts == [256] and curves.context == 64
    assert np.isfinite(curves.verify_at(4, 1)[0]) and curves.verify_at(4, 1)[0] > 0
    assert curves.extrapolated(4, 1) == [] and curves.extrapolated(8, 1) == ["context", "width at context"]
