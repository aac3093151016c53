"""dflash-export of a draft-vocabulary drafter: speculators' own loader and vLLM's config conversion and
compute_logits read our lm_head / d2t / t2d; exact import; --dtype bf16; refusals (native format, a
tampered d2t / t2d)."""

import ast
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_TARGET, error_line, run_main
from helpers.draft_vocab_run import DRAFT_VOCAB, draft_vocab_run
from dflash_train.checkpoint.folders import load_drafter
from dflash_train.cli.export import main
from dflash_train.model.drafter import ContextCache
from dflash_train.model.target import target_forward
from helpers.dflash import speculators_block_logits

V = 1024


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_data):
    return draft_vocab_run(tmp_path_factory, small_data)[0] / "final"


@pytest.fixture(scope="module")
def exports(trained, tmp_path_factory):
    base = tmp_path_factory.mktemp("dv-export")
    for name, extra in [("fp32", []), ("bf16", ["--dtype", "bf16"])]:
        code, _, stderr = run_main(main, ["--format", "speculators", "--checkpoint", trained, "--output",
                                          base / name, *extra])
        assert code == 0, stderr[-3000:]
    return base


def test_export_holds_exactly_the_drafters_tensors_and_config(exports, trained):
    ours, _ = load_drafter(trained)
    saved = load_file(exports / "fp32" / "model.safetensors")
    assert set(saved) == set(ours.state_dict())
    assert ({"lm_head.weight", "d2t", "t2d"} <= set(saved) and not {k for k in saved if "embed" in k
                                                                    or "verifier" in k})
    assert saved["lm_head.weight"].shape == (DRAFT_VOCAB, 128)
    config = json.loads((exports / "fp32" / "config.json").read_text())
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["transformer_layer_config"]["vocab_size"] == V


@torch.no_grad()
def test_speculators_loader_reads_our_head_and_maps_and_gives_our_logits(exports, trained, tiny_target):
    """SpeculatorModel.from_pretrained: a reduced-vocabulary DFlash model whose lm_head, d2t and t2d are
    ours; its own verifier_lm_head (the verifier's rows it selects through t2d) equals our head; its
    draft logits, scattered through d2t into the verifier's vocabulary, are our full_logits."""
    from speculators import SpeculatorModel

    spec = SpeculatorModel.from_pretrained(str(exports / "fp32"), verifier=str(TINY_TARGET)).eval()
    spec.config.transformer_layer_config._attn_implementation = "sdpa"
    ours, _ = load_drafter(trained)
    ours.eval()
    assert spec.use_draft_vocab and spec.draft_vocab_size == DRAFT_VOCAB and spec.verifier_vocab_size == V
    assert torch.equal(spec.lm_head.weight, ours.lm_head.weight)
    assert torch.equal(spec.verifier_lm_head.weight, ours.lm_head.weight)  # speculators' own t2d selection
    assert torch.equal(spec.d2t, ours.d2t) and torch.equal(spec.t2d, ours.t2d)

    ids = torch.randint(0, 1000, (1, 19))
    a, B = 11, ours.config.block_size
    spec_logits, block = speculators_block_logits(spec, tiny_target, ids, a, B)  # [1, B, N]

    taps, _ = target_forward(tiny_target, ids[:, :a], torch.ones_like(ids[:, :a]),
                             ours.config.target_layer_ids)
    cache = ContextCache(ours.config.num_hidden_layers)
    ours.extend_context(cache, taps, torch.arange(a)[None])
    hidden = ours.forward_cached(tiny_target.embed(block), torch.arange(a, a + B)[None], cache)
    torch.testing.assert_close(spec_logits, ours.lm_head(hidden), rtol=1e-5, atol=1e-5)
    mapped = torch.full((1, B, V), float("-inf"))
    mapped[..., torch.arange(DRAFT_VOCAB) + spec.d2t] = spec_logits
    torch.testing.assert_close(mapped, ours.full_logits(hidden, tiny_target.lm_head), rtol=1e-5, atol=1e-5)


def vllm_compute_logits(hidden, lm_head, d2t, draft_vocab_size, vocab_size):
    """vLLM 0.33's DFlash compute_logits (qwen3_dflash.py), executed on our tensors: the draft head's
    logits scattered to base + draft_id_to_target_id (our d2t, as its load_weights renames it)."""
    from fetch_vllm import DEST, VERSION

    source = DEST / "vllm" / "model_executor" / "models" / "qwen3_dflash.py"
    if not source.is_file():
        pytest.skip(f"vLLM {VERSION} sources not fetched (run `make vllm-ref`)")
    fns = [f for c in ast.parse(source.read_text()).body if isinstance(c, ast.ClassDef) for f in c.body
           if isinstance(f, ast.FunctionDef) and f.name == "compute_logits"
           and "draft_id_to_target_id" in ast.unparse(f)]
    assert (len(fns)
            == 1), "vLLM's qwen3_dflash.py no longer has one compute_logits mapping draft_id_to_target_id"
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=fns, type_ignores=[]), "qwen3_dflash.py", "exec"), namespace)  # noqa: S102
    this = SimpleNamespace(logits_processor=lambda head, h: head(h), lm_head=lm_head,
                           draft_id_to_target_id=d2t,
                           config=SimpleNamespace(draft_vocab_size=draft_vocab_size, vocab_size=vocab_size))
    return namespace["compute_logits"](this, hidden)


