"""The corpus builder's command line is cli/corpus.py (tests/data/test_corpus.py runs it in-process). The
spelling it was once run with, `python -m dflash_train.data.corpus`, ran the module as a script: now that
the module is the library alone it would define its functions and exit 0, building nothing, unsaid."""

import subprocess
import sys

from conftest import ROOT


def test_the_old_data_corpus_spelling_names_the_new_one():
    done = subprocess.run([sys.executable, "-m", "dflash_train.data.corpus", "--conversations", "3000"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert done.stderr == ("error: the corpus builder's command line is now python -m "
                           "dflash_train.cli.corpus (same flags)\n")
