"""dflash-export: Speculators and native DFlash checkpoints, checked with speculators' own loader
and converter; model cards; verifier pins; import round trips; refusals."""

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from conftest import ROOT, TINY_TARGET, broken_target, error_line, run_main
from dflash_train.checkpoint.folders import drafter_fingerprint, load_drafter
from dflash_train.cli.export import main
from dflash_train.model.drafter import ContextCache
from dflash_train.model.target import target_forward
from helpers.dflash import speculators_block_logits
from helpers.reports import fake_report


@pytest.fixture(scope="module")
def fingerprint(trained_drafter_dir):
    return drafter_fingerprint(load_drafter(trained_drafter_dir)[0])


@pytest.fixture(scope="module")
def exports(trained_drafter_dir, fingerprint, tmp_path_factory):
    base = tmp_path_factory.mktemp("export")
    report = base / "report.json"
    report.write_text(json.dumps(fake_report(fingerprint)))
    for fmt in ["speculators", "dflash"]:
        main(["--format", fmt, "--checkpoint", str(trained_drafter_dir), "--output", str(base / fmt),
              "--eval-report", str(report)])
    return base


@torch.no_grad()
def test_speculators_loader_gives_the_same_draft_logits(exports, trained_drafter_dir, tiny_target):
    from speculators import SpeculatorModel

    spec = SpeculatorModel.from_pretrained(str(exports / "speculators"), verifier=str(TINY_TARGET)).eval()
    # flex attention is for training on GPU
    spec.config.transformer_layer_config._attn_implementation = "sdpa"
    ours, _ = load_drafter(trained_drafter_dir)
    ours.eval()
    assert spec.config.aux_hidden_state_layer_ids == [k + 1 for k in ours.config.target_layer_ids]
    assert spec.config.speculators_config.proposal_methods[0].speculative_tokens == ours.config.block_size - 1
    torch.testing.assert_close(spec.lm_head.weight, tiny_target.lm_head.weight)

    ids = torch.randint(0, 1000, (1, 19))
    a, B = 11, ours.config.block_size
    spec_logits, block = speculators_block_logits(spec, tiny_target, ids, a, B)

    taps, _ = target_forward(tiny_target, ids[:, :a], torch.ones_like(ids[:, :a]),
                             ours.config.target_layer_ids)
    cache = ContextCache(ours.config.num_hidden_layers)
    ours.extend_context(cache, taps, torch.arange(a)[None])
    our_logits = tiny_target.lm_head(ours.forward_cached(tiny_target.embed(block),
                                                         torch.arange(a, a + B)[None], cache))
    torch.testing.assert_close(spec_logits, our_logits, rtol=1e-5, atol=1e-5)


def test_native_export_converts_to_the_speculators_export(exports, tmp_path):
    from speculators.convert.entrypoints import convert_model

    convert_model(model=str(exports / "dflash"), verifier=str(TINY_TARGET), algorithm="dflash",
                  output_path=str(tmp_path / "conv"))
    converted, exported = load_file(tmp_path / "conv" / "model.safetensors"), load_file(
        exports / "speculators" / "model.safetensors")
    assert set(exported) <= set(converted)
    for k, v in exported.items():
        assert torch.equal(converted[k], v), k
    c1 = json.loads((tmp_path / "conv" / "config.json").read_text())
    c2 = json.loads((exports / "speculators" / "config.json").read_text())
    for key in ["aux_hidden_state_layer_ids", "block_size", "mask_token_id", "draft_vocab_size"]:
        assert c1[key] == c2[key], key
    assert c1["speculators_config"]["proposal_methods"] == c2["speculators_config"]["proposal_methods"]


def test_exported_weights_hold_no_verifier_tensors(exports):
    for fmt in ["speculators", "dflash"]:
        names = set(load_file(exports / fmt / "model.safetensors"))
        assert not {n for n in names if "embed" in n or "lm_head" in n or "verifier" in n}


@pytest.mark.parametrize("fmt", ["speculators", "dflash"])
def test_round_trip_is_exact(exports, trained_drafter_dir, fmt):
    original, _ = load_drafter(trained_drafter_dir)
    imported, meta = load_drafter(exports / fmt)
    assert meta["format"] == fmt and meta["mask_token"] == "<|MASK|>"
    assert imported.config == original.config
    for k, v in original.state_dict().items():
        assert torch.equal(imported.state_dict()[k], v), k


