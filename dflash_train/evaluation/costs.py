"""Measure on this device what a decoding round costs as the work grows: the target's verify
forward by width (tokens verified in one forward) and the drafter's block pass by batch (requests
drafted together). dflash-eval measures both itself; dflash_train/evaluation/speed.py turns them into the
speedup predicted when several requests share one verify forward.

    costs = measure_costs(target, drafter, context=200, batches=[1, 4, 16], contexts=[800, 3200])
    costs["verify_ms"][r][i]            # round r, width costs["widths"][i], after `context` tokens
    costs["context_verify_ms"][r][k][j]  # round r, after costs["contexts"][k], width
                                         # costs["context_widths"][j]

The context axis is what N requests add beyond width: each reads (and DynamicCache copies) its
own KV cache per verify forward, so N requests after P tokens are measured as one request after
N x P (`contexts`, the totals the predictions need), at a few widths only (the extra cost of a
longer context is linear in width: speed.Curves).

Each round times every width and batch once, in an order rotated from round to round (as the
eval's sweep rotates methods), so a change in machine load lands on all of them alike; medians
over rounds are taken by the caller.

A costs JSON from benchmarks/gpu_costs.py (`dflash-eval --verify-times`, another device's costs) is
read by read_device_costs and checked against DeviceCosts: every time finite and at least MIN_MS,
and more work never measured much cheaper than less (MAX_DROP).
"""

import time
from pathlib import Path
from typing import Annotated

import torch
from pydantic import Field, model_validator
from transformers import DynamicCache

from dflash_train.core.schema import Open, load_json, validated
from dflash_train.decoding.ddtree import build_tree, root_only_tree
from dflash_train.decoding.decode import choose, verify
from dflash_train.model.drafter import ContextCache, DFlashDrafter
from dflash_train.model.target import Target, taps_from_hidden_states

VERIFY_WIDTHS = [2**k for k in range(11)]  # 1 .. 1024 tokens per verify forward
# widths measured at each longer context (up to the widest: see speed.Curves.extrapolated)
CONTEXT_WIDTHS = [1, 32, 1024]
ROUNDS = 10  # timed rounds (each times every width and batch once)
WARMUP = 2   # untimed rounds first (allocator, kernel selection)


# A time below 1 microsecond is no measurement: a CUDA kernel launch alone takes several, and each
# host step gpu_costs.py times (a tree build, a chain walk) is a Python loop. Such a file is in
# other units (seconds), or made up.
MIN_MS = 1e-3
# More work costs at least as much: a wider verify forward, more requests drafted together, a
# longer context. Measured times are noisy, so only a drop of more than MAX_DROP is refused:
# gpu_costs.py --tiny on a 2-core CPU under load (11 runs, medians of 20) measured a wider verify
# up to 20% cheaper than a narrower one (width 2: 3.44 ms after width 1: 4.28 ms) and a longer
# context up to 11% cheaper; a third leaves room above that, and catches a file whose widths were
# swapped, whose units or devices were mixed, or whose numbers were typed in.
MAX_DROP = 1 / 3

Ms = Annotated[float, Field(ge=MIN_MS, allow_inf_nan=False)]  # a measured time in ms
Size = Annotated[int, Field(ge=1)]  # a width, a batch or a context
Budget = Annotated[int, Field(ge=0)]


def check_rising(ms_by: dict[int, float], field: str, unit: str) -> None:
    """Times by growing work (width, batch, context): none more than MAX_DROP under the largest
    before it, else a ValueError naming both."""
    top = None
    for n in sorted(ms_by):
        if top is not None and ms_by[n] < (1 - MAX_DROP) * ms_by[top]:
            raise ValueError(f"{field}: {unit} {n} is measured at {ms_by[n]:g} ms, more than {MAX_DROP:.0%} "
                             f"below {unit} {top} ({ms_by[top]:g} ms): more work cannot cost that much less "
                             "(mixed units or devices, or swapped entries?)")
        if top is None or ms_by[n] > ms_by[top]:
            top = n


