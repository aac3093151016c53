"""The prepare pipeline as a library: prepare(PrepareSettings(...)) without the command line writes
what `dflash-prepare` with the same flags writes, and leaves the caller's settings as given."""

import json

from datasets import load_from_disk

from conftest import ROOT, TINY_TARGET, run_main
from dflash_train.cli import prepare as prepare_cli
from dflash_train.data.prepare import PrepareSettings, prepare


def test_prepare_called_as_a_library_writes_what_the_command_line_writes(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join((ROOT / "data" / "tiny"
                             / "train.jsonl").read_text().splitlines(keepends=True)[:8]))
    settings = PrepareSettings(input=str(data), format="messages", target=str(TINY_TARGET),
                               output=str(tmp_path / "lib"), min_supervised_tokens=8, val_size=2)
    prepare(settings)
    assert settings.max_length is None and settings.input == str(data)  # defaults fitted on a copy
    code, _, err = run_main(prepare_cli.main,
                            ["--input", data, "--format", "messages", "--target", TINY_TARGET,
                                               "--output", tmp_path / "cli", "--min-supervised-tokens", "8",
                                               "--val-size", "2"])
    assert code == 0, err[-2000:]
    for split in ("train", "val"):
        lib, cli = (load_from_disk(str(tmp_path / out / split)) for out in ("lib", "cli"))
        assert lib["input_ids"] == cli["input_ids"] and lib["loss_mask"] == cli["loss_mask"]
    info = json.loads((tmp_path / "lib" / "prepare_info.json").read_text())
    assert info == json.loads((tmp_path / "cli" / "prepare_info.json").read_text())
    assert info["max_length"] == 512 and info["splits"]["val"] == 2  # the tiny target's positions
