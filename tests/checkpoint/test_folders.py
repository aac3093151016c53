"""Drafter folders: damaged weight files are one clear line wherever a drafter is read (eval,
export, model.init_from), and a checkpoint only resumes into a drafter of its own shape."""

import shutil

import pytest

from conftest import error_line
from dflash_train.checkpoint.folders import check_resumable, load_drafter, size_mismatch
from dflash_train.cli.eval import main as eval_main
from dflash_train.cli.export import main as export_main
from dflash_train.core.errors import UserError
from dflash_train.model.drafter import DFlashDrafter


@pytest.fixture(params=["truncated", "garbage"])
def damaged_drafter(request, fresh_drafter_dir, tmp_path):
    d = tmp_path / "damaged"
    shutil.copytree(fresh_drafter_dir, d)
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if request.param == "truncated"
                        else b"not a safetensors file" * 10)
    return d


def test_damaged_weights_are_one_line_naming_the_file(damaged_drafter, small_data, tmp_path, capsys):
    with pytest.raises(UserError, match="is not a readable safetensors file"):
        load_drafter(damaged_drafter)
    from dflash_train.cli.train import main as train_main

    commands = [
        lambda: eval_main(["--drafter", str(damaged_drafter), "--output", str(tmp_path / "e")]),
        lambda: export_main(["--format", "dflash", "--checkpoint", str(damaged_drafter),
                             "--output", str(tmp_path / "x")]),
        lambda: train_main([f"output_dir={tmp_path / 'run'}", f"model.init_from={damaged_drafter}",
                            "max_steps=1", f"data.train={small_data / 'train.jsonl'}",
                            f"data.val={small_data / 'val.jsonl'}"]),
    ]
    for run in commands:
        with pytest.raises(SystemExit) as e:
            run()
        assert e.value.code == 2
        line = error_line(capsys.readouterr().err)
        assert f"'{damaged_drafter / 'model.safetensors'}' is not a readable safetensors file" in line, line
    assert not any((tmp_path / name).exists() for name in ["e", "x", "run"])


def test_a_checkpoint_resumes_only_into_its_own_shape(fresh_drafter_dir):
    drafter, _ = load_drafter(fresh_drafter_dir)
    check_resumable(fresh_drafter_dir, drafter)
    cfg = drafter.config
    narrower = DFlashDrafter(type(cfg)(**{**cfg.to_dict(), "hidden_size": 64, "head_dim": 16}))
    with pytest.raises(UserError, match="hidden size 128, the target now gives 64"):
        check_resumable(fresh_drafter_dir, narrower)


def test_the_shape_check_names_the_first_size_that_differs_and_skips_unrecorded_ones():
    """Resuming and exporting share it: a size the drafter does not record (None) is not compared."""
    assert size_mismatch([("hidden size", 64, 64), ("layer count", None, 30)]) is None
    assert size_mismatch([("hidden size", 64, 64), ("vocabulary size", 10, 12),
                          ("layer count", 2, 3)]) == ("vocabulary size", 10, 12)
