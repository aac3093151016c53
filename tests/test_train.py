"""dflash_train/train.py, the public training script: run as a file under each launcher (accelerate on
one process and on two, torchrun), it is our command, and a bad recipe value is our one line."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT

LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision",
          "no", "--dynamo_backend", "no"]
LAUNCHERS = {"accelerate": [*LAUNCH, "--num_processes", "1"],
             "accelerate-multi-gpu": [*LAUNCH, "--multi_gpu", "--num_processes", "2", "--main_process_port",
                                      "0"],
             "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                          "2"]}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_bad_recipe_value_under_each_launcher_is_our_line_once_and_first(launcher, tmp_path):
    """Every process meets the bad value; one line is printed, before the launcher's own report
    (which exits 1 for any failed child: see docs/troubleshooting.md)."""
    r = subprocess.run([*LAUNCHERS[launcher], "dflash_train/train.py", "train.betas=[0.9, 1.5]",
                        f"output_dir={tmp_path / 'o'}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ours = "error: recipe 'recipes/tiny.yaml': 'train.betas.1': Input should be less than 1 (got 1.5)"
    lines = r.stderr.splitlines()
    assert (lines[0] == ours and [line for line in lines if line.startswith("error")]
            == [ours]), r.stderr[-3000:]
    assert str(ROOT / "dflash_train") not in r.stderr  # no traceback through our code
    assert r.returncode == 1 and not (tmp_path / "o").exists()

