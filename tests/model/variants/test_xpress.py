"""XPress drafters: the refiner and the loss against speculators' own XPressDraftModel, the Jacobi chain
against the sequential greedy chain, the exact path-conditioned tree, lossless decoding at temperature 0
and 1, speculators-written checkpoints read back, a short training run, and bad inputs."""

import json
import math

import pytest
import torch

from conftest import TINY_TARGET, chat_prompt, error_line, run_main
from helpers.draft_vocab_run import assert_lossless_in_draft_vocab
from helpers.marginals import next_two_marginals, random_target_and_drafter
from dflash_train.checkpoint.folders import load_drafter
from dflash_train.checkpoint.formats import speculators_config
from dflash_train.core.errors import UserError
from dflash_train.data.dataset import stop_token_ids
from dflash_train.decoding.ddtree import build_tree
from dflash_train.decoding.decode import decode
from dflash_train.model.drafter import DFlashDrafter
from dflash_train.model.variants import xpress
from dflash_train.training.build import drafter_config_for
from dflash_train.training.config import ModelConfig, RunConfig
from dflash_train.training.objective import training_loss
from helpers import Captured
from helpers.xpress import B, our_blocks, speculators_forward

RANK = 8
QUESTIONS = ["What is 23 + 59?", "Tell me about Oakgate.", "Please sort 12, 5, 33, 8.",
             "How many seconds are in 7 minutes?", "Hello!"]
SPEC_LOSS = '{"ce": 0.1, "tv": 0.9}'  # speculators' XPress default loss


def xpress_config(target, rank=RANK, block_size=B, passes=6, num_layers=2):
    return drafter_config_for(target, ModelConfig(num_layers=num_layers, block_size=block_size,
                                                  variant="xpress", xpress_rank=rank,
                                                  num_jacobi_passes=passes))


def random_xpress(target, seed=0, **kw) -> DFlashDrafter:
    """Random, non-trivial weights everywhere (norms and the mixer included)."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(xpress_config(target, **kw)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    return drafter


def speculators_model(drafter):
    """speculators' XPressDraftModel with our config and weights (embeddings / LM head from the verifier)."""
    from speculators.models.xpress import XPressDraftModel

    config = speculators_config(drafter.config, str(TINY_TARGET), ["Qwen3ForCausalLM"], {}, None)
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention is for training on GPU
    spec = XPressDraftModel(config)
    spec.load_verifier_weights()
    missing, unexpected = spec.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and set(missing) == {"embed_tokens.weight", "lm_head.weight",
                                               "verifier_lm_head.weight", "verifier_norm.weight"}
    return spec.eval()


def data(seed=1, T=30):
    torch.manual_seed(seed)
    return torch.randint(0, 1000, (1, T)), torch.tensor([2, 9, 15, 23])


def test_parameter_names_are_speculators_xpress_names(tiny_target):
    from speculators.models.xpress import XPressDraftModel

    drafter = DFlashDrafter(xpress_config(tiny_target))
    config = speculators_config(drafter.config, str(TINY_TARGET), [], {}, None)
    config.transformer_layer_config._attn_implementation = "sdpa"
    spec = XPressDraftModel(config)
    theirs = {k: v.shape for k, v in spec.state_dict().items() if not k.startswith(("embed_tokens", "lm_head",
                                                                                  "verifier_"))}
    ours = {k: v.shape for k, v in drafter.state_dict().items()}
    assert ours == theirs and "refiner_head.causal_tril" not in ours
    assert ours["refiner_head.readout.weight"] == (tiny_target.model.config.vocab_size, RANK)
    assert bool((drafter.refiner_head.mix_l == 0).all())  # speculators' init: the mixer starts at 0


