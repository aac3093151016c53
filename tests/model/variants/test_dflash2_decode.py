"""DFlash2 decoding: the chain is vLLM's greedy selector walk, and every method is lossless at
temperature 0 (the target's own greedy output, token for token)."""

import json

import pytest
import torch

from conftest import chat_prompt
from dflash_train.checkpoint.folders import load_drafter
from dflash_train.data.dataset import stop_token_ids
from dflash_train.decoding.decode import decode
from dflash_train.model.variants import dflash2

QUESTIONS = ["What is 23 + 59?", "Tell me about Oakgate.", "Please sort 12, 5, 33, 8.", "Hello!"]


@pytest.fixture(scope="module")
def dflash2_run(trained_drafter_dir, small_data, tmp_path_factory):
    """The trained DFlash drafter grown into DFlash2 (identity convolutions, fresh selector) and
    trained a few steps with the selector's objective."""
    from dflash_train.cli.train import main as train_main

    out = tmp_path_factory.mktemp("dflash2") / "run"
    train_main([f"output_dir={out}", f"model.init_from={trained_drafter_dir}", "model.variant=dflash2",
                "model.selector_rank=32", "max_steps=8", "train.lr=1e-3", "train.batch_size=8",
                f"data.train={small_data / 'train.jsonl'}", f"data.val={small_data / 'val.jsonl'}",
                "eval.max_samples=8", "eval.ddtree_budgets=[4, 16]", "checkpoint_every=0"])
    return out


@pytest.fixture(scope="module")
def drafter(dflash2_run):
    return load_drafter(dflash2_run / "final")[0].eval()


def test_training_reports_the_selector(dflash2_run):
    records = [json.loads(line) for line in (dflash2_run / "metrics.jsonl").read_text().splitlines()]
    for r in records:  # loss = ce + selector_weight (1) x the selector's CE, each with the same divisor
        assert set(r["terms"]) == {"ce", "selector"}
        assert r["loss"] == pytest.approx(r["terms"]["ce"] + r["terms"]["selector"], abs=1e-5)
    assert set(records[-1]["val_terms"]) == {"ce", "selector"}
    summary = json.loads((dflash2_run / "summary.json").read_text())["eval"]
    assert summary["eal"] > 1.3  # the grown drafter drafts well from the start
    # validation's trees are the selector's: the spine diagnostics are there, off-spine nodes included
    assert set(summary["ddtree_tau"]) == {"4", "16"} and summary["off_spine_nodes"] > 0
    assert 0 <= summary["off_spine_acc"] <= 1 and 0 <= summary["on_spine_acc"] <= 1


@torch.no_grad()
def test_chain_is_the_greedy_selector_walk(tiny_target):
    """Independent reference: speculators' CandidateSelector.select with the same weights, walked slot
    by slot with the token picked at the previous slot as the predecessor."""
    from speculators.models.dflash2.model_definitions import CandidateSelector

    V, H, L = tiny_target.model.config.vocab_size, tiny_target.model.config.hidden_size, 7
    torch.manual_seed(0)
    ours = dflash2.CandidateSelector(V, H, rank=32, top_k=8)
    for p in ours.parameters():
        p.normal_(0, 0.3)  # large enough to re-rank the unary candidates
    ref = CandidateSelector(vocab_size=V, hidden_size=H, rank=32, top_k=8)
    ref.load_state_dict(ours.state_dict())
    differs = 0
    for _ in range(20):
        hidden = torch.randn(L, H)
        unary = tiny_target.lm_head(hidden)
        bonus = int(torch.randint(0, V, ()))
        walk, prev = [], torch.tensor(bonus)
        for t in range(L):
            ids, scores = ref.select(unary[t], hidden[t], prev)
            prev = ids[scores.argmax()]
            walk.append(int(prev))
        chain = dflash2.selector_chain(ours, hidden, unary, bonus)
        assert chain.tolist() == walk
        differs += chain.tolist() != unary.argmax(-1).tolist()
    assert differs > 0  # the selector really re-ranked (the chain is not the unary argmax)


@pytest.fixture(scope="module")
def greedy(tiny_target):
    stops = stop_token_ids(tiny_target.model, tiny_target.tokenizer)
    prompts = [chat_prompt(tiny_target.tokenizer, q) for q in QUESTIONS]
    return stops, [(ids, decode(tiny_target, None, ids, "ar", max_new_tokens=48, stop_ids=stops).tokens)
                   for ids in prompts]


@pytest.mark.parametrize("method, budget, scores", [("dflash", 0, "conditional")] + [
    ("ddtree", b, s) for s in ("conditional", "marginal") for b in (1, 4, 16, 64, 256)])
def test_lossless_at_temperature_0(tiny_target, drafter, greedy, method, budget, scores):
    """The selector chain, the selector tree and the tree from the unary marginals, at every budget."""
    stops, references = greedy
    emitted = rounds = 0
    for ids, reference in references:
        r = decode(tiny_target, drafter, ids, method, budget, max_new_tokens=48, stop_ids=stops,
                   tree_scores=scores)
        assert r.tokens == reference
        emitted, rounds = emitted + sum(r.accept_lengths), rounds + len(r.accept_lengths)
    assert emitted / rounds > 1.3  # drafts were accepted: compaction and the context cache were exercised


@torch.no_grad()
def test_selector_tree_is_what_decoding_verifies(tiny_target, drafter, monkeypatch):
    """With tree_scores conditional, decoding verifies exactly build_tree(unary, budget, SelectorScorer)
    for each block; with marginal, the plain tree of the same unary logits."""
    from dflash_train.decoding import proposers
    from dflash_train.decoding.ddtree import build_tree

    seen = []
    real = proposers.build_tree
    monkeypatch.setattr(proposers, "build_tree",
                        lambda logits, budget, scorer=None, token_ids=None: seen.append(
        (logits.clone(), scorer, token_ids)) or real(logits, budget, scorer, token_ids))
    stops = stop_token_ids(tiny_target.model, tiny_target.tokenizer)
    ids = chat_prompt(tiny_target.tokenizer, QUESTIONS[0])
    for scores in ("conditional", "marginal"):
        seen.clear()
        decode(tiny_target, drafter, ids, "ddtree", 32, max_new_tokens=24, stop_ids=stops, tree_scores=scores)
        assert seen and all((scorer is None) == (scores == "marginal") for _, scorer, _ in seen)
        assert all(ids is None for _, _, ids in seen)  # DFlash2 drafts over the full vocabulary
        if scores == "conditional":
            logits, scorer, _ = seen[0]
            assert (isinstance(scorer, dflash2.SelectorScorer)
                    and scorer.selector is drafter.candidate_selector)
            ours, plain = build_tree(logits, 32, scorer), build_tree(logits, 32)
            assert ours.tokens.tolist() != plain.tokens.tolist()  # the selector changes the tree
