"""The SmolLM2 training step: the full-vocabulary step of today against draft-vocabulary steps, interleaved.

    python benchmarks/step_cost.py --data data/real/corpus-prepared --cache data/real/corpus-cache \
        [--vocab 8192,16384] [--steps 12] [--warmup 2] [--val-every 0]

Every arm trains its own drafter of the SmolLM2 recipe (recipes/smollm2-135m.yaml: 2 layers, block 8,
batch 4 x 32 anchors, CE to the target's greedy tokens with D-PACE weights, AdamW) on the SAME batches
and anchors, from the same initial weights, one step each in a rotated order per round, so machine load
lands on every arm alike (fp32, one thread):

  full     today's step: the drafter's 49,152-wide head forward and backward, the target's logits
           recomputed from the cached last states for labels, alpha every step
  draft N  a draft vocabulary of N tokens (model.draft_vocab_size=N, built from data.train): the
           labels come from the cache (stored at dflash-cache time), the N-wide head only, alpha only
           on log steps (every 10th, as training does)

A step = cache read, drafter forward, loss, backward, clip, optimizer, as the trainer's optimizer_step
does them (the same functions). s/step and train tokens/s are medians over the measured steps; the
profile splits each arm's step into those parts. With --val-every K, every arm is validated (the
trainer's validate(): held-out teacher-forced acceptance with fixed anchors) every K steps and at the
end: teacher-forced quality at equal steps. Raw results -> benchmarks/results/step_cost.json.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from functools import partial

import torch
from accelerate import Accelerator

from dflash_train.core.paths import ROOT
from dflash_train.data.dataset import collate, load_conversations
from dflash_train.data.hs_cache import open_cache
from dflash_train.model.loss import loss_divisor
from dflash_train.model.target import load_target
from dflash_train.training.blocks import anchored_blocks, block_slots, draw_anchors
from dflash_train.training.build import attach_draft_vocab, init_drafter
from dflash_train.training.config import load_recipe
from dflash_train.training.objective import training_loss
from dflash_train.training.validate import validate

PARTS = ("blocks", "loss", "backward", "optimizer")


class Arm:
    """One drafter, its optimizer and its timings."""

    def __init__(self, name: str, cfg, target, train_ds, val_ds):
        torch.manual_seed(cfg.seed)  # the same initial weights in every arm
        self.name, self.cfg = name, cfg
        self.drafter = init_drafter(target, cfg.model)
        self.vocab = attach_draft_vocab(self.drafter, target, train_ds, val_ds)
        self.opt = torch.optim.AdamW([p for p in self.drafter.parameters() if p.requires_grad],
                                     lr=cfg.train.lr, betas=cfg.train.betas,
                                     weight_decay=cfg.train.weight_decay)
        self.times, self.parts, self.losses, self.val = [], {p: [] for p in PARTS}, [], {}

    def step(self, target, cache, batch, anchors, anchor_valid, step: int) -> None:
        cfg, d = self.cfg, self.drafter
        t = [time.perf_counter()]
        B = d.config.block_size
        o = anchored_blocks(d, target, batch, anchors, anchor_valid, d.config.target_layer_ids, B,
                            d.config.mask_token_id, cache)
        t.append(time.perf_counter())
        normalizer = loss_divisor(block_slots(batch, anchors, anchor_valid, B)[1], cfg.loss).clamp(min=1e-8)
        loss, _ = training_loss(o, target, d, cfg, normalizer, with_alpha=step % cfg.log_every == 0)
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(d.parameters(), cfg.train.clip_grad)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t.append(time.perf_counter())
        self.times.append(t[-1] - t[0])
        for name, a, b in zip(PARTS, t, t[1:]):
            self.parts[name].append(b - a)
        self.losses.append(round(loss.item(), 5))


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")),
               platform.processor())
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "threads_used": torch.get_num_threads(),
            "avx512_bf16": "avx512_bf16" in flags, "platform": platform.platform()}


def summary(arm: Arm, warmup: int, tokens: list[int]) -> dict:
    measured = arm.times[warmup:]
    s = statistics.median(measured)
    return {"arm": arm.name, "draft_vocab": arm.vocab, "s_per_step": round(s, 4),
            "train_tokens_per_s": round(statistics.median(tokens[warmup:]) / s, 1),
            "profile_s": {p: round(statistics.median(v[warmup:]), 4) for p, v in arm.parts.items()},
            "losses": arm.losses, "validation": arm.val}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2-135m.yaml"))
    p.add_argument("--data", default="data/real/corpus-prepared")
    p.add_argument("--cache", default="data/real/corpus-cache")
    p.add_argument("--vocab", default="8192,16384", help="draft vocabulary sizes (comma-separated)")
    p.add_argument("--steps", type=int, default=12, help="measured steps per arm")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--val-every", type=int, default=0, help="validate every arm every K steps and at the end")
    p.add_argument("--val-samples", type=int, default=32)
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "step_cost.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    overrides = [f"data.train={args.data}/train", f"data.val={args.data}/val",
                 f"data.hidden_state_cache={args.cache}", f"eval.max_samples={args.val_samples}"]
    base = load_recipe(args.recipe, overrides)
    target = load_target(base.model.target, dtype=torch.float32)
    train_ds = load_conversations(base.data.train, target.tokenizer, base.data.max_length)
    val_ds = load_conversations(base.data.val, target.tokenizer, base.data.max_length)
    val_ds = val_ds.select(range(min(args.val_samples, len(val_ds))))
    train_ds = train_ds.add_column("row", list(range(len(train_ds))))
    cache = open_cache(base.data.hidden_state_cache, target, [1, 27], train_ds)
    # today's step, whatever the recipe
    full = load_recipe(args.recipe, overrides + ["model.draft_vocab_size=null"])
    arms = [Arm("full", full, target, train_ds, val_ds)]
    for n in [int(x) for x in args.vocab.split(",") if x]:
        arms.append(Arm(f"draft {n}", load_recipe(args.recipe, overrides + [f"model.draft_vocab_size={n}"]),
                        target, train_ds, val_ds))
    pad = target.tokenizer.pad_token_id or 0
    g = torch.Generator().manual_seed(0)
    order, tokens = torch.randperm(len(train_ds), generator=g).tolist(), []
    accelerator = Accelerator(cpu=True)
    total = args.warmup + args.steps
    for step in range(1, total + 1):
        rows = order[(step - 1) * 4 % len(order):][:4]
        batch = collate([train_ds[r] for r in rows], pad)
        anchors, anchor_valid = draw_anchors(batch, base.data.num_anchors, base.seed, step)
        tokens.append(int(batch.attention_mask.sum()))
        for arm in arms[step % len(arms):] + arms[: step % len(arms)]:  # rotated: load lands on all alike
            arm.step(target, cache, batch, anchors, anchor_valid, step)
            if args.val_every and (step % args.val_every == 0 or step == total):
                arm.val[step] = validate(accelerator, arm.drafter, target, val_ds,
                                         partial(collate, pad_id=pad), arm.cfg,
                                         arm.drafter.config.target_layer_ids,
                                         arm.drafter.config.mask_token_id)
        print(f"step {step}: " + ", ".join(f"{a.name} {a.times[-1]:.2f}s" for a in arms), flush=True)
    results = [summary(a, args.warmup, tokens) for a in arms]
    full = results[0]["s_per_step"]
    for r in results:
        r["speedup_vs_full"] = round(full / r["s_per_step"], 2)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    out = {"command": "python " + " ".join(sys.argv), "commit": commit, "machine": machine(),
           "shapes": {"batch": 4, "anchors": base.data.num_anchors, "block": base.model.block_size,
                      "layers": base.model.num_layers, "max_length": base.data.max_length},
           "steps": args.steps, "warmup": args.warmup, "results": results}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    for r in results:
        print(f"{r['arm']}: {r['s_per_step']:.3f} s/step, {r['train_tokens_per_s']:.0f} tok/s, "
              f"{r['speedup_vs_full']:.2f}x; profile {r['profile_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
