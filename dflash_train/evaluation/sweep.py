"""dflash-eval's interleaved sweep: every prompt decoded by every method back to back.

The methods' order rotates from prompt to prompt (`sweep_order`), so a change in machine load
lands on all of them. A `Sample` holds one prompt (all its turns) decoded by one method in one
repeat: acceptance lengths, outputs, the time per stage, spine and calibration counts.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dflash_train.decoding.ddtree import add_cells
from dflash_train.decoding.decode import STAGES, decode
from dflash_train.core.errors import UserError
from dflash_train.evaluation.suites import Prompt

if TYPE_CHECKING:  # run.py imports this module
    from dflash_train.evaluation.run import EvalSettings


@dataclass
class Sample:
    """One prompt (all its turns) decoded by one method in one repeat of the sweep."""
    suite: int  # index into the suites
    prompt: int
    repeat: int
    method: str
    budget: int
    accept_lengths: list[int] = field(default_factory=list)  # per round, all turns
    outputs: list[list[int]] = field(default_factory=list)  # per turn: generated tokens
    stage_s: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))  # prefill excluded
    prefill_s: float = 0.0
    decoded: int = 0  # tokens produced by decode rounds (each turn's first token comes from its prefill)
    context_tokens: int = 0  # sum over decoded tokens of the context they were verified after
    spine: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # decode.DecodeResult.spine, summed
    confidence: list[list[float]] | None = None  # decode.DecodeResult.confidence, summed (DSpark chain)
    calibration: dict = field(default_factory=dict)  # decode.DecodeResult.calibration, summed (DDTree)
    jacobi_passes: list[int] = field(default_factory=list)  # decode.DecodeResult.jacobi_passes (XPress chain)

    @property
    def decode_s(self) -> float:
        return sum(self.stage_s.values())

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else float("nan")

    @property
    def tpot(self) -> float:
        """Decode seconds per decoded token (NaN when nothing was decoded)."""
        return self.decode_s / self.decoded if self.decoded else float("nan")


def sweep_order(prompt_counts: list[int], methods: list[tuple[str, int]], repeats: int) -> list[tuple]:
    """The run order: (repeat, suite, prompt, method) for every prompt of every suite in every
    repeat. Each prompt is decoded by all methods back to back, so a change in machine load
    lands on every method alike (and is cancelled by the per-prompt ratios); the methods' order
    rotates by one from prompt to prompt, so none always runs first or right after another."""
    order, k = [], 0
    for r in range(repeats):
        for s, n in enumerate(prompt_counts):
            for i in range(n):
                shift = k % len(methods)
                order += [(r, s, i, m) for m in methods[shift:] + methods[:shift]]
                k += 1
    return order


def decode_prompt(target, drafter, prompt: Prompt, sample: Sample, stops, seed: int, max_new_tokens: int,
                  temperature: float, tree_scores: str) -> Sample:
    """All turns of one prompt with sample's method, recorded into `sample` (multi-turn: the
    target's own replies become the history)."""
    tok = target.tokenizer
    gen = torch.Generator().manual_seed(seed)  # the same for every method and repeat of this prompt
    messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        r = decode(target, drafter, ids, sample.method, sample.budget, temperature, max_new_tokens, stops,
                   gen, tree_scores)
        sample.spine = [a + b for a, b in zip(sample.spine, r.spine)]
        add_cells(sample.calibration, r.calibration)
        if r.confidence is not None:
            sample.confidence = r.confidence if sample.confidence is None else [
                [a + b for a, b in zip(x, y)] for x, y in zip(sample.confidence, r.confidence)]
        messages.append({"role": "assistant", "content": tok.decode(r.tokens, skip_special_tokens=True)})
        sample.accept_lengths += r.accept_lengths
        sample.jacobi_passes += r.jacobi_passes or []
        sample.outputs.append(r.tokens)
        n = len(r.tokens) - 1
        sample.decoded += n
        sample.context_tokens += n * ids.shape[1] + n * (n + 1) // 2
        sample.prefill_s += r.prefill_s
        for s in STAGES:
            sample.stage_s[s] += r.stage_s[s]
    return sample


def least_context(tok, prompt: Prompt) -> int:
    """Tokens the target reads before its last reply if every earlier reply were empty: the fewest
    positions the prompt needs whatever the target answers."""
    messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
    for i, turn in enumerate(prompt.turns):
        messages += [{"role": "user", "content": turn}] + [{"role": "assistant", "content": ""}] * (
            i < len(prompt.turns) - 1)
    return len(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def check_prompts_fit(suites: list[tuple[str, list[Prompt]]], tok, limit: int | None, target: str) -> None:
    """Every prompt leaves the target a position for its reply: past max_position_embeddings the
    target's RoPE runs on untrained angles and transformers only warns (of the tokenizer's length)."""
    if limit is None:
        return
    for name, prompts in suites:
        for i, prompt in enumerate(prompts, 1):
            n = least_context(tok, prompt)
            if n >= limit:
                raise UserError(f"suite '{name}' prompt {i} is {n} tokens (its turns as the chat template "
                                f"renders them), leaving no room for a reply within the {limit} positions of "
                                f"target '{target}' (max_position_embeddings): drop or shorten the prompt")


def run_sweep(target, drafter, suites: list[list[Prompt]], order: list[tuple], settings: "EvalSettings",
              stops, bar) -> list[Sample]:
    samples = []
    for r, s, i, (method, budget) in order:
        bar.set_postfix(repeat=r, method=f"{method}@{budget}" if method == "ddtree" else method)
        samples.append(decode_prompt(target, drafter, suites[s][i], Sample(s, i, r, method, budget), stops,
                                     settings.seed * 100_003 + i, settings.max_new_tokens,
                                     settings.temperature, settings.tree_scores))
        bar.update(1)
    return samples


def warm_up(target, drafter, prompt: Prompt, methods, settings: "EvalSettings", stops) -> None:
    """Decode one prompt once per method, untimed: the first calls pay one-off costs
    (allocator growth, kernel selection) that would otherwise land on whichever method runs first."""
    for method, budget in methods:
        decode_prompt(target, drafter, prompt, Sample(0, 0, 0, method, budget), stops, 0,
                      min(settings.max_new_tokens, 32), settings.temperature, settings.tree_scores)