@torch.no_grad()
def test_vllm_reads_the_draft_vocabulary(exports, tiny_target):
    from helpers.vllm_reference import speculators_conversion, vllm_draft_config

    config = vllm_draft_config(exports / "fp32")
    assert config.draft_vocab_size == DRAFT_VOCAB and config.vocab_size == V
    pre_trained, spec = speculators_conversion(exports / "fp32")
    assert pre_trained["draft_vocab_size"] == DRAFT_VOCAB and spec["method"] == "dflash"
    imported, _ = load_drafter(exports / "fp32")
    hidden = torch.randn(6, 128)
    ref = vllm_compute_logits(hidden, imported.lm_head, imported.d2t, config.draft_vocab_size,
                              config.vocab_size)
    assert torch.equal(imported.full_logits(hidden, tiny_target.lm_head), ref)


def test_import_round_trip_is_exact(exports, trained):
    original, _ = load_drafter(trained)
    imported, meta = load_drafter(exports / "fp32")
    assert meta["format"] == "speculators" and imported.config == original.config
    sd = imported.state_dict()
    assert sd.keys() == original.state_dict().keys()
    for k, v in original.state_dict().items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k


def test_bf16_export_halves_the_floating_tensors_and_keeps_the_maps(exports, trained):
    fp32, bf16 = (load_file(exports / "fp32" / "model.safetensors"),
                  load_file(exports / "bf16" / "model.safetensors"))
    assert fp32.keys() == bf16.keys()
    floating = [k for k, v in fp32.items() if v.is_floating_point()]
    assert "lm_head.weight" in floating and {"d2t", "t2d"}.isdisjoint(floating)
    for k in floating:
        assert fp32[k].dtype == torch.float32 and bf16[k].dtype == torch.bfloat16, k
        assert torch.equal(bf16[k], fp32[k].bfloat16()), k
    assert bf16["d2t"].dtype == torch.int64 and torch.equal(bf16["d2t"], fp32["d2t"])
    assert bf16["t2d"].dtype == torch.bool and torch.equal(bf16["t2d"], fp32["t2d"])
    nbytes = lambda sd, keys: sum(sd[k].numel() * sd[k].element_size() for k in keys)  # noqa: E731
    assert 2 * nbytes(bf16, floating) == nbytes(fp32, floating)
    size = lambda name: (exports / name / "model.safetensors").stat().st_size  # noqa: E731
    assert size("bf16") < 0.55 * size("fp32")
    # it imports (floating weights widened back to float32) and trains / evaluates as the fp32 one rounded
    imported, _ = load_drafter(exports / "bf16")
    for k, v in imported.state_dict().items():
        expected = fp32[k].bfloat16().float() if k in floating else fp32[k]
        assert v.dtype == expected.dtype and torch.equal(v, expected), k


def test_eval_of_the_bf16_export_is_lossless(exports, tmp_path):
    from dflash_train.cli.eval import main as eval_main

    code, _, stderr = run_main(eval_main, ["--drafter", exports / "bf16", "--budgets", "0,8", "--limit", "2",
                                           "--max-new-tokens", "24", "--concurrency", "1",
                                           "--output", tmp_path / "e"])
    assert code == 0, stderr[-3000:]
    rows = json.loads((tmp_path / "e" / "report.json").read_text())["results"]
    assert {r["method"] for r in rows} >= {"ar", "dflash", "ddtree"} and all(r["lossless"] for r in rows)


def test_training_from_the_export_keeps_its_vocabulary(exports, small_data, tmp_path):
    from dflash_train.cli.train import main as train_main

    code, _, stderr = run_main(train_main, [
        f"output_dir={tmp_path / 'ft'}", f"model.init_from={exports / 'fp32'}", "model.num_layers=1",
        f"model.draft_vocab_size={DRAFT_VOCAB}", "max_steps=1", "train.lr=1e-12", "train.batch_size=4",
        "data.num_anchors=4", "eval.max_samples=2", f"data.train={small_data / 'val.jsonl'}",
        f"data.val={small_data / 'val.jsonl'}"])
    assert code == 0, stderr[-3000:]
    start = load_file(exports / "fp32" / "model.safetensors")
    end = load_file(tmp_path / "ft" / "final" / "model.safetensors")
    for k in ("d2t", "t2d", "lm_head.weight"):
        assert torch.equal(end[k], start[k]), k


def test_native_format_is_refused_and_writes_nothing(trained, tmp_path):
    code, _, stderr = run_main(main, ["--format", "dflash", "--checkpoint", trained, "--output",
                                      tmp_path / "o"])
    assert code == 2
    assert error_line(stderr) == (f"error: the native DFlash format has no draft vocabulary (this "
                                  f"drafter drafts over {DRAFT_VOCAB} of {V} tokens through its own lm_head "
                                  "/ d2t): export it with --format speculators")
    assert list(tmp_path.iterdir()) == []


