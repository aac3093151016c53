"""The static engine (continuous batching over a static KV cache) against transformers' own generate."""

from dataclasses import replace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_train.core.errors import UserError
from dflash_train.data import regenerate as regen
from dflash_train.data.engine import StaticEngine, generate_all, static_generate
from dflash_train.data.regenerate import Sampling
from dflash_train.model.target import load_target

GREEDY = Sampling(backend="static", temperature=0.0, top_p=1.0, max_new_tokens=20, seed=0, batch_size=4,
                  enable_thinking=False, keep_truncated=True)
QUESTIONS = ["What is 23 + 59?", "Hi", "Write a function that reverses a list, then explain it in two lines.",
             "Name a colour.", "def add(a, b):"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def prompts_and_stops(target):
    tok = target.tokenizer
    prompts = [regen._prompt_ids(tok, [{"role": "user", "content": q}], False) for q in QUESTIONS]
    return prompts, regen.stop_token_ids(tok, "<|im_end|>", target.model.generation_config.eos_token_id)


@pytest.mark.parametrize("which", ["tiny_target", "llama"])
def test_greedy_answers_equal_transformers_generate_token_for_token(which, tiny_target, llama_target_dir):
    """Two slots for five prompts of different lengths: slots are reused mid-run, rows sit at different
    positions, and every answer is still exactly what transformers generates for it alone."""
    target = tiny_target if which == "tiny_target" else load_target(str(llama_target_dir))
    prompts, stops = prompts_and_stops(target)
    reference = regen.transformers_generate(target, stops, replace(GREEDY, backend="transformers"))
    expected = [reference([p], 0)[0] for p in prompts]
    got = static_generate(target, stops, GREEDY, slots=2, max_len=128)(prompts, 0)
    assert got == expected
    assert any(g.stopped for g in got) or which == "llama"  # the trained tiny target ends some answers


def test_sampled_answers_do_not_depend_on_slots(tiny_target):
    """Each prompt samples from its own generator (seed, prompt index): 1 slot or 3, the same text."""
    prompts, stops = prompts_and_stops(tiny_target)
    runs = [generate_all(StaticEngine(tiny_target.model, slots, 128), prompts, stops, 16, temperature=1.0,
                         top_p=0.9, seed=7) for slots in (1, 3)]
    assert runs[0] == runs[1]
    other_seed = generate_all(StaticEngine(tiny_target.model, 3, 128), prompts, stops, 16, 1.0, 0.9, seed=8)
    assert other_seed != runs[0]


def test_an_answer_that_reaches_the_cache_end_is_cut_not_overrun(tiny_target):
    prompts, stops = prompts_and_stops(tiny_target)
    longest = max(len(p) for p in prompts)
    gens = generate_all(StaticEngine(tiny_target.model, 2, longest + 4), prompts, stops, 50)
    for p, g in zip(prompts, gens):
        assert len(p) + len(g.tokens) <= longest + 4
    with pytest.raises(UserError, match="static engine holds"):
        generate_all(StaticEngine(tiny_target.model, 2, 8), prompts, stops, 4)


def test_an_unsupported_architecture_is_one_line(tiny_target):
    biased = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          attention_bias=True))
    target = replace(tiny_target, model=biased)
    with pytest.raises(UserError, match="--backend static: .*without biases"):
        static_generate(target, [0], GREEDY, slots=2, max_len=16)
