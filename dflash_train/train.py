"""Train a DFlash drafter against a frozen target (hidden states online).

    accelerate launch dflash_train/train.py                                  # recipes/tiny.yaml
    accelerate launch dflash_train/train.py --recipe R.yaml output_dir=runs/x max_steps=50 seed=3
    accelerate launch --multi_gpu --num_processes 2 dflash_train/train.py ...  # DDP (gloo on CPU)
    dflash-train ...                                                          # same entry

Each step: a batch of conversations -> the target's trunk (no grad) gives the tapped
hidden states and its own next-token distributions -> random anchors among assistant
tokens -> the drafter predicts every anchored block [anchor token, MASK x (B-1)] in one
pass -> loss (CE to the target's tokens and/or KL to its distributions, weighted by block
slot) -> backward, clip, AdamW, cosine schedule.

Writes <output_dir>/metrics.jsonl (one object per optimizer step), summary.json,
checkpoints/step_N/ (every `checkpoint_every` steps) and final/ (the drafter + recipe).
"""

import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from dflash_train.checkpoint import count_parameters, init_drafter, save_drafter, write_atomically, write_drafter
from dflash_train.config import DEFAULT_RECIPE, RunConfig, dump_recipe, load_recipe
from dflash_train.data import Batch, block_labels_index, collate, load_conversations, sample_anchors, stop_token_ids
from dflash_train.errors import OneLineArgumentParser, UserError, cli_guard
from dflash_train.hs_cache import HiddenStateCache, open_cache
from dflash_train.loss import acceptance_counts, acceptance_metrics, dflash_loss
from dflash_train.progress import BAR_INTERVAL
from dflash_train.target import Target, load_target, target_forward


@dataclass
class BlockOutputs:
    draft_logits: torch.Tensor  # [b, A, K, V], K = B-1 drafted slots
    target_logits: torch.Tensor  # [b, A, K, V], the target's distribution for the same tokens
    labels: torch.Tensor  # [b, A, K]
    valid: torch.Tensor  # [b, A, K] bool


def anchored_blocks(drafter, target: Target, batch: Batch, anchors, anchor_valid, layer_ids: list[int],
                    block_size: int, mask_id: int, ce_labels: str = "target",
                    cache: HiddenStateCache | None = None) -> BlockOutputs:
    """One target pass (or a cache read) and one drafter pass over every anchored block of the batch."""
    ids = batch.input_ids
    b, T = ids.shape
    A, K = anchors.shape[1], block_size - 1
    with torch.no_grad():
        if cache is None:
            taps, last = target_forward(target, ids, batch.attention_mask, layer_ids)
        else:
            taps, last = cache.batch(batch.rows, T, ids.device, target.embed.weight.dtype)
        block_ids = torch.full((b, A, block_size), mask_id, dtype=torch.long, device=ids.device)
        block_ids[:, :, 0] = ids.gather(1, anchors)  # slot 0: the anchor (bonus) token
        block_embeds = target.embed(block_ids.view(b, A * block_size))
        # Slot k predicts token a+k; the target's distribution for it is its output at a+k-1.
        pos, inside = block_labels_index(anchors, block_size, T)  # [b, A, K]
        valid = inside & batch.loss_mask.gather(1, pos.flatten(1)).view(b, A, K) & anchor_valid[..., None]
        H = last.shape[-1]
        t_hidden = last.gather(1, (pos - 1).flatten(1)[..., None].expand(-1, -1, H))
        target_logits = target.lm_head(t_hidden).view(b, A, K, -1)
        labels = target_logits.argmax(-1) if ce_labels == "target" else ids.gather(1, pos.flatten(1)).view(b, A, K)
    hidden = drafter(block_embeds, taps, anchors, batch.attention_mask.bool())  # [b, A*B, H]
    hidden = hidden.view(b, A, block_size, -1)[:, :, 1:]  # slots 1..B-1
    return BlockOutputs(target.lm_head(hidden), target_logits, labels, valid)


@torch.no_grad()
def validate(accelerator, drafter, target, loader, cfg: RunConfig, layer_ids, mask_id) -> dict:
    """Held-out per-position accuracy and chain EAL with fixed anchors; counts summed over processes."""
    drafter.eval()
    gen = torch.Generator().manual_seed(1234 + accelerator.process_index)
    counts, loss_sum, n = None, 0.0, 0
    for batch in loader:
        batch = batch.to(accelerator.device)
        anchors, anchor_valid = sample_anchors(batch.loss_mask, cfg.eval.num_anchors, cfg.model.block_size, gen)
        with accelerator.autocast():
            out = anchored_blocks(accelerator.unwrap_model(drafter), target, batch, anchors, anchor_valid,
                                  layer_ids, cfg.model.block_size, mask_id, cfg.loss.ce_labels)
            loss, m = dflash_loss(out.draft_logits, out.labels, out.valid, cfg.loss.gamma, cfg.loss.ce_weight,
                                  cfg.loss.kl_weight, out.target_logits)
        c = acceptance_counts(m["correct"], m["valid"])
        counts = c if counts is None else counts + c
        loss_sum, n = loss_sum + loss.item(), n + 1
    counts = accelerator.reduce(counts.to(accelerator.device), reduction="sum").cpu()
    totals = accelerator.reduce(torch.tensor([loss_sum, n], device=accelerator.device), reduction="sum").cpu()
    drafter.train()
    return {"loss": (totals[0] / totals[1]).item(), **acceptance_metrics(counts)}


