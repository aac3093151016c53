"""checkpoint/formats.py: each config.json format is told apart and read back to the drafter config it was
written from (with its verifier pin and mask token); a config that does not fit is one line naming it."""

import dataclasses
import json

import pytest

from dflash_train.checkpoint.formats import (NATIVE, OURS, SPECULATORS, check_draft_vocab, detect_format,
                                             drafter_config_from, native_config, read_config,
                                             speculators_config)
from dflash_train.core.errors import UserError
from dflash_train.model.drafter import DrafterConfig

PIN = {"name_or_path": "acme/tiny", "kind": "revision", "revision": "v1"}


def written(cfg: DrafterConfig, fmt: str, folder) -> dict:
    """config.json as an export writes it in `fmt` (speculators: through speculators' own save)."""
    folder.mkdir()
    if fmt == SPECULATORS:
        speculators_config(cfg, PIN["name_or_path"], ["Qwen3ForCausalLM"], PIN, "<|MASK|>").save_pretrained(
            str(folder))
    else:
        (folder / "config.json").write_text(json.dumps(native_config(cfg, PIN, "<|MASK|>")))
    return read_config(folder)


@pytest.fixture(scope="module")
def ours(fresh_drafter_dir) -> dict:
    return json.loads((fresh_drafter_dir / "config.json").read_text())


@pytest.mark.parametrize("fmt", [SPECULATORS, NATIVE])
@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_each_export_format_reads_back_to_the_config_it_was_written_from(fmt, attention, ours, tmp_path):
    cfg = dataclasses.replace(DrafterConfig(**ours["drafter"]), block_attention=attention)
    config = written(cfg, fmt, tmp_path / "d")
    assert detect_format(config) == fmt
    back, provenance = drafter_config_from(config)
    assert back == cfg
    assert provenance["format"] == fmt and provenance["mask_token"] == "<|MASK|>"
    assert provenance["target"]["name_or_path"] == "acme/tiny" and provenance["target"]["revision"] == "v1"


def test_our_own_format_reads_back_its_target_and_mask_token(ours, fresh_drafter_dir):
    assert detect_format(ours) == OURS
    cfg, provenance = drafter_config_from(read_config(fresh_drafter_dir))
    assert dataclasses.asdict(cfg) == ours["drafter"]
    assert provenance == {"format": OURS, "target": ours["target"], "mask_token": ours["mask_token"]}


def refusal(folder, text: str) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(text)
    with pytest.raises(UserError) as e:
        read_config(folder)
    return str(e.value)


def test_a_config_that_does_not_fit_is_refused_naming_the_file(ours, tmp_path):
    vocab = ours["drafter"]["vocab_size"]
    bad = {**ours, "drafter": {**ours["drafter"], "mask_token_id": vocab}}
    line = refusal(tmp_path / "a", json.dumps(bad))
    assert str(tmp_path / "a" / "config.json") in line and f"mask_token_id {vocab} is not a row" in line
    other = json.dumps({"model_type": "qwen3"})
    assert "not a DFlash drafter in any known format" in refusal(tmp_path / "b", other)
    assert "is not a JSON object" in refusal(tmp_path / "c", "[1, 2]")
    assert "is not a drafter folder" in refusal(tmp_path / "d", "{not json")
    with pytest.raises(UserError, match="missing or has a malformed field"):
        drafter_config_from({"architectures": ["DFlashDraftModel"], "dflash_config": {}})


@pytest.mark.parametrize("size, variant, message", [
    (1, "dflash", "must be in 2..1023"), (1024, "dflash", "must be in 2..1023"),
    (512, "dflash2", "drafts over the full vocabulary")])
def test_a_draft_vocabulary_is_2_to_v_minus_1_tokens_of_a_variant_that_drafts_in_one(size, variant, message):
    with pytest.raises(ValueError, match=message):
        check_draft_vocab(size, 1024, variant)
    check_draft_vocab(None, 1024, variant)
    check_draft_vocab(2, 1024, "dflash")
    check_draft_vocab(1023, 1024, "dspark")
