"""Train a DFlash drafter against a frozen target (hidden states online, or from an offline cache).

    accelerate launch dflash_train/train.py                                  # recipes/tiny.yaml
    accelerate launch dflash_train/train.py --recipe R.yaml output_dir=runs/x max_steps=50 seed=3
    accelerate launch --multi_gpu --num_processes 2 dflash_train/train.py ...  # DDP (gloo on CPU)
    dflash-train ...                                                          # same entry

Each step: a batch of conversations -> the target's trunk (no grad; or the hidden-state cache)
gives the tapped hidden states and its own next-token distributions -> random anchors among
assistant tokens -> the drafter predicts every anchored block [anchor token, MASK x (B-1)] in
one pass -> loss (the recipe's terms, e.g. CE to the target's tokens, KL or TV to its
distributions, weighted by block slot; dflash_train/model/loss.py) -> backward, clip, AdamW, cosine schedule.

Exactness: anchors are drawn per dataset row, the data order is a pure function of (seed,
epoch), and the loss is normalised by the slot weights of the whole optimizer step across
processes and micro-batches. So 1 process x batch 8 and 2 processes x batch 4 train the same
model, and a run killed at any point and started again with the same command resumes from its
newest checkpoint and continues with the losses it would have had.

Writes <output_dir>/metrics.jsonl (one object per optimizer step), summary.json,
checkpoints/step_N/ (every `checkpoint_every` steps) and final/ (the drafter + recipe).

Every input (recipe, data, target, init_from, hidden-state cache with all its shards, the
checkpoint to resume) is read and checked before output_dir is touched: a bad one is one
`error:` line, exit code 2, and an earlier run there (overwrite=true) is left as it was. A
non-finite loss or gradient norm stops training before that step's update with one `error:`
line naming the step, exit code 2; checkpoints are written only with finite weights, so the
newest one is the last good state, and final/ is never written with non-finite weights.

Here: the loop, the optimizer step and the outputs; setup.py sets the run up (a `Run`).
"""

import json
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dflash_train.checkpoint.folders import count_parameters, save_drafter
from dflash_train.core.errors import UserError
from dflash_train.core.outputs import output_lock
from dflash_train.core.progress import BAR_INTERVAL
from dflash_train.model.loss import acceptance_counts, acceptance_metrics, loss_divisor
from dflash_train.training.blocks import BlockOutputs, anchored_blocks, block_slots, draw_anchors
from dflash_train.training.config import RunConfig, dump_recipe
from dflash_train.training.engines import full_model_state, grad_norm_of, gradient_sync
from dflash_train.training.objective import term_names, training_loss
from dflash_train.training.resume import (check_finite_weights, choose_checkpoint, kept_state,
                                          save_training_checkpoint)
from dflash_train.training.run_dir import StopRequest, plan_output_dir
from dflash_train.training.setup import SIDE_OPT_STATE, Run, setup
from dflash_train.training.tree_distill import pick_blocks, tree_distillation_loss
from dflash_train.training.validate import cpu_tree_scorer, validate, validation_record


