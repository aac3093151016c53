"""DSpark drafters: the heads against speculators' own DSparkDraftModel, the Markov chain against
teacher forcing, lossless decoding with the chain and the path-conditioned tree, markov_rank 0
against plain DFlash, and speculators-written checkpoints read back."""

import pytest
import torch

from conftest import TINY_TARGET, chat_prompt
from dflash_train.checkpoint.folders import load_drafter
from dflash_train.checkpoint.formats import speculators_config
from dflash_train.data.dataset import stop_token_ids
from dflash_train.decoding.decode import decode
from dflash_train.decoding.proposers import draft_hidden
from dflash_train.model.drafter import ContextCache, DFlashDrafter
from dflash_train.model.target import target_forward
from dflash_train.model.variants import dspark
from helpers.draft_vocab_run import assert_lossless_in_draft_vocab
from helpers.dspark import (B, dspark_config, our_block_logits, random_dspark,
                           speculators_block_logits)

HEAD_TYPES = ["vanilla", "gated", "rnn"]
QUESTIONS = ["What is 23 + 59?", "Tell me about Oakgate.", "Please sort 12, 5, 33, 8.",
             "How many seconds are in 7 minutes?", "Hello!"]


def speculators_model(drafter):
    """speculators' DSparkDraftModel with our config and weights (embeddings / LM head from the verifier)."""
    from speculators.models.dspark import DSparkDraftModel

    config = speculators_config(drafter.config, str(TINY_TARGET), ["Qwen3ForCausalLM"], {}, None)
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention is for training on GPU
    spec = DSparkDraftModel(config)
    spec.load_verifier_weights()
    missing, unexpected = spec.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and set(missing) == {"embed_tokens.weight", "lm_head.weight",
                                               "verifier_lm_head.weight", "verifier_norm.weight"}
    return spec.eval()


