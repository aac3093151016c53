"""The decoding loop: AR, the DFlash chain and DDTree are exactly the target's greedy output
at temperature 0, and follow the target's distribution at temperature > 0."""

import math

import pytest
import torch

from conftest import chat_prompt
from helpers.marginals import next_two_marginals, random_target_and_drafter
from dflash_train.checkpoint.folders import load_drafter
from dflash_train.data.dataset import stop_token_ids
from dflash_train.data.engine import pick
from dflash_train.decoding.decode import choose, decode
from dflash_train.model.drafter import DFlashDrafter
from dflash_train.model.sampling import sample_rows

QUESTIONS = ["What is 23 + 59?", "Tell me about Oakgate.", "Please sort 12, 5, 33, 8.",
             "How many seconds are in 7 minutes?", "Hello!"]


@pytest.fixture(scope="module")
def drafter(trained_drafter_dir):
    return load_drafter(trained_drafter_dir)[0].eval()


def hf_greedy(target, ids, n):
    return target.model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()


def test_ar_loop_equals_transformers_generate(tiny_target):
    stops = stop_token_ids(tiny_target.model, tiny_target.tokenizer)  # generate() stops at EOS too
    for q in QUESTIONS[:3]:
        ids = chat_prompt(tiny_target.tokenizer, q)
        r = decode(tiny_target, None, ids, "ar", max_new_tokens=40, stop_ids=stops)
        assert r.tokens == hf_greedy(tiny_target, ids, 40)
        assert r.accept_lengths == [1] * (len(r.tokens) - 1)  # the first token comes from the prefill


@pytest.mark.parametrize("method, budget", [("dflash", 0), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16),
                                            ("ddtree", 64), ("ddtree", 300)])
def test_speculative_output_is_the_greedy_output(tiny_target, drafter, method, budget):
    stops = stop_token_ids(tiny_target.model, tiny_target.tokenizer)
    emitted = rounds = 0
    for q in QUESTIONS:
        ids = chat_prompt(tiny_target.tokenizer, q)
        ar = decode(tiny_target, None, ids, "ar", max_new_tokens=60, stop_ids=stops)
        r = decode(tiny_target, drafter, ids, method, budget, max_new_tokens=60, stop_ids=stops)
        assert r.tokens == ar.tokens, q
        assert all(1 <= a <= drafter.config.block_size for a in r.accept_lengths)
        emitted, rounds = emitted + sum(r.accept_lengths), rounds + len(r.accept_lengths)
    # the drafter's guesses really were accepted, so compaction and context updates were exercised
    assert emitted / rounds > 1.3


def test_stop_token_and_max_length_are_exact(tiny_target, drafter):
    stops = stop_token_ids(tiny_target.model, tiny_target.tokenizer)
    ids = chat_prompt(tiny_target.tokenizer, QUESTIONS[0])
    full = decode(tiny_target, None, ids, "ar", max_new_tokens=200, stop_ids=stops).tokens
    assert full[-1] in stops and not set(full[:-1]) & stops
    for n in [1, 2, 7, 13, len(full) - 1]:
        for method in ["dflash", "ddtree"]:
            assert (decode(tiny_target, drafter, ids, method, 32, max_new_tokens=n,
                           stop_ids=stops).tokens == full[:n])
    assert decode(tiny_target, drafter, ids, "ddtree", 32, max_new_tokens=500, stop_ids=stops).tokens == full


def test_llama_target_is_lossless(llama_target_dir):
    from dflash_train.training.build import drafter_config_for
    from dflash_train.training.config import ModelConfig
    from dflash_train.model.target import load_target

    target = load_target(str(llama_target_dir))
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config_for(target, ModelConfig(num_layers=1, block_size=4))).eval()
    ids = chat_prompt(target.tokenizer, "Hello!")
    ref = hf_greedy(target, ids, 24)
    for method, budget in [("ar", 0), ("dflash", 0), ("ddtree", 8)]:
        assert decode(target, drafter, ids, method, budget, max_new_tokens=24).tokens == ref