@torch.no_grad()
def test_teacher_forced_logits_equal_speculators_xpress(tiny_target, monkeypatch):
    """Independent reference: speculators' XPressDraftModel.forward on the same weights and anchors
    gives our teacher-forced refined logits and the backbone's, every drafted slot (fp32, 1e-5)."""
    drafter = random_xpress(tiny_target)
    spec = speculators_model(drafter)
    ids, anchors = data()
    tf, rounds, base = speculators_forward(spec, tiny_target, ids, anchors, monkeypatch)
    o = our_blocks(drafter, tiny_target, ids, anchors)
    ours_base = tiny_target.lm_head(o.draft_hidden[0])
    ours_tf = ours_base + drafter.refiner_head.readout(o.heads["y"][0])
    torch.testing.assert_close(ours_base, base[:, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_tf, tf[:, 1:], rtol=1e-5, atol=1e-5)
    assert len(rounds) == 3  # speculators' default consistency passes


def test_loss_equals_speculators_xpress(tiny_target, monkeypatch):
    """Our loss (teacher-forced pass + 0.3 x the mean of 3 consistency rounds + 0.6 x the base anchor,
    terms 0.1 ce + 0.9 tv, exp slot weights) equals speculators' own loss value with its eager terms, given
    its divisor (the count of valid drafted slots; ours defaults to the sum of the slot weights)."""
    from speculators.losses import resolve_loss_config

    drafter = random_xpress(tiny_target, seed=2)
    spec = speculators_model(drafter)
    ids, anchors = data(seed=3)
    with torch.no_grad():
        theirs = speculators_forward(spec, tiny_target, ids, anchors, monkeypatch, capture=False,
                                     loss_config=resolve_loss_config(SPEC_LOSS, "eager"))
    cfg = RunConfig(model={"variant": "xpress", "xpress_rank": RANK, "block_size": B},
                    loss={"terms": {"ce": 0.1, "tv": 0.9}, "gamma": 4.0, "chunk_slots": 10})
    o = our_blocks(drafter, tiny_target, ids, anchors)
    loss, m = training_loss(o, tiny_target, drafter, cfg, normalizer=o.valid.sum().float())
    torch.testing.assert_close(loss.detach(), theirs.float(), rtol=1e-5, atol=1e-5)
    assert m["terms"].shape == (4,)  # ce, tv, consistency, base_anchor
    loss.backward()  # the rounds and the anchor train the refiner and the backbone
    assert drafter.refiner_head.mix_l.grad.abs().sum() > 0 and drafter.fc.weight.grad.abs().sum() > 0


def sequential_greedy(drafter, hidden, base_logits, bonus, before):
    """The chain one slot at a time: slot k's refined argmax given the argmax of slots < k."""
    head, prev = drafter.refiner_head, torch.tensor([before, bonus] + [0] * (B - 2))
    tokens = []
    for k in range(1, B):
        tok = int((base_logits + head(prev[None], hidden[None])[0, 1:]).argmax(-1)[k - 1])
        tokens.append(tok)
        if k + 1 < B:
            prev[k + 1] = tok
    return tokens


@torch.no_grad()
def test_jacobi_chain_is_the_sequential_greedy_chain(tiny_target):
    """K >= B-1 passes give the sequential greedy chain; with K passes slots 1..K are its; a pass that
    changes nothing ends the loop (the passes run are reported, at most min(K, B-1))."""
    drafter = random_xpress(tiny_target, seed=4)
    with torch.no_grad():
        drafter.refiner_head.readout.weight.mul_(10)  # a bias that moves the argmax
    torch.manual_seed(0)
    stopped_early = converged_late = 0
    for trial in range(12):
        hidden = torch.randn(B, drafter.config.hidden_size)
        base = tiny_target.lm_head(hidden[1:])
        bonus, before = trial * 7, trial * 13 + 1
        want = sequential_greedy(drafter, hidden, base, bonus, before)
        tokens, passes = xpress.jacobi_chain(drafter, hidden, base, bonus, before, passes=B - 1)
        assert tokens.tolist() == want and 1 <= passes <= B - 1
        full = xpress.jacobi_chain(drafter, hidden, base, bonus, before, passes=100)
        assert full[0].tolist() == want and full[1] == passes
        for K in range(1, B - 1):
            assert (xpress.jacobi_chain(drafter, hidden, base, bonus, before,
                                        passes=K)[0].tolist()[:K] == want[:K])
        stopped_early += passes < B - 1
        converged_late += passes > 1
    assert stopped_early and converged_late  # both ends of the loop were exercised


@torch.no_grad()
def test_tree_scores_are_the_exact_path_conditioned_distribution(tiny_target):
    """With candidates >= V, a node's children carry log softmax(base + bias(prev = its path)) of the next
    slot, and the tree's rank-0 spine is the sequential greedy chain."""
    drafter = random_xpress(tiny_target, seed=5)
    head, V = drafter.refiner_head, tiny_target.model.config.vocab_size
    torch.manual_seed(1)
    hidden = torch.randn(B, drafter.config.hidden_size)
    base = tiny_target.lm_head(hidden[1:])
    bonus, before = 17, 3
    scorer = xpress.XPressScorer(head, hidden, bonus, before, candidates=V)
    expand, root, carry = scorer.expander(base, 4)
    path = [before, bonus]
    token, depth = root, 0
    for depth in range(B - 1):
        logp, ids, child_carry = expand(token, carry, depth)
        prev = torch.tensor(path + [0] * (B - len(path)))
        exact = torch.log_softmax(base + head(prev[None], hidden[None])[0, 1:], -1)[depth]
        torch.testing.assert_close(torch.tensor(logp), exact[ids], rtol=1e-4, atol=1e-4)
        assert ids == exact.topk(4).indices.tolist()
        token, carry = ids[1], child_carry  # go down a child other than the argmax
        path.append(token)
    peaked = 20 * base  # so that a 40-node tree holds the whole spine
    tree = build_tree(peaked, 40, xpress.XPressScorer(head, hidden, bonus, before, candidates=V))
    spine, node = [], 0
    while tree.best_child[node] in tree.children[node]:  # down the argmax children
        spine.append(tree.best_child[node])
        node = tree.children[node][spine[-1]]
    assert spine == sequential_greedy(drafter, hidden, peaked, bonus, before)


@pytest.fixture(scope="module")
def trained_backbone(trained_drafter_dir):
    return load_drafter(trained_drafter_dir)[0].eval()


def xpress_on_backbone(backbone, target, seed=0, passes=6):
    """An XPress drafter whose backbone is a trained DFlash drafter (so drafts are accepted) and whose
    refiner is random with a bias of about a logit and a non-zero mixer (so it changes the drafts)."""
    cfg = backbone.config
    torch.manual_seed(seed)
    drafter = DFlashDrafter(xpress_config(target, block_size=cfg.block_size, passes=passes,
                                          num_layers=cfg.num_hidden_layers)).eval()
    missing, unexpected = drafter.load_state_dict(backbone.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("refiner_head.") for k in missing)
    with torch.no_grad():
        drafter.refiner_head.mix_l.normal_(0, 0.5)
        drafter.refiner_head.readout.weight.normal_(0, 1.0)
    return drafter


def test_xpress_output_is_the_greedy_output(tiny_target, trained_backbone):
    """Temperature 0: the Jacobi chain and the path-conditioned DDTree emit the target's greedy output,
    drafts are accepted, and the chain reports its passes per round."""
    drafter = xpress_on_backbone(trained_backbone, tiny_target)
    stops = stop_token_ids(tiny_target.model, tiny_target.tokenizer)
    prompts = [chat_prompt(tiny_target.tokenizer, q) for q in QUESTIONS]
    ars = [decode(tiny_target, None, ids, "ar", max_new_tokens=48, stop_ids=stops).tokens for ids in prompts]
    B_ = drafter.config.block_size
    for method, budget, scores in [("dflash", 0, "conditional"), ("ddtree", 4, "conditional"),
                                   ("ddtree", 32, "conditional"), ("ddtree", 16, "marginal")]:
        emitted = rounds = 0
        for ids, ar in zip(prompts, ars):
            r = decode(tiny_target, drafter, ids, method, budget, max_new_tokens=48, stop_ids=stops,
                       tree_scores=scores)
            assert r.tokens == ar, (method, budget, scores)
            emitted, rounds = emitted + sum(r.accept_lengths), rounds + len(r.accept_lengths)
            if method == "dflash":
                assert len(r.jacobi_passes) == len(r.accept_lengths)
                assert all(1 <= p <= min(6, B_ - 1) for p in r.jacobi_passes)
            else:
                assert r.jacobi_passes is None
        assert emitted / rounds > 1.3, (method, budget, scores)


def tiny_random_target_and_xpress(V=12):
    target, drafter = random_target_and_drafter(V, variant="xpress", xpress_rank=4, xpress_mlp_ratio=2,
                                                num_jacobi_passes=3)
    with torch.no_grad():
        drafter.refiner_head.mix_l.normal_(0, 0.5)
        drafter.refiner_head.readout.weight.normal_(0, 2.0)
    return target, drafter


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_sampling_follows_the_target_distribution(method):
    """Temperature 1: the 2nd and 3rd tokens (decided by the accept walk over XPress's chain or tree)
    follow the target's own distribution (exact marginals by enumeration, chi-square at p > 1e-3)."""
    target, drafter = tiny_random_target_and_xpress()
    V, model, prompt = 12, target.model, torch.tensor([[3, 5, 7]])
    p2, p3 = next_two_marginals(model, prompt, V)  # exact, by enumeration
    gen = torch.Generator().manual_seed(0)
    N = 800
    c2, c3 = torch.zeros(V), torch.zeros(V)
    accepted = 0
    for _ in range(N):
        r = decode(target, drafter, prompt, method, budget=16, temperature=1.0, max_new_tokens=3,
                   generator=gen)
        c2[r.tokens[1]] += 1
        c3[r.tokens[2]] += 1
        accepted += r.accept_lengths[0] - 1
    assert accepted > (N if method == "ddtree" else N // 20)  # the walk really accepted drafted tokens
    for counts, p in [(c2, p2), (c3, p3)]:
        expected = N * p
        keep = expected >= 5
        obs = torch.cat([counts.double()[keep], counts.double()[~keep].sum()[None]])
        exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        chi2 = float(((obs - exp) ** 2 / exp).sum())
        dof = len(obs) - 1
        limit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
        assert chi2 < limit, (chi2, limit, obs.tolist(), exp.tolist())


# --- checkpoints written by speculators -----------------------------------------------------------

def speculators_written_xpress(folder, target, sample_from_anchor=False, draft_vocab_size=None):
    """An XPress checkpoint made by speculators' own classes (as its trainer saves it)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.xpress import XPressDraftModel, XPressSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    ours = xpress_config(target)  # only for the Qwen3 layer shape
    layer = ours.qwen3_config()
    layer._attn_implementation = "sdpa"
    config = XPressSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab_size or ours.vocab_size, block_size=B,
        target_hidden_size=ours.hidden_size,
        aux_hidden_state_layer_ids=[k + 1 for k in ours.target_layer_ids], mask_token_id=ours.mask_token_id,
        sample_from_anchor=sample_from_anchor, xpress_rank=12, xpress_mlp_ratio=3, num_jacobi_passes=4,
        speculators_config=SpeculatorsConfig(
            algorithm="xpress", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=B - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(TINY_TARGET), architectures=["Qwen3ForCausalLM"])))
    torch.manual_seed(5)
    model = XPressDraftModel(config)
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


@pytest.mark.parametrize("draft_vocab_size", [None, 500])
@torch.no_grad()
def test_speculators_written_checkpoint_is_read(tiny_target, tmp_path, monkeypatch, draft_vocab_size):
    """A speculators-written XPress folder (full vocabulary, or a draft vocabulary of 500 random tokens:
    readout [N, r] over it, lm_head / d2t / t2d) gives speculators' teacher-forced refined logits."""
    spec = speculators_written_xpress(tmp_path / "spec", tiny_target, draft_vocab_size=draft_vocab_size)
    drafter, meta = load_drafter(tmp_path / "spec")
    drafter.eval()
    c = drafter.config
    assert meta["format"] == "speculators" and meta["target"]["name_or_path"] == str(TINY_TARGET)
    assert (c.variant, c.xpress_rank, c.xpress_mlp_ratio, c.num_jacobi_passes) == ("xpress", 12, 3, 4)
    assert c.draft_vocab_size == draft_vocab_size
    if draft_vocab_size:
        assert torch.equal(drafter.t2d, spec.t2d) and drafter.refiner_head.readout.weight.shape == (500, 12)
    spec.eval()
    ids, anchors = data(seed=6, T=26)
    anchors = torch.tensor([1, 8, 19])
    tf, _, base = speculators_forward(spec, tiny_target, ids, anchors, monkeypatch)
    o = our_blocks(drafter, tiny_target, ids, anchors)
    ours = (drafter.logits_head(tiny_target.lm_head)(o.draft_hidden[0])
            + drafter.refiner_head.readout(o.heads["y"][0]))
    torch.testing.assert_close(ours, tf[:, 1:], rtol=1e-5, atol=1e-5)


def test_speculators_sample_from_anchor_is_refused(tiny_target, tmp_path):
    speculators_written_xpress(tmp_path / "spec", tiny_target, sample_from_anchor=True)
    with pytest.raises(UserError, match="sample_from_anchor true") as e:
        load_drafter(tmp_path / "spec")
    assert "\n" not in str(e.value)


# --- training --------------------------------------------------------------------------------------

def test_short_training_run_lowers_the_loss_and_grows_from_dflash(trained_drafter_dir, tmp_path, small_data):
    """model.init_from a DFlash drafter in an XPress recipe: its backbone, a fresh refiner; a few steps at a
    real learning rate lower the loss, and the run reports the consistency and base-anchor terms."""
    from dflash_train.cli.train import main as train_main

    out = tmp_path / "ft"
    train_main([f"output_dir={out}", f"model.init_from={trained_drafter_dir}", "max_steps=8", "train.lr=3e-3",
                f"data.train={small_data / 'train.jsonl'}", f"data.val={small_data / 'val.jsonl'}",
                "train.batch_size=8", "model.variant=xpress", f"model.xpress_rank={RANK}",
                "eval.max_samples=4", "eval.every=0", "log_every=1", "checkpoint_every=0",
                "loss.terms={ce: 0.1, tv: 0.9}"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and "step" in r]
    assert len(losses) >= 8 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    assert any("consistency" in json.dumps(r) and "base_anchor" in json.dumps(r) for r in records)
    start, end = load_drafter(trained_drafter_dir)[0], load_drafter(out / "final")[0]
    assert end.config.variant == "xpress" and end.refiner_head is not None
    assert set(start.state_dict()) < set(end.state_dict())


def test_xpress_refuses_engines_that_cannot_gather_its_head(monkeypatch):
    from dflash_train.training.setup import check_heads_engine

    monkeypatch.delenv("FSDP_RESHARD_AFTER_FORWARD", raising=False)
    with pytest.raises(UserError, match="fsdp_dspark.yaml"):
        check_heads_engine("xpress", "fsdp", accelerator=None)
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    check_heads_engine("xpress", "fsdp", accelerator=None)


@pytest.mark.parametrize("override, words", [
    ("model.xpress_rank=0", "xpress_rank"),
    ("model.xpress_rank=129", "xpress_rank 129"),  # the tiny target's hidden size is 128
    ("model.num_jacobi_passes=0", "num_jacobi_passes"),
    ("loss.consistency_weight=.inf", "consistency_weight"),
    ("loss.base_anchor_weight=.nan", "base_anchor_weight"),
    ("tree_distill.weight=1", "tree_distill"),
])
def test_bad_xpress_recipes_are_one_line_exit_2(tmp_path, small_data, override, words):
    from dflash_train.cli.train import main as train_main

    out = tmp_path / "run"
    rc, _, err = run_main(train_main, [f"output_dir={out}", "model.variant=xpress",
                                       f"model.xpress_rank={RANK}", "max_steps=1",
                                       f"data.train={small_data / 'train.jsonl'}",
                                       f"data.val={small_data / 'val.jsonl'}", override])
    assert rc == 2 and words in error_line(err), err[-2000:]
    assert not out.exists()  # nothing written


def test_eval_and_training_import_speculators_xpress(tiny_target, tmp_path, small_data):
    """dflash-eval --drafter and model.init_from read a checkpoint written by speculators; the eval report
    gives the chain's Jacobi passes and the XPress fields."""
    from dflash_train.cli.eval import main as eval_main
    from dflash_train.cli.train import main as train_main

    speculators_written_xpress(tmp_path / "spec", tiny_target)
    eval_main(["--drafter", str(tmp_path / "spec"), "--limit", "2", "--budgets", "0,8", "--max-new-tokens",
               "16", "--output", str(tmp_path / "eval")])
    rep = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert rep["variant"] == "xpress" and (rep["xpress_rank"], rep["num_jacobi_passes"]) == (12, 4)
    assert all(r["lossless"] for r in rep["results"])
    chain = next(r for r in rep["results"] if r["method"] == "dflash")
    assert 1 <= chain["jacobi_passes"]["mean"] <= chain["jacobi_passes"]["max"] <= 4
    train_main([f"output_dir={tmp_path / 'ft'}", f"model.init_from={tmp_path / 'spec'}", "max_steps=2",
                "train.lr=1e-12", f"data.train={small_data / 'train.jsonl'}",
                f"data.val={small_data / 'val.jsonl'}", "train.batch_size=4", f"model.block_size={B}",
                "model.variant=xpress", "model.xpress_rank=12", "model.xpress_mlp_ratio=3",
                "model.num_jacobi_passes=4", "eval.max_samples=4"])
    start, end = load_drafter(tmp_path / "spec")[0], load_drafter(tmp_path / "ft" / "final")[0]
    for k, v in start.state_dict().items():
        torch.testing.assert_close(end.state_dict()[k], v, rtol=0, atol=1e-8)


# --- a draft vocabulary ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def xpress_draft_vocab(tmp_path_factory, small_data):
    """An XPress drafter grown (model.init_from) from a DFlash drafter with a 128-token draft vocabulary,
    trained a few steps: the vocabulary kept, the readout over it."""
    from helpers.draft_vocab_run import DRAFT_VOCAB, draft_vocab_run
    from dflash_train.cli.train import main as train_main

    dflash, _ = draft_vocab_run(tmp_path_factory, small_data)
    out = tmp_path_factory.mktemp("xpress-vocab") / "run"
    train_main([f"output_dir={out}", f"model.init_from={dflash / 'final'}", "model.variant=xpress",
                f"model.xpress_rank={RANK}", f"model.draft_vocab_size={DRAFT_VOCAB}", "model.num_layers=1",
                "max_steps=6", "train.lr=3e-3", "train.batch_size=8", "data.num_anchors=16", "log_every=1",
                "eval.every=0", "eval.max_samples=4", "checkpoint_every=0", "loss.terms={ce: 0.1, tv: 0.9}",
                f"data.train={small_data / 'train.jsonl'}", f"data.val={small_data / 'val.jsonl'}"])
    return dflash / "final", out


def test_draft_vocabulary_run_keeps_the_vocabulary_and_lowers_the_loss(xpress_draft_vocab):
    dflash_dir, out = xpress_draft_vocab
    start, end = load_drafter(dflash_dir)[0], load_drafter(out / "final")[0]
    assert end.config.draft_vocab_size == 128 and torch.equal(end.t2d, start.t2d)
    assert end.refiner_head.readout.weight.shape == (128, RANK)
    assert end.refiner_head.token_embed.weight.shape[0] == end.config.vocab_size
    losses = [r["loss"] for r in map(json.loads,
                                     (out / "metrics.jsonl").read_text().splitlines()) if "step" in r]
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("method, budget", [("dflash", 0), ("ddtree", 8), ("ddtree", 48)])
def test_draft_vocabulary_decoding_is_lossless_and_stays_in_it(tiny_target, xpress_draft_vocab, monkeypatch,
                                                                method, budget):
    drafter = load_drafter(xpress_draft_vocab[1] / "final")[0].eval()
    with torch.no_grad():  # a refiner bias of a few logits: it changes the drafts
        drafter.refiner_head.readout.weight.normal_(0, 1.0)
        drafter.refiner_head.mix_l.normal_(0, 0.5)
    assert_lossless_in_draft_vocab(tiny_target, drafter, method, budget, QUESTIONS[:3], monkeypatch)


@torch.no_grad()
def test_draft_vocabulary_export_loads_in_speculators(tiny_target, xpress_draft_vocab, tmp_path, monkeypatch):
    from speculators import SpeculatorModel
    from speculators.models.xpress import XPressSpeculatorConfig
    from dflash_train.cli.export import main as export_main

    final = xpress_draft_vocab[1] / "final"
    export_main(["--format", "speculators", "--checkpoint", str(final), "--output", str(tmp_path / "spec")])
    config = XPressSpeculatorConfig.from_pretrained(str(tmp_path / "spec"))
    config.transformer_layer_config._attn_implementation = "sdpa"
    spec = SpeculatorModel.from_pretrained(str(tmp_path / "spec"), config=config,
                                           verifier=str(TINY_TARGET)).eval()
    ours = load_drafter(final)[0].eval()
    assert spec.draft_vocab_size == 128 and torch.equal(spec.t2d, ours.t2d)
    Bs = ours.config.block_size
    spec.refiner_head.causal_tril.copy_(torch.tril(torch.ones(Bs, Bs)))  # see test_xpress_export.py
    ids, anchors = data(seed=7)
    anchors = torch.tensor([2, 9, 15])
    import speculators.models.dflash.core as dflash_core
    import speculators.models.xpress.core as xpress_core
    seen = {}

    def grab(logits_tf, *a, **k):
        seen["tf"] = logits_tf
        raise Captured
    monkeypatch.setattr(dflash_core, "select_anchors",
                        lambda lm, n, bs: (anchors, torch.ones(n, dtype=torch.bool)))
    monkeypatch.setattr(xpress_core, "compute_metrics", grab)
    out = tiny_target.model.get_decoder()(input_ids=ids, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i] for i in spec.config.aux_hidden_state_layer_ids], -1)
    with pytest.raises(Captured):
        spec(hidden_states=taps, input_ids=ids, loss_mask=torch.ones_like(ids),
             verifier_last_hidden_states=torch.zeros(1, ids.shape[1], ours.config.hidden_size),
             document_ids=torch.zeros_like(ids), max_anchors=3)
    o = our_blocks(ours, tiny_target, ids, anchors)
    mine = ours.lm_head(o.draft_hidden[0]) + ours.refiner_head.readout(o.heads["y"][0])
    torch.testing.assert_close(mine, seen["tf"].view(3, Bs, -1)[:, 1:], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_validation_trees_are_the_decoding_trees(tiny_target, xpress_draft_vocab):
    """validate.cpu_tree_scorer gives XPress's path-conditioned tree (over a CPU copy of the refiner, on the
    [.., V] logits validation builds, -inf outside a draft vocabulary): the same tree decoding builds."""
    from dflash_train.training.validate import cpu_tree_scorer

    drafters = [random_xpress(tiny_target, seed=8), load_drafter(xpress_draft_vocab[1] / "final")[0].eval()]
    for drafter in drafters:
        with torch.no_grad():
            drafter.refiner_head.readout.weight.normal_(0, 1.0)
        torch.manual_seed(2)
        hidden = torch.randn(drafter.config.block_size, drafter.config.hidden_size)
        bonus, before = 21, 5
        full = drafter.full_logits(hidden[1:], tiny_target.lm_head)  # validation's [B-1, V]
        draft = drafter.logits_head(tiny_target.lm_head)(hidden[1:])  # decoding's [B-1, N]
        validation = build_tree(full, 24, cpu_tree_scorer(drafter)(hidden, bonus, before))
        decoding = build_tree(draft, 24, drafter.variant.scorer(drafter, hidden, bonus, before))
        assert validation.tokens.tolist() == decoding.tokens.tolist()
        assert validation.parents.tolist() == decoding.parents.tolist()
        torch.testing.assert_close(validation.log_probs, decoding.log_probs, rtol=1e-4, atol=1e-4)
        marginal = build_tree(full, 24)
        assert marginal.tokens.tolist() != validation.tokens.tolist()  # the refiner changed the tree


@pytest.mark.parametrize("method, budget", [("dflash", 0), ("ddtree", 16)])
def test_sampling_on_the_tiny_target_follows_its_distribution(tiny_target, trained_backbone, method, budget):
    """Temperature 1 on the tiny target: the 2nd token (the first the accept walk over XPress's chain or
    tree decides) follows the target's own marginal, exact by one batched forward over every 1st token
    (chi-square at p > 1e-3, rare tokens pooled), and drafted tokens were accepted."""
    drafter = xpress_on_backbone(trained_backbone, tiny_target)
    # not a chat prompt: there the tiny target's 2nd token is ~certain (p > 0.99), a one-cell test; after
    # "1 2 3" seven tokens are each expected 5+ times in 600 draws, and drafted tokens are accepted
    prompt = tiny_target.tokenizer("1 2 3", return_tensors="pt")["input_ids"]
    model, V = tiny_target.model, tiny_target.model.config.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(model(prompt).logits[0, -1].double(), -1)
        seqs = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1)
        p2 = (p1[:, None] * torch.softmax(model(seqs).logits[:, -1].double(), -1)).sum(0)
    gen = torch.Generator().manual_seed(0)
    N, counts, accepted = 600, torch.zeros(V), 0
    for _ in range(N):
        r = decode(tiny_target, drafter, prompt, method, budget, temperature=1.0, max_new_tokens=3,
                   generator=gen)
        counts[r.tokens[1]] += 1
        accepted += r.accept_lengths[0] - 1
    assert accepted > N // 20, accepted  # the walk followed drafted tokens
    expected = N * p2
    keep = expected >= 5
    obs = torch.cat([counts.double()[keep], counts.double()[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    chi2, dof = float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
    assert dof >= 5  # a test of the distribution, not of one certain token
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit, dof)


@pytest.mark.parametrize("key, value", [("xpress_rank", 0), ("xpress_rank", 1000), ("num_jacobi_passes", 0),
                                        ("xpress_mlp_ratio", -1)])
def test_bad_xpress_checkpoint_fields_are_one_line(tiny_target, tmp_path, key, value):
    """A config.json (speculators' or ours) with a rank <= 0 or above the width, or no Jacobi pass: one
    line naming the field, the folder left as it was."""
    from dflash_train.checkpoint.folders import save_drafter

    speculators_written_xpress(tmp_path / "spec", tiny_target)
    save_drafter(tmp_path / "ours", random_xpress(tiny_target), tiny_target)
    for folder, edit in [(tmp_path / "spec", lambda c: c.update({key: value})),
                         (tmp_path / "ours", lambda c: c["drafter"].update({key: value}))]:
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))
        before = sorted(p.name for p in folder.iterdir())
        with pytest.raises(UserError) as e:
            load_drafter(folder)
        assert "\n" not in str(e.value) and f"{key}" in str(e.value).replace(str(folder), ""), str(e.value)
        assert sorted(p.name for p in folder.iterdir()) == before