def test_config_carries_the_pin(exports):
    digest = hashlib.sha256()
    digest.update(b"model.safetensors")
    digest.update((TINY_TARGET / "model.safetensors").read_bytes())
    spec = json.loads((exports / "speculators" / "config.json").read_text())
    native = json.loads((exports / "dflash" / "config.json").read_text())
    for cfg in (spec, native):
        assert cfg["verifier_pin"]["kind"] == "content_sha256"
        assert cfg["verifier_pin"]["sha256"] == digest.hexdigest()
    assert (native["architectures"] == ["DFlashDraftModel"]
            and native["dflash_config"]["target_layer_ids"] == [1, 5])
    assert (spec["speculators_model_type"] == "dflash"
            and spec["speculators_config"]["verifier"]["name_or_path"])


def test_model_card(exports, fingerprint):
    card = ModelCard.load(exports / "speculators" / "README.md")
    assert set(card.data.tags) >= {"speculators", "speculative-decoding", "dflash", "ddtree"}
    assert card.data.library_name == "speculators" and card.data.license == "other"
    text = card.text
    report = fake_report(fingerprint)
    for r in report["results"]:
        assert f"| {r['method']} | {r['budget']} | {r['tau']} | yes |" in text  # exact values from the report
    assert "- Some CPU (cpu)" in text and "Not validated on a GPU." in text
    assert "budget **64**" in text and "vllm serve" in text
    assert "| ddtree | 64 | 5.1234 | yes | 1.90x (1.80-2.05) |" in text  # the speedup with its interval
    assert "200 steps" not in text and "100 steps" in text  # from the run's own recipe
    assert "SHA-256" in text


def test_card_lists_gpu_hardware_exactly(trained_drafter_dir, fingerprint, tmp_path):
    reports = []
    for i, (kind, name) in enumerate([("cuda", "NVIDIA H200"), ("cpu", "Some CPU"), ("cpu", "Some CPU"),
                                      ("cpu", "Some CPU")]):
        reports.append(tmp_path / f"r{i}.json")
        rep = fake_report(fingerprint, kind, name)
        if i >= 2:  # measured through the streaming CPU linear: the card says so, in the dtype that ran
            rep["hardware"]["cpu_linear"] = "stream"
        if i == 3:  # dflash-eval --target-dtype bf16-weights
            rep["hardware"]["dtype"] = "bf16-weights"
        reports[-1].write_text(json.dumps(rep))
    main(["--format", "dflash", "--checkpoint", str(trained_drafter_dir), "--output", str(tmp_path / "o"),
          *[a for r in reports for a in ("--eval-report", str(r))]])
    text = (tmp_path / "o" / "README.md").read_text()
    section = text.split("## Validated on")[1].split("##")[0]
    assert section.strip().splitlines() == ["- NVIDIA H200 (cuda), torch 2.x, CUDA 12.8, driver 570.1",
                                            "- Some CPU (cpu), torch 2.x",
                                            "- Some CPU (cpu), torch 2.x, fp32 through "
                                            "dflash-eval's streaming CPU linear",
                                            "- Some CPU (cpu), torch 2.x, bf16 weights, fp32 "
                                            "activations through dflash-eval's streaming CPU linear"]
    # each acceptance table names the dtype its report ran in (none recorded: none named)
    assert "; Some CPU, bf16 weights, fp32 activations):" in text and "; Some CPU):" in text
    assert "--speculative-config" in text and '"num_speculative_tokens": 7' in text


def test_pins_from_hub_snapshot_and_revision(trained_drafter_dir, tmp_path):
    sha = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / sha
    shutil.copytree(TINY_TARGET, snap)
    main(["--format", "speculators", "--checkpoint", str(trained_drafter_dir), "--output",
          str(tmp_path / "a"), "--verifier", str(snap)])
    pin = json.loads((tmp_path / "a" / "config.json").read_text())["verifier_pin"]
    assert pin == {"name_or_path": "acme/tiny", "kind": "hub_snapshot", "revision": sha}
    card = (tmp_path / "a" / "README.md").read_text()
    assert sha in card and "base_model: acme/tiny" in card
    main(["--format", "dflash", "--checkpoint", str(trained_drafter_dir), "--output", str(tmp_path / "b"),
          "--verifier-revision", "v1.2"])
    pin = json.loads((tmp_path / "b" / "config.json").read_text())["verifier_pin"]
    assert pin["kind"] == "revision" and pin["revision"] == "v1.2"


