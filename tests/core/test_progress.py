"""core/progress.py: progress bars redraw live in a terminal but write a line only every 30 s when
stderr is a log file or pipe (CI, nohup, Slurm), where each redraw would be a line of its own."""

import os
import pty
import subprocess
import sys

from conftest import ROOT

PRINT_INTERVAL = "from dflash_train.core.progress import BAR_INTERVAL; print(BAR_INTERVAL)"


def test_a_log_gets_a_line_every_30_s():
    done = subprocess.run([sys.executable, "-c", PRINT_INTERVAL], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0 and float(done.stdout) == 30.0


def test_a_terminal_gets_a_live_bar():
    main, terminal = pty.openpty()
    try:
        done = subprocess.run([sys.executable, "-c", PRINT_INTERVAL], stdout=subprocess.PIPE, stderr=terminal,
                              text=True, cwd=ROOT, timeout=120)
    finally:
        os.close(terminal)
        os.close(main)
    assert done.returncode == 0 and float(done.stdout) == 0.5
