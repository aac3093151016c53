"""The corpus builder's command line is cli/corpus.py (tests/data/test_corpus.py runs it in-process); the
spelling docs and the committed corpus's history name, `python -m dflash_train.data.corpus`, hands over to it."""

import subprocess
import sys

from conftest import ROOT


def test_the_data_corpus_spelling_runs_the_command_line():
    done = subprocess.run([sys.executable, "-m", "dflash_train.data.corpus", "--chunk", "0"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert (done.returncode, done.stderr) == (2, "error: corpus.py: --chunk must be >= 1\n")
