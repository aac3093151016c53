"""Progress bars: live in a terminal, a line every 30 s in logs (CI, nohup, Slurm)."""

import sys

BAR_INTERVAL = 0.5 if sys.stderr.isatty() else 30.0  # tqdm mininterval, seconds