def test_eval_and_training_import_exports(exports, tmp_path, small_data):
    from dflash_train.cli.eval import main as eval_main
    from dflash_train.cli.train import main as train_main

    for fmt in ["speculators", "dflash"]:
        eval_main(["--drafter", str(exports / fmt), "--target", str(TINY_TARGET), "--limit", "2", "--budgets",
                   "8", "--max-new-tokens", "16", "--output", str(tmp_path / f"eval_{fmt}")])
    taus = [[r["tau"] for r in json.loads((tmp_path / f"eval_{f}" / "report.json").read_text())["results"]]
            for f in ["speculators", "dflash"]]
    assert taus[0] == taus[1]  # the same drafter, whichever format it travelled in
    # training from an export: with a vanishing learning rate the weights stay the export's
    train_main([f"output_dir={tmp_path / 'ft'}", f"model.init_from={exports / 'speculators'}", "max_steps=2",
                "train.lr=1e-12", f"data.train={small_data / 'train.jsonl'}",
                f"data.val={small_data / 'val.jsonl'}", "train.batch_size=4"])
    start, end = load_drafter(exports / "speculators")[0], load_drafter(tmp_path / "ft" / "final")[0]
    for k, v in start.state_dict().items():
        torch.testing.assert_close(end.state_dict()[k], v, rtol=0, atol=1e-8)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "dflash_train.cli.export", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def no_mask_target(tmp_path_factory):
    """The tiny target with its <|MASK|> token renamed: same shapes, no mask token."""
    d = tmp_path_factory.mktemp("nomask") / "target"
    shutil.copytree(TINY_TARGET, d)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        f = d / name
        f.write_text(f.read_text().replace("<|MASK|>", "<|NOPE|>"))
    return d


def test_bad_input_is_one_line_exit_2_and_writes_nothing(trained_drafter_dir, llama_target_dir,
                                                         no_mask_target, tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep").write_text("x")
    bad_report = tmp_path / "bad.json"
    bad_report.write_text("{not json")
    d = str(trained_drafter_dir)
    (tmp_path / "empty").mkdir()
    cases = [
        (["--format", "speculators", "--checkpoint", str(tmp_path / "empty"), "--output",
          str(tmp_path / "o1")],
         "is not a drafter folder"),
        (["--format", "speculators", "--checkpoint", d, "--verifier", str(llama_target_dir), "--output",
          str(tmp_path / "o2")], "does not match the drafter: hidden size"),
        (["--format", "dflash", "--checkpoint", d, "--verifier", str(no_mask_target), "--output",
          str(tmp_path / "o3")],
         "has no mask token <|MASK|>"),
        (["--format", "onnx", "--checkpoint", d, "--output", str(tmp_path / "o4")],
         "unknown --format 'onnx'"),
        (["--format", "dflash", "--checkpoint", d, "--eval-report", str(bad_report), "--output",
          str(tmp_path / "o5")],
         "is not a readable dflash-eval report"),
        (["--format", "dflash", "--checkpoint", d, "--output", str(busy)], "is not empty"),
        (["--format", "dflash", "--checkpoint", d, "--output", str(tmp_path / "o6"), "--dry-run"],
         "go with --push-to-hub"),
    ]
    for i, (args, message) in enumerate(cases):
        # the first case through the real command line, the rest in-process (the same code under cli_guard)
        if i == 0:
            r = run_cli(*args)
            code, stderr = r.returncode, r.stderr
        else:
            code, _, stderr = run_main(main, args)
        assert code == 2, (args, stderr[-1500:])
        errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], (message, stderr[-1500:])
        assert "Traceback" not in stderr
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 7))
    assert not list(tmp_path.glob(".o*.tmp-*"))
    assert [p.name for p in busy.iterdir()] == ["keep"]


def exits_2(argv) -> str:
    code, _, stderr = run_main(main, argv)
    assert code == 2, stderr[-2000:]
    return error_line(stderr)


