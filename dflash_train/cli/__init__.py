"""The command lines (argparse + main): dflash-train, -eval, -export, -prepare, -cache, the corpus builder
(corpus.py) and make real-target (real_target.py). Nothing else imports them.
Here: the `main` the commands that write one --output share (locked_main), and their flags' defaults
read from the settings dataclass they fill (defaults_of).
"""

from collections.abc import Callable
from dataclasses import MISSING, fields
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


def defaults_of(settings_class) -> dict:
    """A settings dataclass's defaults by field, for ArgumentParser.set_defaults (each flag's dest is
    its field): a default is stated once, in the dataclass, for the library and the command line."""
    return {f.name: f.default_factory() if f.default is MISSING else f.default
            for f in fields(settings_class) if f.default is not MISSING or f.default_factory is not MISSING}
