"""core/paths.py: where inputs are found (the current folder, then the checkout), a folder that is no
target model named as such, and how a path is written into what travels (display_path)."""

import os

import pytest

from conftest import TINY_TARGET
from dflash_train.core.errors import UserError
from dflash_train.core.outputs import MARKER, write_atomically
from dflash_train.core.paths import ROOT, display_path, model_source, resolve_input


def test_inputs_resolve_from_the_checkout_and_typos_are_not_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_input("data/tiny-target") == str(ROOT / "data" / "tiny-target")  # bundled, from any folder
    assert model_source("data/tiny-target", "target") == str(ROOT / "data" / "tiny-target")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    assert model_source("mine/", "target") == str(tmp_path / "mine")  # the current folder comes first
    assert model_source("Qwen/Qwen3-8B", "target") == "Qwen/Qwen3-8B"  # a Hub id stays an id
    for typo in ["data/tiny-targt", "/nope", "./runs/x/final", "runs/x/final", "mine/sub"]:
        with pytest.raises(UserError, match=f"target not found: '{typo}'"):
            model_source(typo, "target")
    (tmp_path / "f.bin").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        model_source("f.bin", "target")
    assert os.getcwd() == str(tmp_path)


def test_a_folder_that_is_no_target_model_is_named_as_such(tmp_path):
    """Issue 30: a data folder or one of our drafters given as the target ended in the tokenizer
    loader's line, cut mid-sentence ("Couldn't instantiate the backend tokenizer from one of: ")."""
    data = ROOT / "data" / "tiny"
    for what in ("target", "model.target", "verifier"):
        with pytest.raises(UserError, match=rf"{what} '{data}' is not a model folder: it has no "
                                            rf"config.json and no"):
            model_source(str(data), what)
    drafter = tmp_path / "out"
    write_atomically(drafter, lambda d: (d / "old.txt").write_text("old"), "drafter")
    (drafter / "config.json").write_text("{}")
    with pytest.raises(UserError, match="holds a drafter written by dflash-train, not a target model"):
        model_source(str(drafter), "target")
    assert model_source(str(drafter), "model.init_from") == str(drafter)  # a drafter is what init_from takes
    converted = tmp_path / "real"
    converted.mkdir()
    (converted / "config.json").write_text("{}")
    (converted / MARKER).write_text('{"tool": "dflash-train", "kind": "real-target"}')
    assert model_source(str(converted), "target") == str(converted)  # make real-target's model is a target
    assert model_source(str(TINY_TARGET), "target") == str(TINY_TARGET)


def test_a_path_travels_relative_to_the_checkout_or_as_local_name(tmp_path):
    """What a card or exported recipe records: a checkout path any clone resolves alike, never this
    machine's absolute path outside it (unless asked to keep it)."""
    assert display_path(ROOT / "data" / "tiny-target") == "data/tiny-target"
    assert display_path(str(ROOT / "recipes" / ".." / "data")) == "data"  # resolved first
    assert display_path(ROOT) == "."
    outside = tmp_path / "mine" / "final"
    assert display_path(outside) == "<local>/final"
    assert display_path(outside, keep_outside=True) == str(outside)
    for as_given in ["runs/x/final", "Qwen/Qwen3-8B", "", "name"]:
        assert display_path(as_given) == as_given
    assert resolve_input(display_path(ROOT / "data" / "tiny-target")) == str(ROOT / "data" / "tiny-target")
