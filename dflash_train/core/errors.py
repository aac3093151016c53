"""User-facing errors: one line on stderr, exit code 2, no traceback (see cli_guard).

Under a launcher (torchrun, `accelerate launch --multi_gpu`) every process meets the same bad
input; only the first process of each machine (LOCAL_RANK 0) prints the line, all exit 2. The
others wait first, and print their line themselves if the launcher has not stopped them by then.
"""

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import wraps


OTHER_RANKS_WAIT_S = 10


class UserError(Exception):
    """Bad input from the user (recipe, paths, data, flags). The message is one line."""


class Interrupted(Exception):
    """Ctrl-C, with what to do next ("interrupted at step 7; rerun the same command to ...")."""


def say(line: str) -> None:
    """Print one line to stderr, once per machine under a multi-process launcher."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def cli_guard(main: Callable) -> Callable:
    """A UserError -> `error: <message>` on stderr and exit code 2; Ctrl-C -> one line and exit code 130."""

    @wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            if os.environ.get("LOCAL_RANK", "0") != "0":
                # Every process meets the same input at about the same time, and the launcher stops
                # the rest ~0.1 s after the first one exits: exiting at once here let torchrun
                # SIGTERM local rank 0 before it had printed (1 run in 3). So wait; still alive
                # after that, this rank met an error rank 0 did not, and says it itself.
                time.sleep(OTHER_RANKS_WAIT_S)
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        except (Interrupted, KeyboardInterrupt) as e:
            # a newline first: a progress bar may have been cut mid-line
            say("\n" + (str(e) if isinstance(e, Interrupted) else "interrupted"))
            sys.exit(130)

    return wrapped


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one `error:` line and exit code 2 (no usage dump)."""

    def error(self, message: str):
        say(f"error: {self.prog}: {message}")
        sys.exit(2)