def distilled_trees(run: Run, model, batch, anchors, o: BlockOutputs,
                    step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree distillation on one sequence of the micro-batch (tree_distill.py) -> (mean KL over the
    trees' nodes, with grad; summable [nodes, agreeing argmaxes])."""
    tcfg = run.cfg.tree_distill
    row, blocks = pick_blocks(o.valid, tcfg.anchors, step)
    if row < 0:
        return torch.zeros((), device=o.draft_hidden.device), torch.zeros(2, dtype=torch.float64)
    length = int(batch.attention_mask[row].sum())  # right-padded
    kl, c = tree_distillation_loss(model, run.target, batch.input_ids[row, :length],
                                   o.block_hidden[row, blocks], anchors[row, blocks].tolist(), tcfg.budget,
                                   cpu_tree_scorer(model))
    return kl, torch.tensor([c["nodes"], c["agree"]], dtype=torch.float64)


def train(cfg: RunConfig) -> None:
    """Train with output_dir held (core/outputs.output_lock): a second training started on it is
    refused on one line. Under a launcher the launch's first process (global rank 0) holds it for
    all: refused, it exits 2 and the launcher stops the others, which have written nothing yet
    (output_dir is opened only once every process has loaded and checked its inputs)."""
    first = os.environ.get("RANK", "0") == "0"
    with output_lock(Path(cfg.output_dir), "output_dir") if first else nullcontext():
        run_training(cfg)


def run_training(cfg: RunConfig) -> None:
    plan = plan_output_dir(cfg)  # before anything is loaded: a refusal costs nothing
    run = setup(cfg, plan)
    metrics_file = open_metrics(run)
    accelerator = run.accelerator
    bar = tqdm(total=cfg.max_steps, initial=run.start_step, desc="train",
               disable=not accelerator.is_main_process, dynamic_ncols=True, mininterval=BAR_INTERVAL)
    val, t_start = None, time.time()
    stop = StopRequest()  # Ctrl-C: finish the step on every process, then stop (a second one stops at once)
    for step in range(run.start_step + 1, cfg.max_steps + 1):
        record, live, position, stop_after_step = optimizer_step(run, step, stop)
        record["elapsed_s"] = round(time.time() - t_start, 2)
        if (cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.max_steps:
            val = validate(accelerator, run.drafter, run.target, run.val_ds, run.collate_fn, cfg,
                           run.layer_ids, run.mask_id)
            record.update(validation_record(val, accelerator.unwrap_model(run.drafter).variant))
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        accelerator.log(flat_for_tracker(record), step=step)
        if step % cfg.log_every == 0 or step == run.start_step + 1:
            bar.set_postfix(loss=f"{record['loss']:.3f}", eal=f"{live['eal']:.2f}", lr=f"{record['lr']:.1e}")
        bar.update(1)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.max_steps:
            epoch, in_epoch = position
            save_training_checkpoint(run.out / "checkpoints" / f"step_{step:06d}", accelerator, run.engine,
                                     run.drafter, run.raw_opt, run.target, cfg,
                                     {"step": step, "scheduler": run.sched.state_dict(), "epoch": epoch,
                                      "batches_in_epoch": in_epoch, "tokens": run.tokens,
                                      "train_time": run.train_time,
                                      SIDE_OPT_STATE: run.side_opt.state_dict() if run.side_opt else None})
        if stop_after_step:
            stop.restore()
            raise KeyboardInterrupt
    stop.restore()
    bar.close()
    write_outputs(run, val, t_start, metrics_file)
    # Every process leaves together and tears the process group down before the interpreter does:
    # a gloo group destroyed while a peer is still busy, or left to interpreter finalisation, can
    # abort the process ("terminate called without an active exception").
    accelerator.wait_for_everyone()
    accelerator.end_training()


def open_metrics(run: Run):
    """metrics.jsonl on the main process (None elsewhere): on resume, the records up to the
    checkpoint are kept and the rest dropped."""
    if not run.accelerator.is_main_process:
        return None
    path = run.out / "metrics.jsonl"
    kept = [line for line in path.read_text().splitlines()
            if json.loads(line)["step"] <= run.start_step] if run.resume and path.exists() else []
    metrics_file = open(path, "w")
    metrics_file.writelines(line + "\n" for line in kept)
    return metrics_file


def optimizer_step(run: Run, step: int, stop: StopRequest) -> tuple[dict, dict, tuple[int, int], bool]:
    """One optimizer step over grad_accum micro-batches -> (its metrics record, live acceptance
    metrics, the data position (epoch, batches consumed in it) after it, whether any process
    asked to stop after it). Advances run.tokens and run.train_time."""
    t0 = time.time()
    micro, normalizer, position = draw_micro_batches(run, step)
    sums = backward_micro_batches(run, step, micro, normalizer)
    loss, tokens, counts, terms, tree, stop_after_step = reduce_stats(run, *sums, stop.requested)
    run.tokens += tokens
    grad_norm, lr = apply_update(run, step, loss)
    run.train_time += time.time() - t0

    live = acceptance_metrics(counts)
    if run.engine == "deepspeed":  # its engine reports the norm only after its step
        grad_norm = grad_norm_of(run.drafter, run.engine, grad_norm)
        check_finite_step(step, loss, grad_norm, run.out)
    return step_record(run, step, loss, terms, lr, grad_norm, live, tree), live, position, stop_after_step


def draw_micro_batches(run: Run, step: int) -> tuple[list, torch.Tensor, tuple[int, int]]:
    """The step's micro-batches and anchors, drawn before any forward: the loss is normalised by
    the slot weights of the whole optimizer step, summed over micro-batches and processes ->
    ([(batch, anchors, anchor_valid)] x grad_accum, that normaliser, the data position after them)."""
    cfg, accelerator = run.cfg, run.accelerator
    micro = []
    for _ in range(cfg.train.grad_accum):
        epoch, in_epoch, batch = next(run.batches)
        batch = batch.to(accelerator.device)
        anchors, anchor_valid = draw_anchors(batch, cfg.data.num_anchors, cfg.seed, step)
        micro.append((batch, anchors, anchor_valid))
    w_local = sum(loss_divisor(block_slots(b, a, v, run.B)[1], cfg.loss) for b, a, v in micro)
    w_total = accelerator.reduce(w_local.double(), reduction="sum").clamp(min=1e-8)
    # DDP averages gradients over processes: scale by P so the step's gradient is the global mean.
    normalizer = (w_total / accelerator.num_processes).float()
    return micro, normalizer, (epoch, in_epoch)


def backward_micro_batches(run: Run, step: int, micro: list, normalizer: torch.Tensor) -> tuple:
    """Forward and backward of each micro-batch (gradients synchronised on the last) -> this
    process's sums: (loss, tokens, acceptance counts, terms [T], tree distillation's [nodes,
    agreeing argmaxes])."""
    cfg, accelerator, drafter = run.cfg, run.accelerator, run.drafter
    loss_sum, step_tokens, terms, counts, tree_counts = 0.0, 0, 0.0, None, torch.zeros(2, dtype=torch.float64)
    distil = cfg.tree_distill.weight > 0 and step % cfg.tree_distill.every == 0
    for i, (batch, anchors, anchor_valid) in enumerate(micro):
        with gradient_sync(drafter, accelerator, sync=i == len(micro) - 1), accelerator.autocast():
            o = anchored_blocks(drafter, run.target, batch, anchors, anchor_valid, run.layer_ids, run.B,
                                run.mask_id, run.cache)
            model = accelerator.unwrap_model(drafter)
            # alpha needs the target's logits: a draft-vocabulary step skips them between log steps
            loss, m = training_loss(o, run.target, model, cfg, normalizer,
                                    with_alpha=step % cfg.log_every == 0)
            if cfg.tree_distill.weight > 0:  # its term: this step's KL on the first micro-batch, else 0
                kl = torch.zeros((), device=loss.device)
                if distil and i == 0:
                    kl, tree_counts = distilled_trees(run, model, batch, anchors, o, step)
                    loss = loss + cfg.tree_distill.weight * kl
                m["terms"] = torch.cat([m["terms"], kl.detach().reshape(1).to(m["terms"].dtype)])
            accelerator.backward(loss)
        loss_sum += loss.item()
        terms = terms + m["terms"].double().cpu()
        c = acceptance_counts(m["correct"], m["valid"], m["alpha"])
        counts = c if counts is None else counts + c
        step_tokens += int(batch.attention_mask.sum())
    return loss_sum, step_tokens, counts, terms, tree_counts


def reduce_stats(run: Run, loss_sum: float, step_tokens: int, counts, terms, tree_counts,
                 stop_requested: bool) -> tuple[float, int, torch.Tensor, dict, list[float], bool]:
    """This process's sums -> (mean loss, tokens, acceptance counts, mean terms by name, tree
    distillation's [nodes, agreeing argmaxes], whether any process asked to stop), over every
    process: one small all-reduce. The stop request rides along, so every process stops after the
    same step."""
    cfg, accelerator = run.cfg, run.accelerator
    stats = torch.cat([torch.tensor([loss_sum, step_tokens], dtype=torch.float64), counts.cpu(), terms,
                       tree_counts, torch.tensor([float(stop_requested)], dtype=torch.float64)])
    stats = accelerator.reduce(stats.to(accelerator.device), reduction="sum").cpu()
    stop_after_step, tree, stats = stats[-1].item() > 0, stats[-3:-1].tolist(), stats[:-3]
    loss, tokens = stats[0].item() / accelerator.num_processes, int(stats[1])
    counts, terms = stats[2 : 2 + len(counts)], stats[2 + len(counts) :] / accelerator.num_processes
    names = term_names(cfg) + ["tree"] * (cfg.tree_distill.weight > 0)
    terms = {name: round(v, 6) for name, v in zip(names, terms.tolist())}
    return loss, tokens, counts, terms, tree, stop_after_step


def apply_update(run: Run, step: int, loss: float) -> tuple[float | None, float]:
    """Clip, check the loss and gradient norm are finite, then the optimizer, schedule (and the
    variant's side optimizer) step and the gradients are cleared -> (gradient norm, the step's learning
    rate). Under DeepSpeed the norm is read, and checked, only after the step (optimizer_step)."""
    cfg, drafter = run.cfg, run.drafter
    grad_norm = run.accelerator.clip_grad_norm_(drafter.parameters(), cfg.train.clip_grad)
    if run.engine != "deepspeed":  # DeepSpeed reports its norm after its step
        grad_norm = grad_norm_of(drafter, run.engine, grad_norm)
        check_finite_step(step, loss, grad_norm, run.out)  # the same numbers on every process
    lr = run.sched.get_last_lr()[0]  # the rate this step uses
    run.opt.step()
    run.sched.step()
    if run.side_opt is not None:  # it may read the drafter's gradients: before they are cleared
        run.side_opt.step()
    run.opt.zero_grad(set_to_none=True)
    return grad_norm, lr


def step_record(run: Run, step: int, loss: float, terms: dict, lr: float, grad_norm: float | None, live: dict,
                tree: list[float]) -> dict:
    """A training step's line of metrics.jsonl (validation adds its val_* keys)."""
    grad_norm = None if grad_norm is None else round(grad_norm, 6)
    record = {"step": step, "loss": round(loss, 6), "terms": terms, "lr": lr, "grad_norm": grad_norm,
              "eal": round(live["eal"], 4), "acc_1": round(live["acc_per_position"][0], 4),
              "alpha_per_position": [round(a, 4) for a in live["alpha_per_position"]], "tokens": run.tokens,
              "train_tokens_per_s": round(run.tokens / run.train_time, 1)}
    if step % run.cfg.log_every and run.accelerator.unwrap_model(run.drafter).lm_head is not None:
        del record["alpha_per_position"]  # a draft-vocabulary step computes alpha on log steps only
    tree_nodes, tree_agree = tree
    if tree_nodes:  # tree distillation: the share of its nodes where the drafter's argmax is the target's
        record["tree_agree"] = round(tree_agree / tree_nodes, 4)
    return record


def write_outputs(run: Run, val: dict, t_start: float, metrics_file) -> None:
    """final/ (the drafter + recipe) and summary.json, once every weight is known finite."""
    cfg, accelerator, drafter = run.cfg, run.accelerator, run.drafter
    weights = full_model_state(accelerator, drafter, run.engine)  # a collective under FSDP / ZeRO-3
    check_finite_weights(weights, accelerator, cfg.max_steps, run.out)
    if not accelerator.is_main_process:
        return
    out = run.out
    save_drafter(out / "final", accelerator.unwrap_model(drafter), run.target, dump_recipe(cfg), weights)
    summary = {"steps": cfg.max_steps, "wall_s": round(time.time() - t_start, 2),
               "train_tokens_per_s": round(run.tokens / max(run.train_time, 1e-9), 1),
               "train_tokens": run.tokens, "resumed_from_step": run.start_step,
               "processes": accelerator.num_processes, "engine": run.engine,
               "device": str(accelerator.device), "precision": "bf16" if run.precision == "bf16" else "fp32",
               "drafter_parameters": count_parameters(accelerator.unwrap_model(drafter)),
               "target": cfg.model.target, "target_layer_ids": run.layer_ids, "block_size": run.B,
               "hidden_states": "cache" if run.cache else "online", "eval": val,
               "chosen": choose_checkpoint(out, cfg),
               # this process's peak (all processes hold the same shapes under DDP; a shard under FSDP/ZeRO)
               "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
               if accelerator.device.type == "cuda" else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    metrics_file.close()
    tree = "".join(f", DDTree@{b} {t:.2f}" for b, t in val["ddtree_tau"].items())
    print(f"done: {cfg.max_steps} steps in {summary['wall_s']:.0f}s, {summary['train_tokens_per_s']:.0f} "
          f"train tokens/s; held-out EAL {val['eal']:.2f} (chain){tree}; acc@1 "
          f"{val['acc_per_position'][0]:.3f}, alpha@1 {val['alpha_per_position'][0]:.3f}; drafter in "
          f"{out / 'final'}")
    c = summary["chosen"]
    if c["folder"] != "final":
        what = f"DDTree@{c['budget']}" if c["budget"] else "the chain"
        print(f"for {what}, the best validated drafter is {out / c['folder']} (step {c['step']}: "
              f"{c['value']:.2f})")


def check_finite_step(step: int, loss: float, grad_norm: float | None, out: Path) -> None:
    """A non-finite loss or gradient norm stops training (before the step's update, except under
    DeepSpeed, whose engine reports its norm after it); the step is not saved."""
    for name, value in [("loss", loss), ("gradient norm", grad_norm)]:
        if value is not None and not math.isfinite(value):
            raise UserError(f"step {step}: the {name} is {value}: training stopped and nothing of this step "
                            f"is saved; {kept_state(out)} (lower train.lr, or check the data and loss.terms)")


def flat_for_tracker(record: dict) -> dict:
    """metrics.jsonl record -> scalar keys for wandb (loss/<term>, alpha_k, val/loss/<term>,
    val/acc_k, val/alpha_k, val/ddtree_tau@budget)."""
    flat = {k: v for k, v in record.items() if v is not None and not isinstance(v, (list, dict))}
    for key, prefix in [("terms", "loss/"), ("val_terms", "val/loss/")]:
        for name, v in record.get(key, {}).items():
            flat[prefix + name] = v
    for key, name in [("alpha_per_position", "alpha"), ("val_acc_per_position", "val/acc"),
                      ("val_alpha_per_position", "val/alpha")]:
        for k, v in enumerate(record.get(key, []), start=1):
            flat[f"{name}_{k}"] = v
    for budget, tau in record.get("val_ddtree_tau", {}).items():
        flat[f"val/ddtree_tau@{budget}"] = tau
    return flat
