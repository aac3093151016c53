"""A training run's output folder: what becomes of output_dir (decided before anything loads),
opening it once everything is checked, Ctrl-C as a request to stop after the step, and the line
said after it."""

import json
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from dflash_train.checkpoint.folders import newest_checkpoint
from dflash_train.core.errors import UserError
from dflash_train.core.outputs import (KINDS, MARKER, check_cwd_outside, check_folder_path, check_writable,
                                       is_empty, marker_kind, move_aside, refuse_overlap, write_marker)
from dflash_train.training.config import RunConfig
from dflash_train.training.resume import check_same_recipe, saved_recipe


@dataclass
class OutputPlan:
    resume: Path | None  # the checkpoint to resume from
    replace: bool  # output_dir holds an earlier run of ours, deleted once the new run is set up
    note: str | None  # what happens to output_dir, said at the start


def describe_run(out: Path) -> str:
    """What deleting a run folder loses, e.g. "3 checkpoints up to step 9, final/, metrics.jsonl"."""
    steps = sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*") if p.name[5:].isdigit())
    parts = [f"{len(steps)} checkpoint{'s' * (len(steps) != 1)} up to step {steps[-1]}"] if steps else []
    parts += sorted(p.name + "/" * p.is_dir() for p in out.iterdir() if p.name not in (MARKER, "checkpoints"))
    return ", ".join(parts) or "nothing"


def plan_output_dir(cfg: RunConfig) -> OutputPlan:
    """Decide what becomes of output_dir, before anything is loaded or written: start in an empty
    one, resume from its newest checkpoint, start again a run of ours that stopped before its first
    checkpoint, or (overwrite=true) replace a run of ours. Anything else is refused."""
    out = Path(cfg.output_dir)
    check_folder_path(out, "output_dir")
    m, d = cfg.model, cfg.data
    refuse_overlap(out,
                   [("model.target", m.target), ("model.init_from", m.init_from), ("data.train", d.train),
                    ("data.val", d.val), ("data.hidden_state_cache", d.hidden_state_cache)], "output_dir")
    check_writable(out, "output_dir")
    if is_empty(out):
        return OutputPlan(None, False, None)
    kind, newest = marker_kind(out), newest_checkpoint(out)
    if kind not in (None, "train"):
        raise UserError(f"output_dir '{out}' holds {KINDS.get(kind, kind)}, not a training run: "
                        "choose another output_dir")
    if kind is None and newest is None:  # checkpoints are ours even in a folder from before the marker
        raise UserError(f"output_dir '{out}' is not empty and was not written by dflash-train (no {MARKER}): "
                        "choose another output_dir, or empty it yourself")
    what = describe_run(out)
    if cfg.overwrite:
        if kind is None:
            raise UserError(f"output_dir '{out}' has no {MARKER} (written before dflash-train marked its "
                            "runs), so overwrite=true will not delete it: delete it yourself, or choose "
                            "another output_dir")
        check_cwd_outside(out, "output_dir")
        return OutputPlan(None, True,
                          f"overwrite=true: the run in '{out}' ({what}) is deleted once the new run "
                          "is set up")
    if (out / "summary.json").is_file():
        raise UserError(f"output_dir '{out}' holds a finished run: overwrite=true deletes it ({what}), "
                        "or choose another output_dir")
    if newest is None:
        check_cwd_outside(out, "output_dir")
        return OutputPlan(None, True, f"output_dir '{out}' holds a run stopped before its first checkpoint "
                                      f"({what}): starting it again")
    check_same_recipe(saved_recipe(newest), cfg, newest, what)
    return OutputPlan(newest, False, None)


def open_output_dir(out: Path, plan: OutputPlan, accelerator) -> None:
    """Once everything is loaded and checked: move an earlier run aside, mark the folder as ours,
    then delete the earlier run."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        old = move_aside(out) if plan.replace else None  # output_dir=.: the current folder stays, emptied
        out.mkdir(parents=True, exist_ok=True)
        write_marker(out, "train")
        if old is not None:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


class StopRequest:
    """SIGINT during the training loop sets `requested` instead of raising wherever Python happens
    to be (a KeyboardInterrupt raised inside a finaliser is swallowed, and one raised mid-step
    leaves other processes waiting in a collective). The loop stops after the step, on every
    process together. A second SIGINT raises at once, as Python's default handler does. An ignored
    SIGINT (a `cmd &` job of a non-interactive shell) stays ignored."""

    def __init__(self):
        self.requested = False
        ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        self._previous = None if ignored else signal.signal(signal.SIGINT, self._request)

    def _request(self, signum, frame):
        self.requested = True
        self.restore()

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def interrupted_line(cfg: RunConfig) -> str:
    """After Ctrl-C: the last step done (metrics.jsonl) and the step a rerun resumes from."""
    out = Path(cfg.output_dir)
    try:
        at = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    except (OSError, IndexError, ValueError, KeyError):
        at = 0
    newest = newest_checkpoint(out) if out.is_dir() else None
    rerun = "rerun it without overwrite=true" if cfg.overwrite else "rerun the same command"
    if newest is None:
        return f"interrupted at step {at}; {rerun} to start again from step 0 (no checkpoint yet)"
    return f"interrupted at step {at}; {rerun} to resume from step {int(newest.name[5:])}"