def prepare_output_dir(cfg: RunConfig, accelerator) -> Path:
    out = Path(cfg.output_dir)
    if out.exists() and any(out.iterdir()):
        if not cfg.overwrite:
            raise UserError(f"output_dir '{out}' is not empty (pass overwrite=true to replace it)")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(out)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    return out


def choose_precision(cfg: RunConfig) -> str:
    bf16_ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if cfg.train.precision == "bf16" and not bf16_ok:
        raise UserError("train.precision=bf16 needs a GPU with bf16 support (use auto or fp32)")
    return "bf16" if cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and bf16_ok) else "no"


def parse_args(argv):
    p = OneLineArgumentParser(prog="dflash-train", description="Train a DFlash drafter.",
                                epilog="Overrides are dotted keys of the recipe, e.g. train.lr=1e-4 max_steps=50.")
    p.add_argument("--recipe", default=None, help=f"YAML recipe (default {DEFAULT_RECIPE})")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p.parse_args(argv)


@cli_guard
def main(argv=None):
    args = parse_args(argv)
    cfg = load_recipe(args.recipe, args.overrides)
    precision = choose_precision(cfg)
    # accelerate sets up multi-process gloo on CPU-only hosts (torchrun, `accelerate launch
    # --multi_gpu`) only when told cpu=True; with one process or CUDA it picks the device itself.
    cpu_ddp = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    accelerator = Accelerator(cpu=cpu_ddp, mixed_precision=precision, log_with="wandb" if cfg.wandb.enabled else None)
    out = prepare_output_dir(cfg, accelerator)
    set_seed(cfg.seed)

    # --- target, drafter, data -------------------------------------------------------------
    target = load_target(cfg.model.target, revision=cfg.model.target_revision, device=accelerator.device,
                         dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
                         trust_remote_code=cfg.model.trust_remote_code)
    drafter = init_drafter(target, cfg.model)
    dcfg = drafter.config
    layer_ids, B, mask_id = dcfg.target_layer_ids, dcfg.block_size, dcfg.mask_token_id
    stops = stop_token_ids(target.model, target.tokenizer)
    with accelerator.main_process_first():
        train_ds = load_conversations(cfg.data.train, target.tokenizer, cfg.data.max_length, stops)
        val_ds = load_conversations(cfg.data.val, target.tokenizer, cfg.data.max_length, stops)
    cache = None
    if cfg.data.hidden_state_cache:
        cache = open_cache(cfg.data.hidden_state_cache, target, layer_ids, train_ds)
        train_ds = train_ds.add_column("row", list(range(len(train_ds))))
    if cfg.eval.max_samples:
        val_ds = val_ds.select(range(min(cfg.eval.max_samples, len(val_ds))))
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    collate_fn = partial(collate, pad_id=pad_id)
    train_dl = DataLoader(train_ds, batch_size=cfg.train.batch_size, shuffle=True, drop_last=True,
                          collate_fn=collate_fn, generator=torch.Generator().manual_seed(cfg.seed))
    val_dl = DataLoader(val_ds, batch_size=cfg.train.batch_size, collate_fn=collate_fn)
    if len(train_dl) == 0:
        raise UserError(f"data.train has {len(train_ds)} usable conversations, fewer than "
                        f"train.batch_size={cfg.train.batch_size}")

    # --- optimizer and schedule (stepped once per optimizer step, on every process) --------
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.train.lr, betas=cfg.train.betas,
                            weight_decay=cfg.train.weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, int(cfg.train.warmup_ratio * cfg.max_steps), cfg.max_steps)
    drafter, opt, train_dl, val_dl = accelerator.prepare(drafter, opt, train_dl, val_dl)
    if cfg.wandb.enabled:
        accelerator.init_trackers(cfg.wandb.project, config=cfg.model_dump(mode="json"), init_kwargs={
            "wandb": {"mode": cfg.wandb.mode, "dir": str(out), "name": cfg.wandb.run_name}})

    accelerator.print(f"target {cfg.model.target}: {target.num_layers} layers, taps {layer_ids}; drafter "
                      f"{count_parameters(accelerator.unwrap_model(drafter)) / 1e6:.2f}M trainable parameters, "
                      f"block {B}; {len(train_ds)} train / {len(val_ds)} val conversations; {precision.replace('no', 'fp32')} on "
                      f"{accelerator.device} x{accelerator.num_processes}")

    # --- loop ---------------------------------------------------------------------------------
    metrics_file = open(out / "metrics.jsonl", "w") if accelerator.is_main_process else None
    anchor_gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + accelerator.process_index)
    batches = cycle(train_dl)
    bar = tqdm(total=cfg.max_steps, desc="train", disable=not accelerator.is_main_process, dynamic_ncols=True,
               mininterval=BAR_INTERVAL)
    tokens, train_time, val = 0, 0.0, None
    t_start = time.time()
    for step in range(1, cfg.max_steps + 1):
        t0 = time.time()
        loss_sum, step_tokens, counts = 0.0, 0, None
        for micro in range(cfg.train.grad_accum):
            batch = next(batches).to(accelerator.device)
            anchors, anchor_valid = sample_anchors(batch.loss_mask, cfg.data.num_anchors, B, anchor_gen)
            last_micro = micro == cfg.train.grad_accum - 1
            sync = contextlib.nullcontext() if last_micro else accelerator.no_sync(drafter)
            with sync, accelerator.autocast():
                o = anchored_blocks(drafter, target, batch, anchors, anchor_valid, layer_ids, B, mask_id,
                                    cfg.loss.ce_labels, cache)
                loss, m = dflash_loss(o.draft_logits, o.labels, o.valid, cfg.loss.gamma, cfg.loss.ce_weight,
                                      cfg.loss.kl_weight, o.target_logits)
                accelerator.backward(loss / cfg.train.grad_accum)
            loss_sum += loss.item() / cfg.train.grad_accum
            c = acceptance_counts(m["correct"], m["valid"])
            counts = c if counts is None else counts + c
            step_tokens += int(batch.attention_mask.sum())
        # One small all-reduce so the logged loss, acceptance and tokens cover every process.
        stats = torch.cat([torch.tensor([loss_sum, step_tokens], dtype=torch.float64), counts.cpu()])
        stats = accelerator.reduce(stats.to(accelerator.device), reduction="sum").cpu()
        loss_sum, tokens, counts = stats[0].item() / accelerator.num_processes, tokens + int(stats[1]), stats[2:]
        grad_norm = accelerator.clip_grad_norm_(drafter.parameters(), cfg.train.clip_grad)
        lr = sched.get_last_lr()[0]  # the rate this step uses
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        train_time += time.time() - t0

        live = acceptance_metrics(counts)
        record = {"step": step, "loss": round(loss_sum, 6), "lr": lr,
                  "grad_norm": round(float(grad_norm), 6), "eal": round(live["eal"], 4),
                  "acc_1": round(live["acc_per_position"][0], 4), "tokens": tokens,
                  "elapsed_s": round(time.time() - t_start, 2)}
        if (cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.max_steps:
            val = validate(accelerator, drafter, target, val_dl, cfg, layer_ids, mask_id)
            record.update({"val_loss": round(val["loss"], 6), "val_eal": round(val["eal"], 4),
                           "val_acc_per_position": [round(a, 4) for a in val["acc_per_position"]]})
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        accelerator.log({k: v for k, v in record.items() if not isinstance(v, list)}, step=step)
        if step % cfg.log_every == 0 or step == 1:
            bar.set_postfix(loss=f"{loss_sum:.3f}", eal=f"{live['eal']:.2f}", lr=f"{record['lr']:.1e}")
        bar.update(1)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.max_steps:
            save_checkpoint(accelerator, out, step, drafter, opt, sched, target, cfg)
    bar.close()

    # --- outputs -------------------------------------------------------------------------------
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_drafter(out / "final", accelerator.unwrap_model(drafter), target, dump_recipe(cfg))
        summary = {"steps": cfg.max_steps, "wall_s": round(time.time() - t_start, 2),
                   "train_tokens_per_s": round(tokens / train_time, 1), "train_tokens": tokens,
                   "processes": accelerator.num_processes, "device": str(accelerator.device),
                   "precision": "bf16" if precision == "bf16" else "fp32", "drafter_parameters": count_parameters(accelerator.unwrap_model(drafter)),
                   "target": cfg.model.target, "target_layer_ids": layer_ids, "block_size": B,
                   "eval": {"eal": val["eal"], "acc_per_position": val["acc_per_position"], "loss": val["loss"],
                            "blocks": val["blocks"]}}
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        metrics_file.close()
        print(f"done: {cfg.max_steps} steps in {summary['wall_s']:.0f}s, {summary['train_tokens_per_s']:.0f} "
              f"train tokens/s; held-out EAL {val['eal']:.2f}, acc@1 {val['acc_per_position'][0]:.3f}; "
              f"drafter in {out / 'final'}")
    accelerator.end_training()


def save_checkpoint(accelerator, out: Path, step: int, drafter, opt, sched, target, cfg: RunConfig) -> None:
    """checkpoints/step_N/: the drafter (loadable like final/), optimizer and scheduler state,
    and the step, written to a temporary folder and renamed."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        def write(tmp: Path):
            write_drafter(tmp, accelerator.unwrap_model(drafter), target, dump_recipe(cfg))
            torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp / "trainer_state.pt")
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step}) + "\n")

        write_atomically(out / "checkpoints" / f"step_{step:06d}", write)
    accelerator.wait_for_everyone()


def cycle(loader):
    """Endless iteration over epochs (the loader reshuffles each epoch)."""
    while True:
        yield from loader


if __name__ == "__main__":
    sys.exit(main())
