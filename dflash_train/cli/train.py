"""`dflash-train`: the command line of training (training/trainer.py runs it).

    accelerate launch dflash_train/train.py --recipe R.yaml output_dir=runs/x max_steps=50
    dflash-train --recipe R.yaml key=value ...                                # same entry

Overrides are dotted keys of the recipe (training/config.py), before or after --recipe. A bad input
is one `error:` line and exit code 2; after Ctrl-C one line names the last step done and the step a
rerun resumes from.
"""

import argparse
import signal
import sys

from dflash_train.core.errors import Interrupted, OneLineArgumentParser, UserError, cli_guard
from dflash_train.training.config import DEFAULT_RECIPE, load_recipe
from dflash_train.training.run_dir import interrupted_line
from dflash_train.training.setup import resolve_recipe_paths
from dflash_train.training.trainer import train


class Once(argparse.Action):
    """An option given twice is refused (argparse keeps the last silently)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option_string} is given twice ('{getattr(namespace, self.dest)}', '{values}'): "
                         "give one recipe, and change its keys with key=value overrides")
        setattr(namespace, self.dest, values)


def parse_args(argv):
    p = OneLineArgumentParser(prog="dflash-train", description="Train a DFlash drafter.",
                              epilog="Overrides are dotted keys of the recipe, e.g. train.lr=1e-4 "
                                     "max_steps=50, before or after --recipe.")
    p.add_argument("--recipe", default=None, action=Once, help=f"YAML recipe (default {DEFAULT_RECIPE})")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    # intermixed: `key=value --recipe R key=value` (plain parse_args took the overrides before
    # --recipe and refused those after it as unrecognized arguments)
    return p.parse_intermixed_args(argv)


@cli_guard
def main(argv=None):
    args = parse_args(argv)
    cfg = resolve_recipe_paths(load_recipe(args.recipe, args.overrides))
    handler = signal.getsignal(signal.SIGINT)
    try:
        return train(cfg)
    except KeyboardInterrupt:
        stopped = Interrupted(interrupted_line(cfg))
    except UserError as e:
        stopped = UserError(str(e))  # without its traceback, which holds the loop's frames
    finally:
        signal.signal(signal.SIGINT, handler)  # whatever way train() left (StopRequest replaces it)
    # Raised outside the except block, so the stopped frames are freed first: their progress
    # bars close (print their last state) before our line, which comes last.
    raise stopped


if __name__ == "__main__":
    sys.exit(main())