def test_tiny_temperatures_pick_the_argmax_and_temperature_1_samples_as_before():
    """Both samplers (the decoder's choose, the static engine's pick) divide by the temperature: a
    tiny one used to overflow to inf - inf = nan and crash multinomial; its limit is the argmax. At
    temperature 1 the draws are those of the plain softmax (the decoder through sample_rows, the engine
    through torch.multinomial)."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 8
    for t in [1e-3, 1e-30, 1e-40, 1e-300, 5e-324]:
        gen = torch.Generator().manual_seed(1)
        assert choose(logits, t, gen).tolist() == logits.argmax(-1).tolist(), t
        assert [pick(row, t, 0.9, gen) for row in logits] == logits.argmax(-1).tolist(), t
    plain = sample_rows(torch.softmax(logits, -1), torch.Generator().manual_seed(2))
    assert choose(logits, 1.0, torch.Generator().manual_seed(2)).tolist() == plain.tolist()
    gen_new, gen_old = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [pick(row, 1.0, 1.0, gen_new) for row in logits] == [
        int(torch.multinomial(torch.softmax(row, -1), 1, generator=gen_old)) for row in logits]


def test_sampling_follows_the_target_distribution():
    """At temperature 1 the 2nd and 3rd tokens (decided by the tree walk, not the prefill)
    must follow the target's own distribution, whatever the (here untrained) drafter proposes. A 12-token
    vocabulary makes exact marginals cheap; a chi-square test at p > 1e-3 checks them."""
    V = 12
    target, drafter = random_target_and_drafter(V)
    model = target.model
    prompt = torch.tensor([[3, 5, 7]])

    p2, p3 = next_two_marginals(model, prompt, V)  # exact, by enumeration

    gen = torch.Generator().manual_seed(0)
    N = 1500
    c2, c3 = torch.zeros(V), torch.zeros(V)
    accepted_drafts = 0
    for _ in range(N):
        r = decode(target, drafter, prompt, "ddtree", budget=16, temperature=1.0, max_new_tokens=3,
                   generator=gen)
        c2[r.tokens[1]] += 1
        c3[r.tokens[2]] += 1
        accepted_drafts += r.accept_lengths[0] - 1
    # budget 16 > V: every first-level token is in the tree, so each run accepts at least one
    # drafted token and some accept two (the walk samples at the root and again below it)
    assert accepted_drafts > N, "the tree walk must actually accept drafted tokens"
    for counts, p in [(c2, p2), (c3, p3)]:
        expected = N * p
        keep = expected >= 5  # pool rare categories
        obs = torch.cat([counts.double()[keep], counts.double()[~keep].sum()[None]])
        exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        chi2 = float(((obs - exp) ** 2 / exp).sum())
        dof = len(obs) - 1
        # Wilson-Hilferty: chi2 quantile at p = 1e-3 is about dof * (1 - 2/(9dof) + 3.09 * sqrt(2/(9dof)))^3
        limit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
        assert chi2 < limit, (chi2, limit, obs.tolist(), exp.tolist())


@pytest.mark.parametrize("method, budget", [("dflash", 0), ("ddtree", 16)])
def test_causal_block_drafter_is_lossless(tiny_target, drafter, method, budget):
    """A drafter with causal in-block attention decodes to exactly the target's greedy output."""
    import dataclasses

    causal = DFlashDrafter(dataclasses.replace(drafter.config, block_attention="causal")).eval()
    causal.load_state_dict(drafter.state_dict())
    stops = stop_token_ids(tiny_target.model, tiny_target.tokenizer)
    rounds = []
    for q in QUESTIONS[:3]:
        ids = chat_prompt(tiny_target.tokenizer, q)
        ar = decode(tiny_target, None, ids, "ar", max_new_tokens=40, stop_ids=stops)
        r = decode(tiny_target, causal, ids, method, budget, max_new_tokens=40, stop_ids=stops)
        assert r.tokens == ar.tokens, q
        rounds += r.accept_lengths
    assert max(rounds) > 1  # some drafted tokens were accepted


def test_tree_calibration_counts_every_judged_node(tiny_target, drafter):
    """DDTree's calibration cells: each round the target judges every child of each accepted node,
    and exactly the accepted nodes below the root are hits, so hits = tokens emitted - rounds; the
    nodes judged are the children of the accepted nodes. The chain keeps no cells."""
    stops = stop_token_ids(tiny_target.model, tiny_target.tokenizer)
    ids = chat_prompt(tiny_target.tokenizer, QUESTIONS[1])
    r = decode(tiny_target, drafter, ids, "ddtree", 16, max_new_tokens=40, stop_ids=stops)
    hits = sum(c[1] for c in r.calibration.values())
    nodes = sum(c[2] for c in r.calibration.values())
    assert hits == sum(r.accept_lengths) - len(r.accept_lengths) > 0
    # stated probabilities in (0, 1]
    assert nodes > hits and all(0 < c[0] <= c[2] for c in r.calibration.values())
    assert all(1 <= d <= drafter.config.block_size - 1 for d, _ in r.calibration)
    assert decode(tiny_target, drafter, ids, "dflash", max_new_tokens=20, stop_ids=stops).calibration == {}
