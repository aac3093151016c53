"""dflash-export's inputs beyond the checkpoint: --card-notes is bounded (issue 42)."""

import pytest

from conftest import error_line, run_main
from dflash_train.cli.export import NOTES_MAX, main

NO_CHECKPOINT = ["--format", "dflash", "--checkpoint", "no-checkpoint", "--verifier", "no-verifier"]


@pytest.mark.parametrize("notes", ["/dev/zero", "big.md"])
def test_card_notes_past_the_bound_are_one_line_before_anything_loads(notes, tmp_path):
    """`--card-notes /dev/zero` read until the machine killed the process. Now at most NOTES_MAX + 1
    bytes are read: more is one line, before the checkpoint (which does not exist here) is looked at."""
    if notes == "big.md":
        notes = tmp_path / "big.md"
        notes.write_text("x" * (NOTES_MAX + 1))
    code, _, stderr = run_main(main, [*NO_CHECKPOINT, "--card-notes", notes, "--output", tmp_path / "o"])
    assert code == 2 and error_line(stderr) == (f"error: --card-notes '{notes}' is larger "
                                                "than 64 KiB: a model card's notes are a few "
                                                "paragraphs; shorten the file")
    assert not (tmp_path / "o").exists()


def test_card_notes_at_the_bound_reach_the_card(fresh_drafter_dir, tmp_path):
    notes = tmp_path / "notes.md"
    text = "Trained on\r\nsmall data.\n"
    notes.write_bytes((text + "y" * (NOTES_MAX - len(text))).encode())
    code, _, stderr = run_main(main, ["--format", "dflash", "--checkpoint", fresh_drafter_dir, "--card-notes",
                                      notes, "--output", tmp_path / "o"])
    assert code == 0, stderr[-3000:]
    card = (tmp_path / "o" / "README.md").read_text()
    assert "Trained on\nsmall data.\n" + "y" * 100 in card
