"""Time the pieces of a decoding round at Qwen3-8B's shape on one GPU: the cost model for picking a tree
budget.

    python benchmarks/gpu_costs.py --out benchmarks/gpu_costs.json
    python benchmarks/gpu_costs.py --tiny --device cpu --dtype float32   # smoke test, seconds

(`dflash_train` must be importable: installed with `pip install -e .`, or `PYTHONPATH=.` from the repo root.)

No Hub access: the target is a randomly initialised `Qwen3ForCausalLM` with Qwen3-8B's config
written out below, and the drafter a random `DFlashDrafter` of z-lab/Qwen3-8B-DFlash-b16's shape,
both built directly on the device in --dtype (random weights cost the same as trained ones;
transformers' init gives normal(0, 0.02) weights and unit norms, so logits stay finite).

Measured, each the median of --repeats runs after WARMUP untimed ones, with the device
synchronised before and after every run (wall clock, so host work such as the tree's heap counts):
  verify   `decode.verify` on [root + n tree nodes], width = n + 1, after a prefix of --context
           tokens in a DynamicCache; the tree is `build_tree` on real drafter logits (root only at
           width 1); the cache is cropped back to the prefix after each run; and the context axis
           (`verify_ms_by_context`): the same at --context-widths after each of --contexts tokens
           (N requests after P tokens each read N x P; dflash-eval's concurrency prediction needs it)
  draft    one `proposers.draft_block` (drafter pass on [bonus, MASK x (B-1)] + LM head on B-1 rows);
           and `costs.draft_batch`, the same pass for --draft-batches requests at once (dflash-eval's
           --concurrency prediction reads `draft_ms_by_batch`)
  tree     `build_tree` on the drafter's [B-1, V] logits, per budget; and the path-conditioned trees
           a DSpark, DFlash2 or XPress drafter decodes with (`tree_build_ms_by_scores`: DSpark's
           MarkovScorer per head type, DFlash2's SelectorScorer, XPress's XPressScorer; random heads,
           rank 256) and their chains' per-round walks (`chain_walk_ms_by_scores`: markov_chain,
           selector_chain, jacobi_chain)
  step     one round of `decode.decode` (draft + tree + verify + commit, exactly what decoding runs):
           per call, the stage times decode() itself records, over STEP_ROUNDS rounds after a prefill
           of --context tokens (prefill excluded), divided by the rounds; median over --repeats calls.
           With random weights nearly every round accepts only the bonus token, so commit moves
           one row per layer where a trained drafter moves ~tau rows (a small part of a round).

The JSON (--out) holds device/torch/cuda/driver, context, and per width/budget times in ms with
string keys; `verify_ms_by_width` is read by the eval tool to predict the best budget on this device.
"""

import argparse
import json
import platform
import statistics
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from dflash_train.decoding.ddtree import build_tree, root_only_tree
from dflash_train.decoding.decode import STAGES, decode, verify
from dflash_train.decoding.proposers import draft_block, draft_hidden
from dflash_train.evaluation.costs import CONTEXT_WIDTHS, draft_batch
from dflash_train.model.drafter import ContextCache, DFlashDrafter, DrafterConfig
from dflash_train.model.target import Target, taps_from_hidden_states
from dflash_train.model.variants.dflash2 import CandidateSelector, SelectorScorer, selector_chain
from dflash_train.model.variants.dspark import MarkovHead, MarkovScorer, markov_chain
from dflash_train.model.variants.xpress import (DEFAULT_MLP_RATIO, DEFAULT_PASSES, RefinerHead, XPressScorer,
                                                jacobi_chain)