def tamper(src, dst, how: str):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    kept = (tensors["d2t"] + torch.arange(len(tensors["d2t"]))).tolist()
    if how == "d2t":  # one draft index moved to the next target id, still ascending: t2d no longer says so
        i = next(i for i in range(len(kept) - 1) if kept[i] + 1 < kept[i + 1])
        tensors["d2t"][i] += 1
    elif how == "t2d":  # one more target id marked
        tensors["t2d"][next(t for t in range(V) if t not in kept)] = True
    elif how == "order":  # two draft indices swapped
        tensors["d2t"][:2] = torch.tensor([kept[1], kept[0] - 1])
    else:  # the offsets stored as int32
        tensors["d2t"] = tensors["d2t"].int()
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("how, message", [("d2t", "d2t and t2d disagree"), ("t2d", "d2t and t2d disagree"),
                                          ("order", "ascending target ids"), ("dtype", "d2t must be int64")])
def test_a_tampered_d2t_or_t2d_is_refused_on_load(exports, tmp_path, how, message):
    bad = tamper(exports / "fp32", tmp_path / "bad", how)
    code, _, stderr = run_main(main, ["--format", "speculators", "--checkpoint", bad, "--output",
                                      tmp_path / "o"])
    assert code == 2
    line = error_line(stderr)
    assert message in line and str(bad) in line
    assert not (tmp_path / "o").exists()
    if how == "d2t":  # dflash-eval reads it through the same check
        from dflash_train.cli.eval import main as eval_main

        code, _, stderr = run_main(eval_main, ["--drafter", bad, "--budgets", "8", "--limit", "1",
                                               "--output", tmp_path / "e"])
        assert code == 2 and message in error_line(stderr)
        assert not (tmp_path / "e").exists()


def test_a_draft_vocabulary_of_the_whole_vocabulary_is_refused(tiny_target, tmp_path):
    """model.draft_vocab_size = V would be the identity vocabulary, whose d2t / t2d speculators'
    loader reports UNEXPECTED and vLLM 0.33 cannot load (it makes no draft_id_to_target_id
    parameter when the sizes are equal): training refuses it, and so does reading a config that
    says it."""
    from dflash_train.core.errors import UserError
    from dflash_train.training.build import drafter_config_for
    from dflash_train.training.config import ModelConfig

    with pytest.raises(UserError, match="below the target's vocabulary"):
        drafter_config_for(tiny_target, ModelConfig(num_layers=1, draft_vocab_size=V))
    drafter_config_for(tiny_target, ModelConfig(num_layers=1, draft_vocab_size=V - 1))  # the largest allowed


@pytest.mark.parametrize("fmt", ["speculators", "ours"])
def test_a_config_that_lost_its_draft_vocabulary_is_refused_on_load(exports, trained, tmp_path, fmt):
    """A Speculators config without draft_vocab_size whose weights carry lm_head / d2t / t2d was evaluated
    (dflash-eval --drafter) as a full-vocabulary drafter, the three tensors dropped as the verifier's:
    the config and the weights disagree, one line."""
    from dflash_train.cli.eval import main as eval_main

    bad = tmp_path / "bad"
    shutil.copytree(exports / "fp32" if fmt == "speculators" else trained, bad)
    config = json.loads((bad / "config.json").read_text())
    if fmt == "speculators":
        del config["draft_vocab_size"]
    else:
        config["drafter"]["draft_vocab_size"] = None
    (bad / "config.json").write_text(json.dumps(config))
    code, _, stderr = run_main(eval_main, ["--drafter", bad, "--budgets", "8", "--limit", "1",
                                           "--max-new-tokens", "8", "--output", tmp_path / "e"])
    assert code == 2 and error_line(stderr) == (
        f"error: '{bad}': the config and the weights disagree: the config gives no draft vocabulary (no "
        f"draft_vocab_size below {V}), the weights carry one of {DRAFT_VOCAB} tokens (d2t, "
        "lm_head.weight, t2d): set draft_vocab_size in its config.json, or drop them")
    assert not (tmp_path / "e").exists()


def test_whole_vocabulary_maps_and_the_verifiers_head_beside_a_full_vocabulary_drafter_still_load(
        fresh_drafter_dir, tiny_target, tmp_path):
    """What speculators itself ignores beside a full-vocabulary drafter (identity d2t / t2d, the verifier's
    lm_head) says nothing against its config: still loaded, still dropped."""
    folder = tmp_path / "full"
    shutil.copytree(fresh_drafter_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    extra = {"d2t": torch.zeros(V, dtype=torch.int64), "t2d": torch.ones(V, dtype=torch.bool),
             "lm_head.weight": tiny_target.lm_head.weight.detach().clone()}
    save_file({**tensors, **extra}, folder / "model.safetensors")
    drafter, _ = load_drafter(folder)
    assert drafter.lm_head is None and set(drafter.state_dict()) == set(tensors)
