"""core/schema.py: reading a JSON file is one line naming the file, worded by the caller or ours."""

import pytest

from dflash_train.core.errors import UserError
from dflash_train.core.schema import Strict, load_json, read_json


class Marker(Strict):
    step: int


def test_read_json_names_the_file_for_a_missing_a_damaged_and_a_wrong_file(tmp_path):
    with pytest.raises(UserError, match=r"^cannot read '.*missing.json' \(No such file or directory\)$"):
        read_json(tmp_path / "missing.json", Marker)
    (tmp_path / "cut.json").write_text('{"step": ')
    with pytest.raises(UserError, match=r"^'.*cut.json' is not valid JSON \(.*\): it is damaged or was not "):
        read_json(tmp_path / "cut.json", Marker)
    (tmp_path / "other.json").write_text('{"step": 1, "extra": 2}')
    with pytest.raises(UserError, match=r"^'.*other.json': unknown field 'extra'$"):
        read_json(tmp_path / "other.json", Marker)
    (tmp_path / "ok.json").write_text('{"step": 3}')
    assert read_json(tmp_path / "ok.json", Marker).step == 3


def test_load_json_words_an_unreadable_file_as_its_caller_says(tmp_path):
    """The eval report and the costs JSON name what the file should have been, and the error type."""
    (tmp_path / "bad.json").write_bytes(b"\xff{")
    with pytest.raises(UserError, match=r"^eval report 'x' is not readable \(UnicodeDecodeError\)$"):
        load_json(tmp_path / "bad.json", "eval report 'x' is not readable")
    with pytest.raises(UserError, match=r"^costs \(FileNotFoundError\)$"):
        load_json(tmp_path / "missing.json", "costs")
    (tmp_path / "list.json").write_text("[1, 2]")
    assert load_json(tmp_path / "list.json", "costs") == [1, 2]