class DeviceCosts(Open):
    """A benchmarks/gpu_costs.py JSON: the fields dflash-eval's predictions read."""
    verify_ms_by_width: Annotated[dict[Size, Ms], Field(min_length=1)]
    draft_ms: Ms
    draft_ms_by_batch: dict[Size, Ms] = {}
    tree_build_ms_by_budget: dict[Budget, Ms] = {}
    tree_build_ms_by_scores: dict[str, dict[Budget, Ms]] = {}
    chain_walk_ms_by_scores: dict[str, Ms] = {}
    context: Size | None = None  # tokens in the cache behind verify_ms_by_width
    verify_ms_by_context: dict[Size, Annotated[dict[Size, Ms], Field(min_length=1)]] = {}
    device: str | None = None

    @model_validator(mode="after")
    def _more_work_costs_more(self):
        check_rising(self.verify_ms_by_width, "verify_ms_by_width", "width")
        check_rising(self.draft_ms_by_batch, "draft_ms_by_batch", "batch")
        if not self.verify_ms_by_context:
            return self
        if self.context is None:
            raise ValueError("verify_ms_by_context needs 'context' (the tokens behind verify_ms_by_width)")
        for t, row in self.verify_ms_by_context.items():
            if t <= self.context:
                raise ValueError(f"verify_ms_by_context: context {t} is not longer than 'context' "
                                 f"({self.context})")
            check_rising(row, f"verify_ms_by_context.{t}", "width")
        rows = {self.context: self.verify_ms_by_width, **self.verify_ms_by_context}
        widths = set.intersection(*(set(row) for row in self.verify_ms_by_context.values()))
        if not widths:
            raise ValueError("verify_ms_by_context: its contexts share no width")
        for w in sorted(widths):
            check_rising({t: row[w] for t, row in rows.items() if w in row}, f"width {w}", "context")
        return self


def read_device_costs(path: str | None) -> dict | None:
    """A benchmarks/gpu_costs.py JSON (verify ms by width, draft ms, ... on another device), read
    once and checked against DeviceCosts before anything loads: a negative, zero, NaN or
    nonsensical time would otherwise recommend a budget, or crash after the whole eval."""
    if path is None:
        return None
    where = f"--verify-times '{path}' is not a costs JSON from benchmarks/gpu_costs.py"
    data = load_json(Path(path), where)
    validated(DeviceCosts, data, where)
    return data


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def draft_batch(drafter: DFlashDrafter, target: Target, ctx: ContextCache, bonus: torch.Tensor,
                start: int) -> torch.Tensor:
    """A decoding round's drafter pass for `c` requests at once: bonus [c] -> draft logits [c, B-1, N], over
    the draft vocabulary when the drafter has one (as proposers.BlockProposer drafts; N = V otherwise).
    ctx holds c contexts of equal length (positions start..start+B-1 for every request)."""
    B, device = drafter.config.block_size, bonus.device
    block = torch.full((bonus.shape[0], B), drafter.config.mask_token_id, device=device)
    block[:, 0] = bonus
    positions = torch.arange(start, start + B, device=device).expand(bonus.shape[0], B)
    hidden = drafter.forward_cached(target.embed(block), positions, ctx)  # [c, B, H]
    return drafter.logits_head(target.lm_head)(hidden[:, 1:])


def widths_for(widest: int) -> tuple[list[int], list[int]]:
    """The widths worth timing when no prediction reads past `widest` tokens per verify forward:
    VERIFY_WIDTHS up to the first that covers it, and CONTEXT_WIDTHS below that plus that one. On a
    CPU a 1,024-wide forward of a real target costs seconds a round: an eval of budgets up to 64 for
    one request has no use for it. -> (widths, context_widths)"""
    top = next((w for w in VERIFY_WIDTHS if w >= widest), VERIFY_WIDTHS[-1])
    return [w for w in VERIFY_WIDTHS if w <= top], sorted({w for w in CONTEXT_WIDTHS if w < top} | {top})


def prompt_caches(target: Target, drafter: DFlashDrafter, prompt: torch.Tensor,
                  batches: list[int]) -> tuple[DynamicCache, dict[int, ContextCache]]:
    """The target's KV cache after `prompt` [1, P], and for each batch size c the drafter's context
    cache of c requests after it (c copies of the prompt's taps)."""
    device, context = target.embed.weight.device, prompt.shape[1]
    cache = DynamicCache(config=target.model.config)
    out = target.model(input_ids=prompt, past_key_values=cache, use_cache=True, output_hidden_states=True)
    taps = taps_from_hidden_states(out.hidden_states, drafter.config.target_layer_ids)  # [1, P, n*H]
    del out
    positions = torch.arange(context, device=device)[None]
    ctxs = {}
    for c in batches:
        ctxs[c] = ContextCache(drafter.config.num_hidden_layers)
        drafter.extend_context(ctxs[c], taps.expand(c, -1, -1), positions.expand(c, -1))
    return cache, ctxs


