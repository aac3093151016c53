"""The command lines (argparse + main): dflash-train, -eval, -export, -prepare, -cache. Nothing else imports them.
Here: the `main` the commands that write one --output share (locked_main)."""

from collections.abc import Callable
from pathlib import Path

from dflash_train.core.errors import cli_guard
from dflash_train.core.outputs import output_lock


def locked_main(parse_args: Callable, run: Callable) -> Callable:
    """A console script's `main(argv=None)`: parse_args(argv) -> settings with an `output`, then
    run(settings) holding that output's lock; a UserError is one `error:` line and exit 2 (cli_guard)."""

    @cli_guard
    def main(argv=None):
        settings = parse_args(argv)
        with output_lock(Path(settings.output), "--output"):  # one dflash-train process per output
            run(settings)

    return main
