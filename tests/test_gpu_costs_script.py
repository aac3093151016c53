"""benchmarks/gpu_costs.py runs end to end on the tiny shape on CPU and writes every JSON key.
(The full-size GPU run is never part of the test suite.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_cpu_run_writes_all_costs(tmp_path):
    out = tmp_path / "c.json"
    # One intra-op thread: on a few busy cores torch's worker threads wait on each other and
    # a run that takes seconds can take half a minute.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_costs.py"), "--tiny", "--device", "cpu",
         "--dtype", "float32", "--repeats", "2", "--widths", "1,2,4", "--budgets", "4,8", "--draft-batches", "1,3", "--out", str(out)],
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