def long_context_cache(target: Target, tokens: int, context: int, g: torch.Generator) -> DynamicCache:
    """The KV cache of one request after `tokens` random tokens, prefilled in chunks of `context`
    (at least 256): no [t, t] mask."""
    device, V = target.embed.weight.device, target.model.config.vocab_size
    cache = DynamicCache(config=target.model.config)
    ids = torch.randint(0, V, (1, tokens), generator=g).to(device)
    for i in range(0, tokens, max(context, 256)):
        target.model(input_ids=ids[:, i : i + max(context, 256)], past_key_values=cache, use_cache=True)
    return cache


@torch.no_grad()
def measure_costs(target: Target, drafter: DFlashDrafter, context: int, batches: list[int],
                  widths: list[int] = VERIFY_WIDTHS, rounds: int = ROUNDS, seed: int = 0,
                  contexts: list[int] = (), context_widths: list[int] = CONTEXT_WIDTHS) -> dict:
    """Per round, ms of: one verify forward of [bonus + width-1 tree nodes] after `context` cached
    tokens (decode.verify plus the target's picks brought to the host, as the verify stage of a
    round does), the same at each of `context_widths` after each of `contexts` tokens, and one
    drafter block pass for each batch size. Random tokens: cost does not depend on their values.
    -> {"context", "widths", "batches", "verify_ms" [rounds][W], "draft_ms" [rounds][C],
    "contexts", "context_widths", "context_verify_ms" [rounds][K][D]}."""
    device = target.embed.weight.device
    V, L = target.model.config.vocab_size, drafter.config.block_size - 1
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V, (1, context), generator=g).to(device)
    cache, ctxs = prompt_caches(target, drafter, prompt, batches)
    logits = torch.randn(L, V, generator=g)
    trees = {w: root_only_tree() if w == 1 else build_tree(logits, w - 1) for w in widths}
    bonus = int(prompt[0, -1])

    contexts = sorted({int(t) for t in contexts if t > context})
    long_caches = {t: long_context_cache(target, t, context, g) for t in contexts}  # ascending t, from g
    for w in context_widths:
        trees.setdefault(w, root_only_tree() if w == 1 else build_tree(logits, w - 1))

    def verify_once(w: int, c: DynamicCache = cache, start: int = context) -> None:
        logits, _ = verify(target, c, trees[w], bonus, start, want_taps=True)
        choose(logits, 0.0, None).tolist()

    def draft_once(c: int) -> None:
        draft_batch(drafter, target, ctxs[c], torch.full((c,), bonus, device=device), context)
        _sync(device)

    jobs = ([("verify", w, context) for w in widths] + [("draft", c, context) for c in batches]
            + [("verify", w, t) for t in contexts for w in context_widths])
    times = {job: [] for job in jobs}
    for r in range(WARMUP + rounds):
        shift = r % len(jobs)
        for kind, n, t in jobs[shift:] + jobs[:shift]:
            c = cache if t == context else long_caches.get(t)
            _sync(device)
            t0 = time.perf_counter()
            verify_once(n, c, t) if kind == "verify" else draft_once(n)
            ms = 1e3 * (time.perf_counter() - t0)
            if kind == "verify":
                c.crop(-n)  # back to the prefix, outside the clock
            if r >= WARMUP:
                times[(kind, n, t)].append(ms)
    return {"context": context, "widths": list(widths), "batches": list(batches),
            "verify_ms": [[times[("verify", w, context)][r] for w in widths] for r in range(rounds)],
            "draft_ms": [[times[("draft", c, context)][r] for c in batches] for r in range(rounds)],
            "contexts": contexts, "context_widths": list(context_widths) if contexts else [],
            "context_verify_ms": [[[times[("verify", w, t)][r] for w in context_widths] for t in contexts]
                                  for r in range(rounds)]}
