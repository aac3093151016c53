"""Bad inputs to dflash-eval and dflash-export (issue 21): every file they read goes through a
schema first, so each case below is exit 2, one `error:` line naming the file and the field, no
traceback, before the target or verifier is touched (both are missing here: reaching them would
say so), and an earlier output given with --overwrite is kept whole. Plus `--budgets 0` end to
end, the card's plural and YAML front matter, and the verifier-pin hash cache."""

import functools
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, TINY_TARGET, error_line, run_main
from dflash_train.checkpoint.folders import drafter_fingerprint, load_drafter
from dflash_train.core.outputs import MARKER
from dflash_train.cli import eval as dflash_eval, export
from dflash_train.evaluation import costs, run as eval_run
from dflash_train.model import target as target_mod
from helpers.reports import fake_report


def drafter_with(src, dst, edit):
    """A copy of the drafter folder `src` whose config.json is edit(config) -> new config."""
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps(edit(json.loads((src / "config.json").read_text()))))
    return dst


def speculators_dflash2(config: dict) -> dict:
    """Our config as a Speculators DFlash2 config.json (the keys formats.drafter_config_from reads),
    with a selector that re-ranks more candidates than the vocabulary has."""
    d = config["drafter"]
    layer = {k: d[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                               "max_position_embeddings", "rope_parameters", "attention_bias")}
    return {"speculators_model_type": "dflash2", "architectures": ["DFlash2DraftModel"],
            "transformer_layer_config": layer, "block_size": d["block_size"],
            "mask_token_id": d["mask_token_id"],
            "aux_hidden_state_layer_ids": [k + 1 for k in d["target_layer_ids"]], "sample_from_anchor": False,
            "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5000,
            "dflash_train": {"num_target_layers": d["num_target_layers"]}}


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def inputs(fresh_drafter_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    bogus = lambda c: {**c, "drafter": {**c["drafter"], "variant": "bogus"}}  # noqa: E731
    (d / "folder.jsonl").mkdir()
    good = fake_report(drafter_fingerprint(load_drafter(fresh_drafter_dir)[0]))
    no_suite = json.loads(json.dumps(good))
    del no_suite["results"][0]["suite"]
    costs_file = lambda name, ms, **more: (d / name).write_text(  # noqa: E731
        json.dumps({"verify_ms_by_width": {"1": ms, "64": 2.0}, "draft_ms": 1.0, **more})) and d / name
    return {
        "drafter": fresh_drafter_dir,
        "bogus_variant": drafter_with(fresh_drafter_dir, d / "bogus", bogus),
        "dflash2_top_k": drafter_with(fresh_drafter_dir, d / "dflash2", speculators_dflash2),
        "messages_string": write_jsonl(d / "string.jsonl", [{"messages": "hello"}]),
        "turn_without_role": write_jsonl(d / "norole.jsonl", [{"messages": [{"content": "hi"}]}]),
        "folder": d / "folder.jsonl",
        "empty": write_jsonl(d / "empty.jsonl", []),
        "no_messages": write_jsonl(d / "rows.jsonl", [{"question": "2+2?"}]),
        "negative_costs": costs_file("negative.json", -5.0),
        "zero_costs": costs_file("zero.json", 0.0),
        "nan_costs": costs_file("nan.json", math.nan),
        "inf_costs": costs_file("inf.json", math.inf),
        "near_zero_costs": costs_file("near_zero.json", 1e-4),  # 0.1 microsecond: seconds taken for ms?
        "falling_costs": costs_file("falling.json", 10.0),  # width 64 at 2 ms after width 1 at 10 ms
        "falling_batch_costs": costs_file("falling_batch.json", 1.5, draft_ms_by_batch={"1": 1.0, "16": 0.5}),
        "context_without_base": costs_file("no_context.json", 1.5, verify_ms_by_context={"2048": {"1": 3.0}}),
        "falling_context_costs": costs_file("falling_context.json", 1.5, context=512,
                                            verify_ms_by_context={"2048": {"1": 0.9, "64": 2.5}}),
        "nan_context_costs": costs_file("nan_context.json", 1.5, context=512,
                                        verify_ms_by_context={"2048": {"1": 2.0, "64": math.nan}}),
        "no_advice": (d / "no_advice.json").write_text(json.dumps({k: v for k, v in good.items()
                                                                   if k != "advice"}))
        and d / "no_advice.json",
        "no_suite": (d / "no_suite.json").write_text(json.dumps(no_suite)) and d / "no_suite.json",
    }


def costs_argv(inputs, name):
    return ["--drafter", inputs["drafter"], "--verify-times", inputs[name]]


NOT_BELOW_1US = "field 'verify_ms_by_width.1': Input should be greater than or equal to 0.001"
# case -> (argv without --output, given the inputs; the error line's fragment)
EVAL_CASES = {
    "unknown_variant": (lambda i: ["--drafter", i["bogus_variant"]], "field 'drafter.variant'"),
    "dflash2_top_k_above_vocab": (lambda i: ["--drafter", i["dflash2_top_k"]],
                                  "selector_top_k 5000 exceeds the vocabulary (1024)"),
    "messages_is_a_string": (lambda i: ["--drafter", i["drafter"], "--suite", i["messages_string"]],
                             "row 1: field 'messages'"),
    "turn_without_role": (lambda i: ["--drafter", i["drafter"], "--suite", i["turn_without_role"]],
                          "row 1: field 'messages.0.role' is missing"),
    "suite_is_a_folder": (lambda i: ["--drafter", i["drafter"], "--suite", i["folder"]], "is a folder"),
    "empty_suite": (lambda i: ["--drafter", i["drafter"], "--suite", i["empty"]], "is empty"),
    "tinychat_file_without_messages": (lambda i: ["--drafter", i["drafter"], "--suite",
                                                  f"tinychat={i['no_messages']}"],
                                       "row 1: field 'messages' is missing"),
    "negative_verify_times": (lambda i: costs_argv(i, "negative_costs"), NOT_BELOW_1US),
    "zero_verify_times": (lambda i: costs_argv(i, "zero_costs"), NOT_BELOW_1US),
    "near_zero_verify_times": (lambda i: costs_argv(i, "near_zero_costs"), NOT_BELOW_1US),
    "nan_verify_times": (lambda i: costs_argv(i, "nan_costs"),
                         "field 'verify_ms_by_width.1': Input should be a finite number"),
    "inf_verify_times": (lambda i: costs_argv(i, "inf_costs"),
                         "field 'verify_ms_by_width.1': Input should be a finite number"),
    "verify_falling_with_width": (lambda i: costs_argv(i, "falling_costs"),
                                  "verify_ms_by_width: width 64 is measured at 2 ms, more "
                                  "than 33% below width 1 (10 ms): more work cannot cost that much less"),
    "draft_falling_with_batch": (lambda i: costs_argv(i, "falling_batch_costs"),
                                 "draft_ms_by_batch: batch 16 is measured at 0.5 ms, more than "
                                 "33% below batch 1"),
    "context_axis_without_context": (lambda i: costs_argv(i, "context_without_base"),
                                     "verify_ms_by_context needs 'context'"),
    "verify_falling_with_context": (lambda i: costs_argv(i, "falling_context_costs"),
                                    "width 1: context 2048 is measured at 0.9 ms, more than 33% "
                                    "below context 512"),
    "nan_context_verify_times": (lambda i: costs_argv(i, "nan_context_costs"),
                                 "field 'verify_ms_by_context.2048.64': Input should be a finite number"),
    "huge_budget": (lambda i: ["--drafter", i["drafter"], "--budgets", "4,100000"],
                    "--budgets 100000 is above the limit of 4096"),
    "huge_concurrency": (lambda i: ["--drafter", i["drafter"], "--concurrency", "1,100000"],
                         "--concurrency 100000 is above the limit of 256"),
    "huge_repeats": (lambda i: ["--drafter", i["drafter"], "--repeats", "1000000000"],
                     "--repeats must be in 1..100"),
    "huge_seed": (lambda i: ["--drafter", i["drafter"], "--seed", "4294967296"],
                  "--seed must be from 0 to 2**32 - 1, got 4294967296"),
}

EXPORT_CASES = {
    "unknown_variant": (lambda i: ["--checkpoint", i["bogus_variant"]], "field 'drafter.variant'"),
    "dflash2_top_k_above_vocab": (lambda i: ["--checkpoint", i["dflash2_top_k"]],
                                  "selector_top_k 5000 exceeds the vocabulary (1024)"),
    "report_without_advice": (lambda i: ["--checkpoint", i["drafter"], "--eval-report", i["no_advice"]],
                              "field 'advice' is missing"),
    "report_result_without_suite": (lambda i: ["--checkpoint", i["drafter"], "--eval-report", i["no_suite"]],
                                    "field 'results.0.suite' is missing"),
    "unknown_license": (lambda i: ["--checkpoint", i["drafter"], "--license", "my-own"],
                        "is not a Hub license id"),
    "license_breaking_yaml": (lambda i: ["--checkpoint", i["drafter"], "--license", "mit\nbase_model: [x"],
                              "is not a Hub license id"),
}


def kept_output(tmp_path, kind: str):
    """An earlier output of this kind (replaceable with --overwrite), to show a failed run keeps it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"tool": "dflash-train", "kind": kind, "version": "0"}))
    (out / "report.json").write_text("earlier")
    return out


def check_refused(code, stderr, fragment, out, tmp_path):
    line = error_line(stderr)
    assert code == 2 and fragment in line, (fragment, stderr[-2000:])
    assert (out / "report.json").read_text() == "earlier" and sorted(p.name for p in out.iterdir()) == [
        MARKER, "report.json"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no half-written sibling


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_eval_refuses_bad_input_before_the_target(case, inputs, tmp_path):
    argv, fragment = EVAL_CASES[case]
    out = kept_output(tmp_path, "eval")
    args = [*argv(inputs), "--target", tmp_path / "no-target", "--output", out, "--overwrite", "--limit", "1",
            "--max-new-tokens", "4"]
    if case == "unknown_variant":  # one through the real command line (interpreter, entry point)
        r = subprocess.run([sys.executable, "-m", "dflash_train.cli.eval", *map(str, args)],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        code, stderr = r.returncode, r.stderr
    else:
        code, _, stderr = run_main(dflash_eval.main, args)
    check_refused(code, stderr, fragment, out, tmp_path)


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_export_refuses_bad_input_before_the_verifier(case, inputs, tmp_path):
    argv, fragment = EXPORT_CASES[case]
    out = kept_output(tmp_path, "export")
    args = ["--format", "speculators", *argv(inputs), "--verifier", tmp_path / "no-verifier", "--output", out,
            "--overwrite"]
    if case == "unknown_variant":
        r = subprocess.run([sys.executable, "-m", "dflash_train.cli.export", *map(str, args)],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        code, stderr = r.returncode, r.stderr
    else:
        code, _, stderr = run_main(export.main, args)
    check_refused(code, stderr, fragment, out, tmp_path)


def test_suites_yaml_entries_are_checked(tmp_path, monkeypatch):
    from dflash_train.evaluation import suites

    bad = tmp_path / "suites.yaml"
    bad.write_text("mine:\n  dataset: me/rows\n  split: test\n  feild: prompt\n")
    monkeypatch.setattr(suites, "SUITES_FILE", bad)
    code, _, stderr = run_main(dflash_eval.main, ["--drafter", tmp_path / "none", "--suite", "mine",
                                                  "--output", tmp_path / "o"])
    assert code == 2 and "suite 'mine': unknown field 'feild'" in error_line(stderr)


def test_plain_decoding_only_end_to_end(fresh_drafter_dir, tmp_path, monkeypatch):
    """`--budgets 0` (AR and the chain, no tree): report, plots, and a card from that report whose
    front matter is valid YAML and whose counts read '1 prompt'."""
    # a short cost curve: the plots and the card need one, not its precision
    monkeypatch.setattr(eval_run, "measure_costs", functools.partial(costs.measure_costs, widths=[1, 2, 8],
                                                                     rounds=2))
    out = tmp_path / "eval"
    code, stdout, stderr = run_main(dflash_eval.main,
                                    ["--drafter", fresh_drafter_dir, "--budgets", "0", "--limit", "1",
                                                       "--max-new-tokens", "4", "--concurrency", "1",
                                     "--output", out])
    assert code == 0, stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["budgets"] == [] and {r["method"] for r in report["results"]} == {"ar", "dflash"}
    assert {p.name for p in out.glob("*.png")} == {"tau_vs_budget.png", "accept_hist.png",
                                                   "speedup_vs_budget.png",
                                                    "verify_cost.png"}
    assert "## tinychat (1 prompt)" in (out / "report.md").read_text()
    card_dir = tmp_path / "export"
    code, _, stderr = run_main(export.main, ["--format", "speculators", "--checkpoint", fresh_drafter_dir,
                                             "--eval-report", out / "report.json", "--license", "apache-2.0",
                                             "--output", card_dir])
    assert code == 0, stderr[-2000:]
    card = (card_dir / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["license"] == "apache-2.0" and "speculative-decoding" in front["tags"]
    assert "**tinychat** (1 prompt, temperature" in card


def test_local_verifier_is_hashed_once_per_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HASH_CACHE", str(tmp_path / "hashes.json"))
    verifier = tmp_path / "verifier"
    shutil.copytree(TINY_TARGET, verifier)
    calls = []
    real = target_mod.hash_files
    monkeypatch.setattr(target_mod, "hash_files", lambda files: calls.append(files) or real(files))
    first = target_mod.resolve_pin(str(verifier), None)
    second = target_mod.resolve_pin(str(verifier), None)
    assert len(calls) == 1 and first == second and first["kind"] == "content_sha256"
    weights = verifier / "model.safetensors"
    st = weights.stat()
    # touched: hashed again, same digest
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert target_mod.resolve_pin(str(verifier), None) == first and len(calls) == 2
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")  # rewritten: a new digest
    assert target_mod.resolve_pin(str(verifier), None)["sha256"] != first["sha256"] and len(calls) == 3


def test_every_drafter_format_is_checked(fresh_drafter_dir, tmp_path):
    """Native and Speculators (dflash, dspark) config.json go through their schemas too."""
    import dataclasses

    from dflash_train.core.errors import UserError
    from dflash_train.checkpoint.formats import native_config, read_config, speculators_config

    cfg = load_drafter(fresh_drafter_dir)[0].config
    dspark = dataclasses.replace(cfg, variant="dspark", markov_rank=8, confidence_head=True,
                                 confidence_head_with_markov=True)
    spec = lambda c: json.loads(speculators_config(c, "v", ["Qwen3ForCausalLM"], {},  # noqa
                                                   None).to_json_string())
    cases = [
        (native_config(cfg, {}, None), lambda c: c["dflash_config"].update(mask_token_id=10**6),
         "mask_token_id 1000000 is not a row of the 1024-token vocabulary"),
        (native_config(cfg, {}, None), lambda c: c["dflash_config"].update(target_layer_ids=[]),
         "field 'dflash_config.target_layer_ids'"),
        (spec(cfg), lambda c: c.update(aux_hidden_state_layer_ids=[0, 4]),
         "field 'aux_hidden_state_layer_ids.0': Input should be greater than or equal to 1"),
        (spec(cfg), lambda c: c["transformer_layer_config"].update(vocab_size="big"),
         "field 'transformer_layer_config.vocab_size'"),
        (spec(dspark), lambda c: c.update(markov_head_type="bogus"), "field 'markov_head_type'"),
    ]
    for i, (config, edit, message) in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        read_config(folder)  # as written: accepted
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(UserError, match=f"config "
                                            f"'{folder / 'config.json'}'.*{message.replace('(', '.')}"):
            read_config(folder)


def test_costs_files_that_make_sense_are_read(tmp_path):
    """The refusals above leave alone what gpu_costs.py measures: a flat curve up to a width, then
    rising; a drop within the noise measured on a loaded CPU (width 2 at 0.80x width 1); a context
    axis above its base; times down to 1 microsecond."""
    path = tmp_path / "costs.json"
    good = {"device": "GPU", "context": 512, "draft_ms": 0.001,
            "verify_ms_by_width": {"1": 4.28, "2": 3.44, "4": 3.58, "64": 4.9, "1024": 59.0},
            "draft_ms_by_batch": {"1": 1.0, "4": 0.9, "64": 8.2},
            "tree_build_ms_by_budget": {"16": 0.2, "64": 0.6},
            "verify_ms_by_context": {"2048": {"1": 3.8, "1024": 116.7}, "8192": {"1": 4.5, "1024": 250.0}},
            "tree_build_ms_by_scores": {"dflash2": {"16": 0.8}}, "chain_walk_ms_by_scores": {"dflash2": 0.1}}
    path.write_text(json.dumps(good))
    assert costs.read_device_costs(str(path)) == good


@pytest.mark.parametrize("extra, fragment", [
    (["--max-new-tokens", "600"], "--max-new-tokens 600 is past the 512 positions of target"),
    (["--suite", "LONG", "--max-new-tokens", "4"], "suite 'long' prompt 2 is "),
])
def test_eval_refuses_what_the_targets_positions_cannot_hold(extra, fragment, fresh_drafter_dir, tmp_path):
    """Past max_position_embeddings transformers only warned (of the tokenizer's length) and decoded
    on: a prompt leaving no position for its reply (named by suite and number; here its two turns
    together, the first fits) and a --max-new-tokens past them are one line before the sweep, with
    an earlier report kept."""
    long = write_jsonl(tmp_path / "long.jsonl", [
        {"messages": [{"role": "user", "content": "Hi!"}]},
        {"messages": [{"role": "user", "content": "hello " * 100}, {"role": "assistant", "content": "ok"},
                      {"role": "user", "content": "and again " * 100}]}])
    out = kept_output(tmp_path, "eval")
    extra = [str(long) if a == "LONG" else a for a in extra]
    argv = ["--drafter", fresh_drafter_dir, *extra, "--output", out, "--overwrite", "--limit", "4"]
    code, _, stderr = run_main(dflash_eval.main, argv)
    check_refused(code, stderr, fragment, out, tmp_path)
    if "--suite" in extra:
        assert "(its turns as the chat template renders them), leaving no room for a reply" in \
            error_line(stderr)
