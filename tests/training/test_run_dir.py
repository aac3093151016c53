"""The output folder of a training run (dflash_train/training/run_dir.py)."""

from pathlib import Path

import pytest

from dflash_train.core.outputs import MARKER


def test_overwrite_of_the_current_folder_keeps_it_and_a_run_around_it_is_refused(tmp_path, monkeypatch):
    """Issue 30: output_dir=. overwrite=true was a traceback once everything had loaded (renaming '.':
    EBUSY), and the current folder named by its path was moved aside and deleted. It stays now,
    emptied and marked; an output_dir holding the current folder is refused before anything loads."""
    from types import SimpleNamespace

    from dflash_train.core.errors import UserError
    from dflash_train.core.outputs import marker_kind, write_marker
    from dflash_train.training.config import load_recipe
    from dflash_train.training.run_dir import open_output_dir, plan_output_dir

    run = tmp_path / "run"
    run.mkdir()
    write_marker(run, "train")
    (run / "summary.json").write_text("{}")  # a finished run of ours
    inode = run.stat().st_ino
    monkeypatch.chdir(run)
    one_process = SimpleNamespace(wait_for_everyone=lambda: None, is_main_process=True)
    for given in [".", str(run)]:
        (run / "summary.json").write_text("{}")
        plan = plan_output_dir(load_recipe(None, [f"output_dir={given}", "overwrite=true"]))
        assert plan.replace
        open_output_dir(Path(given), plan, one_process)
        assert run.stat().st_ino == inode and Path.cwd() == run
        assert [p.name for p in run.iterdir()] == [MARKER]
        assert marker_kind(run) == "train" and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    (run / "summary.json").write_text("{}")
    (run / "notes").mkdir()
    monkeypatch.chdir(run / "notes")
    with pytest.raises(UserError, match=rf"^output_dir '\.\.' holds the current folder '{run / 'notes'}'"):
        plan_output_dir(load_recipe(None, ["output_dir=..", "overwrite=true"]))
    assert sorted(p.name for p in run.iterdir()) == sorted([MARKER, "notes", "summary.json"])
