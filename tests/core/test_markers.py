"""core/markers.py: a folder's kind is read from the marker write_atomically leaves, and anything else
there (no marker, a user's file of that name, a marker without a kind) is "not ours", never an error."""

import pytest

from dflash_train.core.markers import KINDS, MARKER, marker_kind
from dflash_train.core.outputs import write_atomically


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_kind_written_is_the_kind_read(tmp_path, kind):
    write_atomically(tmp_path / "out", lambda d: (d / "a.txt").write_text("a"), kind)
    assert marker_kind(tmp_path / "out") == kind
    assert marker_kind(str(tmp_path / "out")) == kind  # a str path, as the CLIs pass them


@pytest.mark.parametrize("content", [None, "", "not json", "[1, 2]", '"eval"', "{}",
                                     '{"tool": "dflash-train"}'])
def test_a_folder_without_a_readable_kind_is_not_ours(tmp_path, content):
    if content is not None:
        (tmp_path / MARKER).write_text(content)
    assert marker_kind(tmp_path) is None


def test_a_missing_folder_or_a_file_is_not_ours(tmp_path):
    (tmp_path / "f").write_text("x")
    assert marker_kind(tmp_path / "f") is None and marker_kind(tmp_path / "nope") is None
    (tmp_path / MARKER).mkdir()  # a folder where the marker file would be
    assert marker_kind(tmp_path) is None
