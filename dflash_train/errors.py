"""User-facing errors: one line on stderr, exit code 2, no traceback (see cli_guard)."""

import argparse
import sys
from collections.abc import Callable
from functools import wraps


class UserError(Exception):
    """Bad input from the user (recipe, paths, data, flags). The message is one line."""


def cli_guard(main: Callable) -> Callable:
    """Turn a UserError into `error: <message>` on stderr and exit code 2."""

    @wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapped


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one `error:` line and exit code 2 (no usage dump)."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        sys.exit(2)