@pytest.mark.parametrize("head_type", HEAD_TYPES)
@torch.no_grad()
def test_forward_equals_speculators_dspark(tiny_target, head_type, monkeypatch):
    """Independent reference: speculators' DSparkDraftModel.forward on the same weights and
    anchors gives the same Markov-corrected logits and confidence logits for every drafted slot."""
    pytest.importorskip("speculators.models.dspark")
    drafter = random_dspark(tiny_target, head_type)
    spec = speculators_model(drafter)
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (1, 30))
    anchors = torch.tensor([2, 9, 15, 23])
    spec_logits, spec_conf = speculators_block_logits(spec, tiny_target, ids, anchors, monkeypatch)
    logits, conf = our_block_logits(drafter, tiny_target, ids, anchors)
    torch.testing.assert_close(logits, spec_logits[:, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conf, spec_conf[:, 1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_parameter_names_are_speculators_dspark_names(tiny_target, head_type):
    spec_mod = pytest.importorskip("speculators.models.dspark")
    for confidence in [True, False]:
        drafter = DFlashDrafter(dspark_config(tiny_target, head_type, confidence=confidence))
        spec = spec_mod.DSparkDraftModel(speculators_config(drafter.config, str(TINY_TARGET), [], {}, None))
        theirs = {k: v.shape for k, v in spec.state_dict().items()
                  if not k.startswith(("embed_tokens", "lm_head", "verifier_"))}
        ours = {k: v.shape for k, v in drafter.state_dict().items()}
        assert ours == theirs
        assert any(k.startswith("markov_head.") for k in ours)
        assert any(k.startswith("confidence_head.") for k in ours) == confidence


@pytest.mark.parametrize("head_type", HEAD_TYPES)
@torch.no_grad()
def test_markov_chain_is_teacher_forcing_on_its_own_tokens(tiny_target, head_type):
    """Inference feeds back the drafted tokens one slot at a time; training feeds a whole block of
    true tokens. Given the chain's own tokens as the block, both compute the same logits, and each
    chain token is the argmax of its slot."""
    drafter = random_dspark(tiny_target, head_type, seed=3)
    cfg = drafter.config
    ids = torch.randint(0, 1000, (1, 17))
    taps, _ = target_forward(tiny_target, ids, torch.ones_like(ids), cfg.target_layer_ids)
    ctx = ContextCache(cfg.num_hidden_layers)
    drafter.extend_context(ctx, taps, torch.arange(17)[None])
    bonus = 77
    hidden = draft_hidden(drafter, tiny_target, ctx, bonus, 17)  # [B, H]
    base = tiny_target.lm_head(hidden[1:])
    tokens, logits, conf = dspark.markov_chain(drafter, hidden, base, bonus)
    assert torch.equal(tokens, logits.argmax(-1))
    block = torch.cat([torch.tensor([bonus]), tokens])[None, None]  # [1, 1, B]
    u, forced_conf = dspark.teacher_forced(drafter, hidden[None, None], block)
    forced = dspark.markov_logits(tiny_target.lm_head, drafter.markov_head, hidden[None, None, 1:], u)
    torch.testing.assert_close(logits, forced[0, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conf, forced_conf[0, 0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits, base, atol=1e-3)  # the bias is really applied


@pytest.mark.parametrize("terms, weighting",
                         [({"ce": 0.1, "tv": 0.9}, "exp"), ({"ce": 1.0, "kl": 0.5}, "dpace")])
@pytest.mark.parametrize("chunk_slots", [1, 6])
def test_markov_bias_through_the_chunked_loss(terms, weighting, chunk_slots):
    """The Markov bias u . W2 added inside the loss: chunks of blocks give the value and the
    gradients (for h, u and W2) of whole-batch autograd on lm_head(h) + W2 u, in float64."""
    from dflash_train.training.config import LossConfig
    from dflash_train.model.loss import dflash_loss

    g = torch.Generator().manual_seed(chunk_slots)
    b, A, K, H, r, V = 2, 4, 3, 8, 5, 61
    head = torch.nn.Linear(H, V, bias=False, dtype=torch.float64).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=torch.float64))
    h, th = (torch.randn(b, A, K, H, generator=g, dtype=torch.float64) for _ in range(2))
    u = torch.randn(b, A, K, r, generator=g, dtype=torch.float64)
    w2 = torch.randn(V, r, generator=g, dtype=torch.float64)
    tokens, valid = torch.randint(0, V, (b, A, K), generator=g), torch.rand(b, A, K, generator=g) > 0.2
    norm = torch.tensor(5.0, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (h, u, w2)]
    cfg0 = LossConfig(terms=terms, position_weight=weighting, chunk_slots=0)
    # reference: whole logits built by plain autograd (the chunked loss is told nothing)
    identity = torch.nn.Identity()
    ref, m_ref = dflash_loss(head(leaves[0]) + leaves[1] @ leaves[2].T, head(th), identity, tokens, valid,
                             cfg0, norm)
    ref.backward()
    chunked = [t.clone().requires_grad_() for t in (h, u, w2)]
    loss, m = dflash_loss(chunked[0], th, head, tokens, valid,
                          LossConfig(terms=terms, position_weight=weighting,
                          chunk_slots=chunk_slots), norm, markov_bias=(chunked[1], chunked[2]))
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    for a, b_ in zip(chunked, leaves):
        torch.testing.assert_close(a.grad, b_.grad, rtol=1e-10, atol=1e-12)
        assert a.grad.abs().sum() > 0
    torch.testing.assert_close(m["alpha"], m_ref["alpha"], rtol=1e-12, atol=1e-12)
    assert torch.equal(m["correct"], m_ref["correct"])


# --- decoding: lossless with the chain and every budget ------------------------------------------

@pytest.fixture(scope="module")
def trained_backbone(trained_drafter_dir):
    return load_drafter(trained_drafter_dir)[0].eval()


def dspark_on_backbone(backbone, target, head_type, rank=16, confidence=True, seed=0):
    """A DSpark drafter whose backbone is a trained DFlash drafter (so drafts are accepted) and
    whose heads are random with a bias of about one logit (so the conditioning changes the tree)."""
    cfg = backbone.config
    torch.manual_seed(seed)
    drafter = DFlashDrafter(dspark_config(target, head_type, rank=rank, block_size=cfg.block_size,
                                          confidence=confidence, num_layers=cfg.num_hidden_layers)).eval()
    missing, unexpected = drafter.load_state_dict(backbone.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(("markov_head.", "confidence_head.")) for k in missing)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith(("markov_head.", "confidence_head.")):
                p.normal_(0, 0.5)
    return drafter


@pytest.mark.parametrize("head_type, runs", [
    ("vanilla", [("dflash", 0, "conditional"), ("ddtree", 1, "conditional"), ("ddtree", 4, "conditional"),
                 ("ddtree", 16, "conditional"), ("ddtree", 64, "conditional"), ("ddtree", 300, "conditional"),
                 ("ddtree", 16, "marginal")]),
    ("gated", [("dflash", 0, "conditional"), ("ddtree", 16, "conditional"), ("ddtree", 64, "conditional")]),
    ("rnn", [("dflash", 0, "conditional"), ("ddtree", 16, "conditional"), ("ddtree", 64, "conditional")]),
])
def test_dspark_output_is_the_greedy_output(tiny_target, trained_backbone, head_type, runs):
    drafter = dspark_on_backbone(trained_backbone, tiny_target, head_type)
    stops = stop_token_ids(tiny_target.model, tiny_target.tokenizer)
    prompts = [chat_prompt(tiny_target.tokenizer, q) for q in QUESTIONS]
    ars = [decode(tiny_target, None, ids, "ar", max_new_tokens=60, stop_ids=stops).tokens for ids in prompts]
    for method, budget, scores in runs:
        emitted = rounds = 0
        for ids, ar in zip(prompts, ars):
            r = decode(tiny_target, drafter, ids, method, budget, max_new_tokens=60, stop_ids=stops,
                       tree_scores=scores)
            assert r.tokens == ar, (method, budget, scores)
            emitted, rounds = emitted + sum(r.accept_lengths), rounds + len(r.accept_lengths)
        if budget != 1:  # drafts were really accepted, so compaction and context updates were exercised
            assert emitted / rounds > 1.3, (method, budget, scores)


def test_conditional_tree_is_used_in_decoding(tiny_target, trained_backbone):
    """The path-conditioned and the marginal tree are different trees (different accept lengths
    somewhere), with the same output."""
    drafter = dspark_on_backbone(trained_backbone, tiny_target, "vanilla")
    ids = chat_prompt(tiny_target.tokenizer, QUESTIONS[2])
    a = decode(tiny_target, drafter, ids, "ddtree", 16, max_new_tokens=60, tree_scores="conditional")
    b = decode(tiny_target, drafter, ids, "ddtree", 16, max_new_tokens=60, tree_scores="marginal")
    assert a.tokens == b.tokens and (a.accept_lengths != b.accept_lengths or a.spine != b.spine)


def test_markov_rank_zero_is_plain_dflash(tiny_target, trained_backbone):
    """markov_rank 0 (a confidence head only): the same trees, rounds and outputs as the DFlash
    drafter it shares its backbone with."""
    drafter = dspark_on_backbone(trained_backbone, tiny_target, "vanilla", rank=0)
    assert drafter.markov_head is None and drafter.confidence_head is not None
    stops = stop_token_ids(tiny_target.model, tiny_target.tokenizer)
    for q in QUESTIONS[:3]:
        ids = chat_prompt(tiny_target.tokenizer, q)
        for method, budget in [("dflash", 0), ("ddtree", 4), ("ddtree", 64)]:
            a = decode(tiny_target, drafter, ids, method, budget, max_new_tokens=48, stop_ids=stops)
            b = decode(tiny_target, trained_backbone, ids, method, budget, max_new_tokens=48, stop_ids=stops)
            assert (a.tokens, a.accept_lengths, a.spine) == (b.tokens, b.accept_lengths, b.spine)
            assert (a.confidence is not None) == (method == "dflash")


def test_chain_confidence_calibration_counts(tiny_target, trained_backbone):
    drafter = dspark_on_backbone(trained_backbone, tiny_target, "vanilla")
    r = decode(tiny_target, drafter, chat_prompt(tiny_target.tokenizer, QUESTIONS[0]), "dflash",
               max_new_tokens=40)
    predicted, reached, accepted = r.confidence
    assert reached[0] == len(r.accept_lengths)  # slot 1 is reached every round
    assert sum(accepted) == sum(r.accept_lengths) - len(r.accept_lengths)  # every accepted drafted token
    assert all(0 <= p <= n for p, n in zip(predicted, reached)) and reached == sorted(reached, reverse=True)


# --- checkpoints written by speculators -----------------------------------------------------------

def speculators_written_dspark(folder, target, head_type, sample_from_anchor=False, with_markov=True,
                               draft_vocab_size=None):
    """A DSpark checkpoint made by speculators' own classes (as its trainer saves it)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    ours = dspark_config(target, head_type)  # only for the Qwen3 layer shape
    layer = ours.qwen3_config()
    layer._attn_implementation = "sdpa"  # flex attention is for training on GPU
    config = DSparkSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab_size or ours.vocab_size, block_size=B,
        target_hidden_size=ours.hidden_size,
        aux_hidden_state_layer_ids=[k + 1 for k in ours.target_layer_ids], mask_token_id=ours.mask_token_id,
        sample_from_anchor=sample_from_anchor, markov_rank=12, markov_head_type=head_type,
        enable_confidence_head=True, confidence_head_with_markov=with_markov,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=B - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(TINY_TARGET), architectures=["Qwen3ForCausalLM"])))
    torch.manual_seed(5)
    model = DSparkDraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens", "lm_head", "verifier_")):
                p.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    if draft_vocab_size:  # N random tokens: t2d marks them, draft index i is target id i + d2t[i]
        kept = torch.randperm(ours.vocab_size)[:draft_vocab_size].sort().values
        t2d = torch.zeros(ours.vocab_size, dtype=torch.bool)
        t2d[kept] = True
        model.load_vocab_mappings(t2d, kept - torch.arange(draft_vocab_size))
    model.load_verifier_weights()
    model.save_pretrained(str(folder))
    return model


@pytest.mark.parametrize("head_type, with_markov, draft_vocab_size",
                         [("vanilla", True, None), ("gated", True, None), ("rnn", False, None),
                          ("vanilla", True, 500), ("rnn", True, 500)])
@torch.no_grad()
def test_speculators_written_checkpoint_is_read(tiny_target, tmp_path, head_type, with_markov,
                                                draft_vocab_size, monkeypatch):
    """A speculators-written DSpark folder (full vocabulary, or a draft vocabulary of 500 random tokens:
    W2 [N, r] over it, lm_head / d2t / t2d) gives speculators' Markov-corrected logits."""
    pytest.importorskip("speculators.models.dspark")
    spec = speculators_written_dspark(tmp_path / "spec", tiny_target, head_type, with_markov=with_markov,
                                      draft_vocab_size=draft_vocab_size)
    drafter, meta = load_drafter(tmp_path / "spec")
    drafter.eval()
    c = drafter.config
    assert meta["format"] == "speculators" and meta["target"]["name_or_path"] == str(TINY_TARGET)
    assert (c.variant, c.markov_rank, c.markov_head_type, c.confidence_head,
            c.confidence_head_with_markov, c.draft_vocab_size) == (
        "dspark", 12, head_type, True, with_markov, draft_vocab_size)
    if draft_vocab_size:
        assert torch.equal(drafter.t2d, spec.t2d) and drafter.markov_head.markov_w2.weight.shape == (500, 12)
    spec.eval()
    ids = torch.randint(0, 1000, (1, 26))
    anchors = torch.tensor([1, 8, 19])
    spec_logits, spec_conf = speculators_block_logits(spec, tiny_target, ids, anchors, monkeypatch)
    logits, conf = our_block_logits(drafter, tiny_target, ids, anchors)
    torch.testing.assert_close(logits, spec_logits[:, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conf, spec_conf[:, 1:], rtol=1e-5, atol=1e-5)


def test_speculators_default_sample_from_anchor_is_refused(tiny_target, tmp_path):
    from dflash_train.core.errors import UserError

    speculators_written_dspark(tmp_path / "spec", tiny_target, "vanilla", sample_from_anchor=True)
    with pytest.raises(UserError, match="sample_from_anchor true") as e:
        load_drafter(tmp_path / "spec")
    assert "\n" not in str(e.value)


def test_eval_and_training_import_speculators_dspark(tiny_target, tmp_path, small_data):
    """dflash-eval --drafter and model.init_from read a checkpoint written by speculators."""
    import json

    from dflash_train.cli.eval import main as eval_main
    from dflash_train.cli.train import main as train_main

    speculators_written_dspark(tmp_path / "spec", tiny_target, "vanilla")
    eval_main(["--drafter", str(tmp_path / "spec"), "--limit", "2", "--budgets", "8", "--max-new-tokens",
               "16", "--output", str(tmp_path / "eval")])
    rep = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert rep["variant"] == "dspark" and all(r["lossless"] for r in rep["results"])
    chain = next(r for r in rep["results"] if r["method"] == "dflash")
    assert len(chain["confidence"]["predicted"]) == B - 1
    train_main([f"output_dir={tmp_path / 'ft'}", f"model.init_from={tmp_path / 'spec'}", "max_steps=2",
                "train.lr=1e-12", f"data.train={small_data / 'train.jsonl'}",
                f"data.val={small_data / 'val.jsonl'}", "train.batch_size=4", f"model.block_size={B}",
                "model.variant=dspark", "model.markov_rank=12", "eval.max_samples=4"])
    start, end = load_drafter(tmp_path / "spec")[0], load_drafter(tmp_path / "ft" / "final")[0]
    for k, v in start.state_dict().items():
        torch.testing.assert_close(end.state_dict()[k], v, rtol=0, atol=1e-8)


def test_dspark_refuses_engines_that_cannot_gather_its_heads(monkeypatch):
    from dflash_train.core.errors import UserError
    from dflash_train.training.setup import check_heads_engine

    monkeypatch.delenv("FSDP_RESHARD_AFTER_FORWARD", raising=False)
    for value in [None, "true"]:
        if value:
            monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", value)
        with pytest.raises(UserError, match="fsdp_dspark.yaml"):
            check_heads_engine("dspark", "fsdp", accelerator=None)
        check_heads_engine("dflash", "fsdp", accelerator=None)  # DFlash: any FSDP config
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    check_heads_engine("dspark", "fsdp", accelerator=None)


def test_dspark_recipe_starts_from_a_dflash_drafter(trained_drafter_dir, tmp_path, small_data):
    """model.init_from a DFlash drafter in a DSpark recipe: its backbone, fresh heads."""
    from dflash_train.cli.train import main as train_main

    train_main([f"output_dir={tmp_path / 'ft'}", f"model.init_from={trained_drafter_dir}", "max_steps=1",
                "train.lr=1e-12", f"data.train={small_data / 'train.jsonl'}",
                f"data.val={small_data / 'val.jsonl'}", "train.batch_size=4", "model.variant=dspark",
                "model.markov_rank=8", "eval.max_samples=4"])
    start, end = load_drafter(trained_drafter_dir)[0], load_drafter(tmp_path / "ft" / "final")[0]
    assert end.config.variant == "dspark" and end.markov_head is not None and end.confidence_head is not None
    for k, v in start.state_dict().items():
        torch.testing.assert_close(end.state_dict()[k], v, rtol=0, atol=1e-8)


# --- a draft vocabulary --------------------------------------------------------------------------------

RANK = 12


@pytest.fixture(scope="module")
def dspark_draft_vocab(tmp_path_factory, small_data):
    """A DSpark drafter grown (model.init_from) from a DFlash drafter with a 128-token draft vocabulary,
    trained a few steps: the vocabulary kept, W2 over it."""
    from helpers.draft_vocab_run import DRAFT_VOCAB, draft_vocab_run
    from dflash_train.cli.train import main as train_main

    dflash, _ = draft_vocab_run(tmp_path_factory, small_data)
    out = tmp_path_factory.mktemp("dspark-vocab") / "run"
    train_main([f"output_dir={out}", f"model.init_from={dflash / 'final'}", "model.variant=dspark",
                f"model.markov_rank={RANK}", "model.markov_head_type=rnn",
                f"model.draft_vocab_size={DRAFT_VOCAB}", "model.num_layers=1", "max_steps=6", "train.lr=3e-3",
                "train.batch_size=8", "data.num_anchors=16", "log_every=1", "eval.every=0",
                "eval.max_samples=4", "eval.ddtree_budgets=[4, 16]",
                "checkpoint_every=0", "loss.terms={ce: 0.1, tv: 0.9}",
                f"data.train={small_data / 'train.jsonl'}", f"data.val={small_data / 'val.jsonl'}"])
    return dflash / "final", out


def biased(drafter):
    """The drafter with a Markov bias of a few logits, so that it changes the drafts."""
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0, 1.0)
        drafter.markov_head.markov_w1.weight.normal_(0, 1.0)
    return drafter


def test_draft_vocabulary_run_keeps_the_vocabulary_and_lowers_the_loss(dspark_draft_vocab):
    import json

    dflash_dir, out = dspark_draft_vocab
    start, end = load_drafter(dflash_dir)[0], load_drafter(out / "final")[0]
    assert end.config.draft_vocab_size == 128 and torch.equal(end.t2d, start.t2d)
    assert end.markov_head.markov_w2.weight.shape == (128, RANK)
    assert end.markov_head.markov_w1.weight.shape[0] == end.config.vocab_size  # W1 reads target ids
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "step" in r and "loss" in r]
    assert losses[-1] < losses[0], losses
    assert set(records[-1]["val_ddtree_tau"]) == {"4", "16"}  # validation's path-conditioned trees ran


def test_draft_vocabulary_ce_steps_train_the_confidence_head(tmp_path_factory, small_data,
                                                              dspark_draft_vocab):
    """A ce step with a draft vocabulary computes the target's probabilities only when something reads them:
    the confidence head's BCE does on every step (not only on log steps), so its weights move, and with
    loss.confidence_weight 0 they do not."""
    from dflash_train.cli.train import main as train_main

    heads = []
    for weight in (1.0, 0.0):
        out = tmp_path_factory.mktemp("conf") / "run"
        train_main([f"output_dir={out}", f"model.init_from={dspark_draft_vocab[0]}", "model.variant=dspark",
                    f"model.markov_rank={RANK}", "model.draft_vocab_size=128", "model.num_layers=1",
                    "max_steps=2", "log_every=100", "train.lr=1e-2", "train.batch_size=4",
                    "data.num_anchors=8", "eval.every=0", "eval.max_samples=2", "checkpoint_every=0",
                    "loss.terms={ce: 1.0}",
                    f"loss.confidence_weight={weight}", f"data.train={small_data / 'train.jsonl'}",
                    f"data.val={small_data / 'val.jsonl'}"])
        heads.append(load_drafter(out / "final")[0].confidence_head.proj.weight)
    assert not torch.allclose(heads[0], heads[1], atol=1e-4)


@torch.no_grad()
def test_draft_vocabulary_chain_is_teacher_forcing_on_its_own_tokens(tiny_target, dspark_draft_vocab):
    """In draft space the chain feeds each drafted index back as its target id: given the chain's tokens
    (mapped to target ids) as the block, teacher forcing computes the same [B-1, N] logits."""
    drafter = biased(load_drafter(dspark_draft_vocab[1] / "final")[0].eval())
    cfg = drafter.config
    ids = torch.randint(0, 1000, (1, 17))
    taps, _ = target_forward(tiny_target, ids, torch.ones_like(ids), cfg.target_layer_ids)
    ctx = ContextCache(cfg.num_hidden_layers)
    drafter.extend_context(ctx, taps, torch.arange(17)[None])
    bonus = 77
    hidden = draft_hidden(drafter, tiny_target, ctx, bonus, 17)
    base = drafter.lm_head(hidden[1:])  # [B-1, N]
    tokens, logits, conf = dspark.markov_chain(drafter, hidden, base, bonus, dspark.kept_ids(drafter))
    assert logits.shape == (cfg.block_size - 1, 128) and torch.equal(tokens, logits.argmax(-1))
    block = torch.cat([torch.tensor([bonus]), drafter.to_target_ids(tokens)])[None, None]
    u, forced_conf = dspark.teacher_forced(drafter, hidden[None, None], block)
    forced = dspark.markov_logits(drafter.lm_head, drafter.markov_head, hidden[None, None, 1:], u)
    torch.testing.assert_close(logits, forced[0, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conf, forced_conf[0, 0], rtol=1e-5, atol=1e-5)
    # fed back as draft indices instead (the bug this guards), W1 would read other rows
    wrong = torch.cat([torch.tensor([bonus]), tokens])[None, None]
    assert not torch.allclose(dspark.teacher_forced(drafter, hidden[None, None], wrong)[0], u)


@pytest.mark.parametrize("method, budget", [("dflash", 0), ("ddtree", 8), ("ddtree", 48)])
def test_draft_vocabulary_decoding_is_lossless_and_stays_in_it(tiny_target, dspark_draft_vocab, monkeypatch,
                                                                method, budget):
    drafter = biased(load_drafter(dspark_draft_vocab[1] / "final")[0].eval())
    assert_lossless_in_draft_vocab(tiny_target, drafter, method, budget, QUESTIONS[:3], monkeypatch)


@torch.no_grad()
def test_validation_trees_are_the_decoding_trees(tiny_target, dspark_draft_vocab):
    """validate.cpu_tree_scorer (a CPU copy of the Markov head, on validation's [.., V] logits, -inf outside
    the draft vocabulary) builds the tree decoding builds in draft space, with and without a vocabulary."""
    from dflash_train.decoding.ddtree import build_tree
    from dflash_train.training.validate import cpu_tree_scorer

    drafters = [random_dspark(tiny_target, "rnn", seed=8),
                biased(load_drafter(dspark_draft_vocab[1] / "final")[0].eval())]
    for drafter in drafters:
        torch.manual_seed(2)
        hidden = torch.randn(drafter.config.block_size, drafter.config.hidden_size)
        bonus = 21
        full = drafter.full_logits(hidden[1:], tiny_target.lm_head)  # validation's [B-1, V]
        draft = drafter.logits_head(tiny_target.lm_head)(hidden[1:])  # decoding's [B-1, N]
        validation = build_tree(full, 24, cpu_tree_scorer(drafter)(hidden, bonus))
        decoding = build_tree(draft, 24, drafter.variant.scorer(drafter, hidden, bonus))
        assert validation.tokens.tolist() == decoding.tokens.tolist()
        assert validation.parents.tolist() == decoding.parents.tolist()
        torch.testing.assert_close(validation.log_probs, decoding.log_probs, rtol=1e-4, atol=1e-4)
        assert build_tree(full, 24).tokens.tolist() != validation.tokens.tolist()  # the bias changed it


@torch.no_grad()
def test_draft_vocabulary_export_loads_in_speculators(tiny_target, dspark_draft_vocab, tmp_path, monkeypatch):
    """The Speculators export (lm_head / d2t / t2d, W2 [N, r]) loads in speculators' DSparkDraftModel with
    our Markov-corrected draft-space logits and confidence."""
    from speculators import SpeculatorModel
    from speculators.models.dspark import DSparkSpeculatorConfig
    from dflash_train.cli.export import main as export_main

    final = dspark_draft_vocab[1] / "final"
    export_main(["--format", "speculators", "--checkpoint", str(final), "--output", str(tmp_path / "spec")])
    config = DSparkSpeculatorConfig.from_pretrained(str(tmp_path / "spec"))
    config.transformer_layer_config._attn_implementation = "sdpa"
    spec = SpeculatorModel.from_pretrained(str(tmp_path / "spec"), config=config,
                                           verifier=str(TINY_TARGET)).eval()
    ours = load_drafter(final)[0].eval()
    assert spec.draft_vocab_size == 128 and torch.equal(spec.t2d, ours.t2d)
    ids = torch.randint(0, 1000, (1, 28))
    anchors = torch.tensor([4, 11, 18])
    spec_logits, spec_conf = speculators_block_logits(spec, tiny_target, ids, anchors, monkeypatch)
    logits, conf = our_block_logits(ours, tiny_target, ids, anchors)
    assert logits.shape[-1] == 128
    torch.testing.assert_close(logits, spec_logits[:, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conf, spec_conf[:, 1:], rtol=1e-5, atol=1e-5)
