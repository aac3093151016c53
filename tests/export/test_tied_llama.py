"""A tiny Llama target with tied embeddings and a mask token taken from existing special ids trains,
validates, decodes losslessly (chain and trees) and exports; vLLM 0.33's own config conversion reads
the export with the right taps, mask id, block size and causality.

SmolLM2-135M-Instruct in miniature: `tie_word_embeddings` (one matrix is both the embedding and the
LM head, and the checkpoint holds no lm_head.weight), padding with the EOS token, and no spare
vocabulary row, so the mask is an existing special token that chat never produces (SmolLM2's
<empty_output>; here <|endoftext|>, id 0) and the tokenizer has no <|MASK|> at all."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import TINY_TARGET, chat_prompt
from dflash_train.checkpoint.folders import load_drafter
from dflash_train.cli.export import main as export_main
from dflash_train.data.dataset import stop_token_ids
from dflash_train.decoding.decode import decode
from dflash_train.model.target import load_target

MASK, MASK_ID = "<|endoftext|>", 0
QUESTIONS = ["What is 23 + 59?", "Tell me about Oakgate.", "Hello!"]


@pytest.fixture(scope="module")
def tied_target_dir(tmp_path_factory):
    """6-layer Llama, tied embeddings; the bundled tokenizer with its <|MASK|> renamed (so only
    model.mask_token can make <|endoftext|> the mask) and, like SmolLM2's, EOS as the pad token."""
    out = tmp_path_factory.mktemp("tied") / "target"
    tok_dir = out.parent / "tok"
    shutil.copytree(TINY_TARGET, tok_dir)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        (tok_dir / name).write_text((tok_dir / name).read_text().replace("<|MASK|>", "<|unused|>"))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.pad_token = tok.eos_token
    assert ("<|MASK|>" not in tok.get_vocab() and tok.convert_tokens_to_ids(MASK) == MASK_ID
            != tok.pad_token_id)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    # greedy output that repeats a token, then moves on (0.02: one token forever)
    config.initializer_range = 0.1
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def run_dir(tied_target_dir, small_data, tmp_path_factory):
    from dflash_train.cli.train import main

    out = tmp_path_factory.mktemp("tied-run") / "run"
    main([f"output_dir={out}", f"model.target={tied_target_dir}", f"model.mask_token={MASK}", "max_steps=20",
          "model.num_layers=2", "model.block_size=8", f"data.train={small_data / 'train.jsonl'}",
          f"data.val={small_data / 'val.jsonl'}", "train.batch_size=8", "data.num_anchors=16", "eval.every=0",
          "eval.max_samples=8", "eval.num_anchors=16", "eval.ddtree_budgets=[8]", "checkpoint_every=0",
          "log_every=20"])
    return out


def test_the_target_is_tied(tied_target_dir):
    target = load_target(str(tied_target_dir))
    assert target.lm_head.weight.data_ptr() == target.embed.weight.data_ptr()
    assert "lm_head.weight" not in load_file(tied_target_dir / "model.safetensors")


def test_trains_and_validates_with_the_special_token_mask(run_dir, tied_target_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["target_layer_ids"] == [1, 3]
    val = summary["eval"]
    assert val["eal"] >= 1.0 and len(val["acc_per_position"]) == 7 and set(val["ddtree_tau"]) == {"8"}
    drafter, meta = load_drafter(run_dir / "final")
    tok = AutoTokenizer.from_pretrained(tied_target_dir)
    assert (meta["mask_token"] == MASK and drafter.config.mask_token_id
            == tok.convert_tokens_to_ids(MASK) == MASK_ID)
    # the drafter borrows the target's (tied) matrix: its own weights hold no copy of it
    saved = load_file(run_dir / "final" / "model.safetensors")
    assert not {k for k in saved if "embed" in k or "lm_head" in k}
    assert not any(v.shape[0] == len(tok) for v in saved.values())


@pytest.mark.parametrize("method, budget", [("dflash", 0), ("ddtree", 4), ("ddtree", 32)])
def test_decoding_is_lossless(run_dir, tied_target_dir, method, budget):
    target = load_target(str(tied_target_dir))
    drafter = load_drafter(run_dir / "final")[0].eval()
    stops = stop_token_ids(target.model, target.tokenizer)
    emitted = rounds = 0
    for q in QUESTIONS:
        ids = chat_prompt(target.tokenizer, q)
        greedy = target.model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
        ar = decode(target, None, ids, "ar", max_new_tokens=32, stop_ids=stops).tokens
        assert ar == greedy[:len(ar)] and (len(ar) == 32 or ar[-1] in stops), q
        r = decode(target, drafter, ids, method, budget, max_new_tokens=32, stop_ids=stops)
        assert r.tokens == ar, q
        assert all(1 <= a <= drafter.config.block_size for a in r.accept_lengths)
        emitted, rounds = emitted + sum(r.accept_lengths), rounds + len(r.accept_lengths)
    assert emitted / rounds > 1.0  # some guesses were accepted (and some rejected): compaction ran


@pytest.mark.parametrize("fmt", ["speculators", "dflash"])
def test_export_reads_right_in_vllm(fmt, run_dir, tied_target_dir, tmp_path):
    from helpers.vllm_reference import speculators_conversion, vllm_draft_config, vllm_layer_causal

    out = tmp_path / "o"
    export_main(["--format", fmt, "--checkpoint", str(run_dir / "final"), "--output", str(out)])
    ours, _ = load_drafter(run_dir / "final")
    weights = load_file(out / "model.safetensors")
    embedding = load_target(str(tied_target_dir)).embed.weight
    assert not {k for k in weights if "embed" in k or "lm_head" in k or "verifier" in k}
    assert not any(v.shape == embedding.shape for v in weights.values())  # no copy under another name

    config = vllm_draft_config(out)
    layers = ours.config.num_hidden_layers
    assert [vllm_layer_causal(config, i) for i in range(layers)] == [False] * layers
    assert config.dflash_config["target_layer_ids"] == ours.config.target_layer_ids == [1, 3]
    assert config.dflash_config["mask_token_id"] == ours.config.mask_token_id == MASK_ID
    if fmt == "speculators":
        _, spec = speculators_conversion(out)
        assert spec == {"method": "dflash", "num_speculative_tokens": ours.config.block_size - 1}
    else:
        assert config.block_size == ours.config.block_size
    imported, meta = load_drafter(out)
    assert meta["mask_token"] == MASK and imported.config == ours.config
    for k, v in ours.state_dict().items():
        assert torch.equal(imported.state_dict()[k], v), k


@torch.no_grad()
def test_speculators_loader_takes_the_tied_matrix_as_lm_head(run_dir, tied_target_dir, tmp_path):
    """speculators' own loader reads the verifier's LM head: with tied embeddings there is no
    lm_head.weight in the verifier, and the head it uses must still be the embedding matrix."""
    from speculators import SpeculatorModel

    export_main(["--format", "speculators", "--checkpoint", str(run_dir / "final"), "--output",
                 str(tmp_path / "o")])
    spec = SpeculatorModel.from_pretrained(str(tmp_path / "o"), verifier=str(tied_target_dir)).eval()
    embedding = load_target(str(tied_target_dir)).embed.weight
    torch.testing.assert_close(spec.embed_tokens.weight, embedding, rtol=0, atol=0)
    torch.testing.assert_close(spec.lm_head.weight, embedding, rtol=0, atol=0)
