"""The public training script: `accelerate launch dflash_train/train.py ...`, `torchrun dflash_train/train.py
...` and `python -m dflash_train.train ...` all run `dflash-train` (cli/train.py; the trainer:
training/trainer.py)."""

import os
import sys

if __name__ == "__main__" and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
    # run as a file: dflash_train/ must not be an import root (its data/, model/ would shadow)
    sys.path.pop(0)

from dflash_train.cli.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