def test_cheap_checks_come_before_the_verifier_is_read(fresh_drafter_dir, tmp_path):
    """A bad Hub id or report is found before the (possibly huge) verifier is touched: here the
    verifier is broken, and the error is still about the cheap input."""
    broken = broken_target(tmp_path / "broken", "garbage")
    (broken / "config.json").write_text("{not json")
    base = ["--format", "dflash", "--checkpoint", str(fresh_drafter_dir), "--verifier", str(broken)]
    for repo in ["me/my model", "a/b/c"]:
        line = exits_2([*base, "--output", str(tmp_path / "o"), "--push-to-hub", repo, "--dry-run"])
        assert f"--push-to-hub '{repo}' is not a Hub repo id" in line
    report = tmp_path / "r.json"
    report.write_text(json.dumps(fake_report("1" * 64)))
    assert "measured another drafter" in exits_2([*base, "--output", str(tmp_path / "o"), "--eval-report",
                                                  str(report)])
    assert "cannot load verifier" in exits_2([*base, "--output", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def causal_drafter_dir(trained_drafter_dir, tiny_target, tmp_path_factory):
    """The trained drafter's weights with causal in-block attention (JetSpec-style)."""
    from dflash_train.checkpoint.folders import save_drafter
    from dflash_train.model.drafter import DFlashDrafter

    drafter, _ = load_drafter(trained_drafter_dir)
    causal = DFlashDrafter(dataclasses.replace(drafter.config, block_attention="causal"))
    causal.load_state_dict(drafter.state_dict())
    out = tmp_path_factory.mktemp("causal") / "final"
    save_drafter(out, causal, tiny_target)
    return out


@pytest.mark.parametrize("fmt", ["speculators", "dflash"])
@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_vllm_derives_the_trained_model(fmt, attention, trained_drafter_dir, causal_drafter_dir, tmp_path):
    """vLLM 0.33's own code, run on the export: every draft layer gets the in-block attention the
    drafter was trained with, and the taps, mask token, block size and method are ours."""
    from helpers.vllm_reference import speculators_conversion, vllm_draft_config, vllm_layer_causal

    source = causal_drafter_dir if attention == "causal" else trained_drafter_dir
    main(["--format", fmt, "--checkpoint", str(source), "--output", str(tmp_path / "o")])
    ours, _ = load_drafter(source)
    config = vllm_draft_config(tmp_path / "o")
    layers = ours.config.num_hidden_layers
    assert config.num_hidden_layers == layers
    assert [vllm_layer_causal(config, i) for i in range(layers)] == [attention == "causal"] * layers
    assert config.dflash_config["target_layer_ids"] == ours.config.target_layer_ids
    assert config.dflash_config["mask_token_id"] == ours.config.mask_token_id
    assert config.architectures == ["DFlashDraftModel"]
    if fmt == "speculators":
        _, spec = speculators_conversion(tmp_path / "o")
        assert spec == {"method": "dflash", "num_speculative_tokens": ours.config.block_size - 1}
        assert config.dflash_config["sample_from_anchor"] is False
    else:
        assert config.block_size == ours.config.block_size
    imported, _ = load_drafter(tmp_path / "o")  # and our own import reads the same attention back
    assert imported.config.block_attention == attention


def test_native_config_without_causality_keys_reads_as_bidirectional(exports, tmp_path):
    """z-lab's published configs carry neither is_causal nor dflash_config.causal: full layers are
    non-causal."""
    shutil.copytree(exports / "dflash", tmp_path / "z")
    cfg = json.loads((tmp_path / "z" / "config.json").read_text())
    del cfg["is_causal"], cfg["dflash_config"]["causal"]
    (tmp_path / "z" / "config.json").write_text(json.dumps(cfg))
    assert load_drafter(tmp_path / "z")[0].config.block_attention == "bidirectional"


def test_re_exporting_an_export_keeps_its_training_recipe(exports, tmp_path):
    """An export re-exported (e.g. to add the eval reports of the export itself) carries the recipe on:
    the export holds it as training_recipe.yaml, not recipe.yaml."""
    main(["--format", "speculators", "--checkpoint", str(exports / "speculators"), "--output",
          str(tmp_path / "re")])
    assert (tmp_path / "re" / "training_recipe.yaml").read_text() == \
        (exports / "speculators" / "training_recipe.yaml").read_text()
    assert "Full recipe (training_recipe.yaml)" in (tmp_path / "re" / "README.md").read_text()


def test_an_export_inside_a_run_folder_is_not_carded_as_one_of_its_checkpoints(tmp_path):
    from dflash_train.export.card import run_choice

    (tmp_path / "final").mkdir()
    (tmp_path / "export0").mkdir()
    chosen = {"budget": 64, "metric": "ddtree_tau", "step": 4, "folder": "final", "value": 2.0,
              "validated": {}}
    (tmp_path / "summary.json").write_text(json.dumps({"chosen": chosen}))
    assert run_choice(tmp_path / "final")["this"] is True
    assert run_choice(tmp_path / "export0") is None