# Qwen3-8B's config.json, and the published drafter z-lab/Qwen3-8B-DFlash-b16 (see
# shared/reference/dflash.md).
QWEN3_8B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
    max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, attention_bias=False,
    use_sliding_window=False, sliding_window=None, max_window_layers=36, tie_word_embeddings=False,
    initializer_range=0.02, bos_token_id=151643, eos_token_id=151645,
)
QWEN3_8B_DFLASH = dict(
    num_hidden_layers=5, block_size=16, target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669,
)
# --tiny: the same code on a model small enough for a CPU smoke test.
TINY = dict(
    vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
    max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, attention_bias=False,
    use_sliding_window=False, sliding_window=None, tie_word_embeddings=False, initializer_range=0.02,
)
TINY_DFLASH = dict(num_hidden_layers=1, block_size=8, target_layer_ids=[1], mask_token_id=1023)

WIDTHS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]  # verify width = 1 + budget
BUDGETS = [16, 32, 64, 128, 256, 512, 1024]              # DDTree's benchmark budgets
DRAFT_BATCHES = [1, 4, 16, 64]                          # requests drafted together
CONTEXTS = [2048, 8192, 32768]                          # total context tokens (N requests x context)
TINY_CONTEXTS = [2048]
SCORER_RANK, SELECTOR_TOP_K = 256, 16                   # DSpark / DFlash2 heads (as benchmarks/tree_build.py)
WARMUP = 3       # untimed runs before each measurement (kernel selection, allocator)
STEP_ROUNDS = 8  # decode rounds per timed decode() call
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_models(tiny: bool, device: torch.device, dtype: torch.dtype) -> tuple[Target, DFlashDrafter]:
    """Random target and drafter, allocated and initialised on `device` in `dtype` (no CPU copy)."""
    tc = Qwen3Config(**(TINY if tiny else QWEN3_8B), attn_implementation="sdpa")  # SDPA takes the tree mask
    dc = DrafterConfig(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim, vocab_size=tc.vocab_size, num_target_layers=tc.num_hidden_layers,
        rms_norm_eps=tc.rms_norm_eps, max_position_embeddings=tc.max_position_embeddings,
        rope_parameters=dict(tc.rope_parameters), **(TINY_DFLASH if tiny else QWEN3_8B_DFLASH),
    )
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):  # only here: build_tree wants CPU tensors by default
        model = Qwen3ForCausalLM(tc)
        drafter = DFlashDrafter(dc)
    model.eval().requires_grad_(False)
    drafter.eval().requires_grad_(False)
    # No tokenizer: every token here is a random id.
    return Target(model, None, "random Qwen3 (" + ("tiny" if tiny else "Qwen3-8B shape") + ")", None), drafter


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, repeats: int, device: torch.device, reset=None) -> float:
    """Median wall time of fn() over `repeats` runs after WARMUP untimed ones; reset() runs
    after every run, outside the clock."""
    times = []
    for i in range(WARMUP + repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
        if reset is not None:
            reset()
    return 1e3 * statistics.median(times)


def step_ms(target: Target, drafter: DFlashDrafter, prompt: torch.Tensor, method: str, budget: int,
            repeats: int) -> tuple[float, dict, float]:
    """One decoding round, from decode()'s own stage clock: per call the stage seconds / rounds,
    then the median over `repeats` calls (after WARMUP). Returns (round ms, ms per stage, tau)."""
    per_call, taus = [], []
    for i in range(WARMUP + repeats):
        r = decode(target, drafter, prompt, method, budget, max_new_tokens=1 + STEP_ROUNDS)
        rounds = len(r.accept_lengths)  # STEP_ROUNDS if every round emits only the bonus token
        if i >= WARMUP:
            per_call.append({s: 1e3 * r.stage_s[s] / rounds for s in STAGES})
            taus.append(r.tau)
    stages = {s: statistics.median(c[s] for c in per_call) for s in STAGES}
    total = statistics.median(sum(c.values()) for c in per_call)
    return total, stages, statistics.mean(taus)


def scorer_costs(drafter, target, ctx, bonus: int, start: int, draft_logits: torch.Tensor, budgets: list[int],
                 repeats: int, device: torch.device) -> tuple[dict, dict]:
    """Per-round costs of the path-conditioned trees and chain walks, keyed as dflash-eval's
    --verify-times reads them ("dspark-vanilla", "dspark-gated", "dspark-rnn", "dflash2", "xpress"): the
    tree build by budget, and the chain's walk. Random heads of rank SCORER_RANK on this block's
    hidden states; the tree's per-node work runs on the host whatever the device."""
    hidden = draft_hidden(drafter, target, ctx, bonus, start)  # [B, H]
    V, H = draft_logits.shape[1], hidden.shape[1]
    trees, walks = {}, {}
    for head_type in ("vanilla", "gated", "rnn"):
        head = MarkovHead(V, SCORER_RANK, H, head_type).to(device=device, dtype=hidden.dtype).eval()
        scorer = MarkovScorer(head, hidden, bonus)
        key = f"dspark-{head_type}"
        trees[key] = {str(b): median_ms(lambda: build_tree(draft_logits, b, scorer), repeats, device)
                      for b in budgets}
        # what markov_chain reads of a drafter
        holder = SimpleNamespace(markov_head=head, confidence_head=None)
        walks[key] = median_ms(lambda: markov_chain(holder, hidden, draft_logits, bonus), repeats, device)
        del head, scorer
    selector = CandidateSelector(V, H, SCORER_RANK, SELECTOR_TOP_K).to(device=device,
                                                                       dtype=hidden.dtype).eval()
    scorer = SelectorScorer(selector, hidden, bonus)
    trees["dflash2"] = {str(b): median_ms(lambda: build_tree(draft_logits, b, scorer), repeats, device)
                        for b in budgets}
    walks["dflash2"] = median_ms(lambda: selector_chain(selector, hidden[1:], draft_logits, bonus), repeats,
                                 device)
    B = hidden.shape[0]
    refiner = RefinerHead(V, H, B, SCORER_RANK, DEFAULT_MLP_RATIO).to(device=device,
                                                                      dtype=hidden.dtype).eval()
    scorer = XPressScorer(refiner, hidden, bonus, bonus)
    trees["xpress"] = {str(b): median_ms(lambda: build_tree(draft_logits, b, scorer), repeats, device)
                       for b in budgets}
    # what jacobi_chain reads of a drafter; the walk is its passes (at most 6, fewer at a fixed point)
    holder = SimpleNamespace(refiner_head=refiner, lm_head=None,
                             config=SimpleNamespace(num_jacobi_passes=DEFAULT_PASSES))
    walks["xpress"] = median_ms(lambda: jacobi_chain(holder, hidden, draft_logits, bonus, bonus), repeats,
                                device)
    for key in trees:
        print(f"{key:>14}: tree " + ", ".join(f"{b}: {ms:.3f}" for b, ms in trees[key].items())
              + f"; chain walk {walks[key]:.3f} ms")
    return trees, walks


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(description="Time verify/draft/tree/step of DFlash and DDTree decoding "
                                            "at Qwen3-8B's shape (random weights).")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--context", type=int, default=512, help="tokens already in the target's cache")
    p.add_argument("--widths", type=int_list, default=WIDTHS,
                   help="verify widths (root + nodes), comma-separated")
    p.add_argument("--budgets", type=int_list, default=BUDGETS,
                   help="DDTree budgets (non-root nodes), comma-separated")
    p.add_argument("--draft-batches", type=int_list, default=DRAFT_BATCHES, help="requests per drafter pass")
    p.add_argument("--contexts", type=int_list, default=None,
                   help=f"longer contexts for the verify cost's context axis, comma-separated ('' for none; "
                        f"default {CONTEXTS}, --tiny: {TINY_CONTEXTS})")
    p.add_argument("--context-widths", type=int_list, default=CONTEXT_WIDTHS,
                   help="widths timed at each of --contexts")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per measurement (median)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "gpu_costs.json")
    p.add_argument("--tiny", action="store_true", help="tiny model shape, for a CPU smoke test")
    args = p.parse_args(argv)
    if args.contexts is None:
        args.contexts = TINY_CONTEXTS if args.tiny else CONTEXTS
    t_start = time.perf_counter()
    if min(args.widths) < 1 or min(args.budgets) < 1:
        p.error("--widths must be >= 1 and --budgets >= 1")
    if min(args.draft_batches) < 1:
        p.error("--draft-batches must be >= 1")
    if args.repeats < 1 or args.context < 1:
        p.error("--repeats and --context must be >= 1")
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda but torch sees no CUDA device (use --tiny --device cpu --dtype "
                    "float32 to smoke-test)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())

    info = {
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else (platform.processor() or platform.machine())),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "driver": driver_version() if device.type == "cuda" else None,
        "dtype": args.dtype, "shape": "tiny" if args.tiny else "Qwen3-8B + DFlash-b16 drafter",
        "context": args.context, "repeats": args.repeats,
    }
    print(" | ".join(f"{k} {v}" for k, v in info.items()))

    t0 = time.perf_counter()
    target, drafter = build_models(args.tiny, device, dtype)
    sync(device)
    n_target = sum(w.numel() for w in target.model.parameters())
    n_drafter = sum(w.numel() for w in drafter.parameters())
    print(f"built target {n_target / 1e9:.3f}B and drafter {n_drafter / 1e9:.3f}B params "
          f"on {device} in {time.perf_counter() - t0:.1f} s")
    L = drafter.config.block_size - 1
    layer_ids = drafter.config.target_layer_ids

    with torch.no_grad():
        # Prefix: the target reads `context` random tokens; their taps fill the drafter's context.
        torch.manual_seed(1)
        prompt = torch.randint(0, target.model.config.vocab_size, (1, args.context), device=device)
        cache = DynamicCache(config=target.model.config)
        out = target.model(input_ids=prompt, past_key_values=cache, use_cache=True, output_hidden_states=True)
        if not torch.isfinite(out.logits).all():
            raise SystemExit("target logits are not finite: the random init is unusable in this dtype")
        bonus, start = int(out.logits[0, -1].argmax()), args.context
        ctx = ContextCache(drafter.config.num_hidden_layers)
        taps = taps_from_hidden_states(out.hidden_states, layer_ids)  # [1, context, n*H]
        drafter.extend_context(ctx, taps,
                               torch.arange(start, device=device)[None])
        # [L, V]: this drafter drafts in the full vocabulary
        _, draft_logits = draft_block(drafter, target, ctx, bonus, start)
        if not torch.isfinite(draft_logits).all():
            raise SystemExit("drafter logits are not finite: the random init is unusable in this dtype")
        del out

        print(f"\nverify: decode.verify on [root + n nodes] after {start} cached tokens (ms, median "
              f"of {args.repeats})")
        print(f"{'width':>6} {'ms':>9}")
        verify_ms = {}
        for width in args.widths:
            tree = root_only_tree() if width == 1 else build_tree(draft_logits, width - 1)
            if tree.size != width - 1:
                raise SystemExit(f"width {width}: only {tree.size + 1} tree prefixes exist at this shape")
            verify_ms[str(width)] = median_ms(lambda: verify(target, cache, tree, bonus, start, True),
                                              args.repeats, device, reset=lambda: cache.crop(-width))
            assert cache.get_seq_length() == start
            print(f"{width:>6} {verify_ms[str(width)]:>9.3f}")

        verify_by_context = {}
        # one request after `total` tokens
        for total in sorted(t for t in set(args.contexts) if t > args.context):
            long = DynamicCache(config=target.model.config)
            ids = torch.randint(0, target.model.config.vocab_size, (1, total), device=device)
            for i in range(0, total, 2048):  # chunked prefill: no [total, total] mask
                target.model(input_ids=ids[:, i : i + 2048], past_key_values=long, use_cache=True)
            verify_by_context[str(total)] = {}
            for width in args.context_widths:
                tree = root_only_tree() if width == 1 else build_tree(draft_logits, width - 1)
                verify_by_context[str(total)][str(width)] = median_ms(
                    lambda: verify(target, long, tree, bonus, total, True), args.repeats, device,
                    reset=lambda: long.crop(-width))
            print(f"verify after {total} tokens (ms): "
                  + ", ".join(f"{w}: {ms:.3f}" for w, ms in verify_by_context[str(total)].items()))
            # dropped by rebinding, not `del`: the timed lambdas above read `long` (pyflakes: F821)
            long = ids = None

        draft_ms = median_ms(lambda: draft_block(drafter, target, ctx, bonus, start), args.repeats, device)
        print(f"\ndraft: one proposers.draft_block, block {L + 1}, {len(ctx)} context tokens: "
              f"{draft_ms:.3f} ms")
        draft_by_batch = {}
        for c in args.draft_batches:  # c requests with equal contexts, one drafter pass
            ctx_c = ContextCache(drafter.config.num_hidden_layers)
            drafter.extend_context(ctx_c, taps.expand(c, -1, -1),
                                   torch.arange(start, device=device).expand(c, -1))
            bonus_c = torch.full((c,), bonus, device=device)
            draft_by_batch[str(c)] = median_ms(lambda: draft_batch(drafter, target, ctx_c, bonus_c, start),
                                               args.repeats, device)
            ctx_c = None  # not `del`, as for `long` above
        print("draft by batch (ms): " + ", ".join(f"{c}: {ms:.3f}" for c, ms in draft_by_batch.items()))
        del taps

        print(f"\ntree: build_tree on the drafter's [{L}, {draft_logits.shape[1]}] logits (ms)")
        print(f"{'budget':>6} {'ms':>9}")
        tree_ms = {}
        for budget in args.budgets:
            tree_ms[str(budget)] = median_ms(lambda: build_tree(draft_logits, budget), args.repeats, device)
            print(f"{budget:>6} {tree_ms[str(budget)]:>9.3f}")
        scored_ms, walk_ms = scorer_costs(drafter, target, ctx, bonus, start, draft_logits, args.budgets,
                                          args.repeats, device)
        cache = ctx = draft_logits = None  # not `del`, as for `long` above

        print(f"\nstep: one round of decode.decode ({STEP_ROUNDS} rounds per call after a "
              f"{args.context}-token prefill; ms per round, median of {args.repeats} calls; tau near 1 "
              f"with random weights)")
        print(f"{'method':>7} {'budget':>6} {'round':>9} " + " ".join(f"{s:>8}" for s in STAGES)
              + f" {'tau':>5}")
        rows = [("dflash", L)] + [("ddtree", b) for b in args.budgets]
        chain_ms, chain_stages, ddtree_ms, ddtree_stages = None, None, {}, {}
        for method, budget in rows:
            total, stages, tau = step_ms(target, drafter, prompt, method, budget, args.repeats)
            if method == "dflash":
                chain_ms, chain_stages = total, stages
            else:
                ddtree_ms[str(budget)], ddtree_stages[str(budget)] = total, stages
            print(f"{method:>7} {budget:>6} {total:>9.3f} " + " ".join(f"{stages[s]:>8.3f}" for s in STAGES)
                  + f" {tau:>5.2f}")

    if device.type == "cuda":
        print(f"\npeak CUDA memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    result = {**info, "verify_ms_by_width": verify_ms, "verify_ms_by_context": verify_by_context,
              "draft_ms": draft_ms, "draft_ms_by_batch": draft_by_batch,
              "tree_build_ms_by_budget": tree_ms, "tree_build_ms_by_scores": scored_ms,
              "chain_walk_ms_by_scores": walk_ms,
              "chain_step_ms": chain_ms, "ddtree_step_ms_by_budget": ddtree_ms,
              "chain_stage_ms": chain_stages, "ddtree_stage_ms_by_budget": ddtree_stages,
              "step_timing": f"decode.decode stage clock, {STEP_ROUNDS} rounds per call, prefill excluded"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({time.perf_counter() - t_start:.0f} s after imports)")


if __name__ == "__main__":
    main()
