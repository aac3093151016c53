"""Setting a training run up for its loop (trainer.py): the recipe's inputs found and checked, the
precision and engine, the target and drafter, the data, the distributed wrapping, AdamW and the schedule,
restored from a checkpoint on resume -> a `Run`.

Every input (recipe, data, target, init_from, hidden-state cache with all its shards, the checkpoint
to resume) is read and checked before output_dir is touched: setup opens it last.
"""

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from datasets import Dataset
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Sampler
from transformers import get_cosine_schedule_with_warmup

from dflash_train.checkpoint.folders import check_resumable, count_parameters, load_checkpoint
from dflash_train.core.errors import UserError
from dflash_train.core.paths import model_source, resolve_input
from dflash_train.core.seeds import derived_generator
from dflash_train.data.dataset import Batch, check_data_path, collate, load_conversations
from dflash_train.data.hs_cache import HiddenStateCache, check_complete, open_cache
from dflash_train.model.target import Target, check_positions, load_target, max_positions, native_bf16
from dflash_train.model.variants import VARIANTS
from dflash_train.training.build import attach_draft_vocab, init_drafter
from dflash_train.training.config import RunConfig
from dflash_train.training.engines import (configure_deepspeed, fully_shard_drafter, launched_engine,
                                           load_optimizer_state, make_accelerator, shards_itself,
                                           whole_model_loading)
from dflash_train.training.resume import DEEPSPEED_STATE
from dflash_train.training.run_dir import OutputPlan, open_output_dir

# the trainer state's key of Variant.side_optimizer's state (its first user's name, kept: checkpoints resume)
SIDE_OPT_STATE = "markov_embed"


def resolve_recipe_paths(cfg: RunConfig) -> RunConfig:
    """Local inputs -> absolute paths (from the current folder, else the checkout: the bundled target
    and data), checked to be there before anything is loaded; Hub ids stay ids. The recipe saved
    with the drafter then names its target and data from any folder. data.max_length is checked
    against the target's positions (its config only) before its weights load."""
    m, d = cfg.model, cfg.data
    m.target = model_source(m.target, "model.target")
    check_positions(d.max_length, "data.max_length",
                    max_positions(m.target, m.target_revision, m.trust_remote_code), m.target)
    if m.init_from is not None:
        m.init_from = model_source(m.init_from, "model.init_from")
    d.train, d.val = resolve_input(d.train), resolve_input(d.val)
    check_data_path(d.train)
    check_data_path(d.val)
    if d.hidden_state_cache is not None:
        d.hidden_state_cache = resolve_input(d.hidden_state_cache)
        check_complete(Path(d.hidden_state_cache))
    return cfg


@dataclass
class Run:
    """A run set up for its loop (what a torchtune recipe keeps on self): the models, data,
    optimizer and schedule, and the position a resumed run continues from."""
    cfg: RunConfig
    out: Path
    engine: str  # single, ddp, fsdp or deepspeed (engines.py)
    precision: str  # bf16 or no
    accelerator: Accelerator
    target: Target  # frozen; its taps feed the drafter, its logits the loss
    drafter: torch.nn.Module  # as prepared by accelerate (DDP-wrapped, sharded, or a DeepSpeed engine)
    opt: AcceleratedOptimizer  # accelerate's wrapper; raw_opt is the torch optimizer (for the state-dict API)
    raw_opt: torch.optim.Optimizer
    sched: LambdaLR  # warmup then cosine, stepped once per optimizer step
    batches: Iterator[tuple[int, int, Batch]]  # train_batches(): (epoch, batches consumed in it, batch)
    val_ds: Dataset  # held-out rows (eval.max_samples of them at most)
    collate_fn: Callable[[list[dict]], Batch]  # pads validation rows as the train loader does
    cache: HiddenStateCache | None  # the hidden-state cache; None: the target's taps online
    layer_ids: list[int]  # the target layers the drafter taps
    B: int  # block size
    mask_id: int
    side_opt: object | None = None  # the variant's own optimizer beside AdamW (Variant.side_optimizer)
    start_step: int = 0  # the resumed checkpoint's step
    tokens: int = 0  # training tokens so far (all processes)
    train_time: float = 0.0  # seconds in optimizer steps so far
    resume: Path | None = None  # the checkpoint this run continues from


def setup(cfg: RunConfig, plan: OutputPlan) -> Run:
    """Target, drafter, data, distribution, optimizer and schedule (restored on resume); every
    input is loaded and checked, and only then is output_dir opened."""
    precision = choose_precision(cfg)
    if not torch.cuda.is_available():  # else DeepSpeed (imported by accelerate) warns on every CPU run
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    engine = launched_engine()  # single, ddp, fsdp or deepspeed (engines.py)
    accelerator = make_accelerator(engine, precision, "wandb" if cfg.wandb.enabled else None)
    if engine == "deepspeed":
        configure_deepspeed(accelerator, cfg.train.clip_grad, cfg.train.grad_accum)
    resume = plan.resume
    out = Path(cfg.output_dir)
    if plan.note:
        accelerator.print(plan.note)
    torch.manual_seed(cfg.seed)  # the drafter's initial weights

    # --- target, drafter, data -------------------------------------------------------------
    with whole_model_loading(accelerator, engine):
        target = load_target(cfg.model.target, revision=cfg.model.target_revision, device=accelerator.device,
                             dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
                             trust_remote_code=cfg.model.trust_remote_code)
    drafter = init_drafter(target, cfg.model)
    if resume:
        check_resumable(resume, drafter)
    check_heads_engine(cfg.model.variant, engine, accelerator)
    set_attention(drafter, cfg, accelerator.device)
    dcfg = drafter.config
    layer_ids, B, mask_id = dcfg.target_layer_ids, dcfg.block_size, dcfg.mask_token_id
    train_dl, sampler, val_ds, collate_fn, cache = setup_data(cfg, target, layer_ids, accelerator)
    # before a resume loads the saved one
    draft_vocab = attach_draft_vocab(drafter, target, train_dl.dataset, val_ds)
    if draft_vocab:
        accelerator.print(f"draft vocabulary: {draft_vocab['size']} of {dcfg.vocab_size} tokens, covering "
                          f"{draft_vocab['coverage']:.1%} of data.train's supervised tokens "
                          f"({draft_vocab['val_coverage']:.1%} of data.val's)")
    drafter, opt, raw_opt, sched, side_opt, train_dl, position = setup_optimization(cfg, accelerator, engine,
                                                                                    drafter, target,
                                                                                    train_dl, resume)
    start_step, epoch, skip, tokens, train_time = position
    # everything is loaded and checked: only now is output_dir touched
    open_output_dir(out, plan, accelerator)
    if cfg.wandb.enabled:
        accelerator.init_trackers(cfg.wandb.project, config=cfg.model_dump(mode="json"), init_kwargs={
            "wandb": {"mode": cfg.wandb.mode, "dir": str(out), "name": cfg.wandb.run_name}})

    accelerator.print(
        f"target {cfg.model.target}: {target.num_layers} layers, taps {layer_ids}; drafter "
        f"{count_parameters(accelerator.unwrap_model(drafter)) / 1e6:.2f}M trainable parameters, block {B}; "
        f"{sampler.n} train / {len(val_ds)} val conversations; hidden states "
        f"{'from ' + cfg.data.hidden_state_cache if cache else 'online'}; {precision.replace('no', 'fp32')} "
        f"on {accelerator.device} x{accelerator.num_processes} ({engine})"
        + (f"; resuming from {resume}" if resume else ""))
    return Run(cfg=cfg, out=out, engine=engine, precision=precision, accelerator=accelerator, target=target,
               drafter=drafter, opt=opt, raw_opt=raw_opt, sched=sched,
               batches=train_batches(train_dl, sampler, accelerator, epoch, skip),
               val_ds=val_ds, collate_fn=collate_fn, cache=cache, layer_ids=layer_ids, B=B, mask_id=mask_id,
               side_opt=side_opt, start_step=start_step, tokens=tokens, train_time=train_time,
               resume=resume)


def choose_precision(cfg: RunConfig) -> str:
    """auto = bf16 on a GPU that has it, else fp32. bf16 by name also on a CPU that runs it natively
    (AVX-512 BF16 / AMX: CPU autocast, the frozen target in bf16), never silently: it changes the numbers."""
    gpu_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if cfg.train.precision == "bf16" and not (gpu_bf16 or native_bf16("cpu")):
        raise UserError("train.precision=bf16 needs a GPU with bf16 support or a CPU with AVX-512 BF16 / AMX "
                        "(use auto or fp32)")
    return "bf16" if cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and gpu_bf16) else "no"


def check_heads_engine(variant: str, engine: str, accelerator: Accelerator) -> None:
    """A variant whose heads run after the backbone's forward (and whose weights are used inside the
    loss; Variant.heads_outside_forward) runs them outside any sharded unit's forward: FSDP must keep
    parameters unsharded from forward to backward and ZeRO-3, which gathers them per module forward,
    cannot serve them."""
    if not VARIANTS[variant].heads_outside_forward:
        return
    if engine == "fsdp" and os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() == "true":
        raise UserError(f"model.variant={variant} under FSDP needs fsdp_reshard_after_forward: false "
                        "(launch with --config_file recipes/accelerate/fsdp_dspark.yaml)")
    if engine == "deepspeed" and accelerator.state.deepspeed_plugin.zero_stage == 3:
        raise UserError(f"model.variant={variant} does not run under DeepSpeed ZeRO-3 (its heads' weights "
                        "are used outside a module forward): use ZeRO-2 or "
                        "recipes/accelerate/fsdp_dspark.yaml")


def set_attention(drafter, cfg: RunConfig, device: torch.device) -> None:
    """Gradient checkpointing and the attention kernel the recipe asks for (flex only on CUDA)."""
    drafter.gradient_checkpointing = cfg.train.gradient_checkpointing
    if cfg.train.attention == "flex" and device.type != "cuda":
        raise UserError("train.attention=flex needs CUDA (flex attention has no backward on CPU); use auto "
                        "or sdpa")
    drafter.flex_attention = cfg.train.attention == "flex" or (cfg.train.attention == "auto"
                                                               and device.type == "cuda")


def setup_data(cfg: RunConfig, target: Target, layer_ids: list[int], accelerator: Accelerator):
    """-> (train loader, its EpochSampler, held-out rows, collate_fn, hidden-state cache or None)."""
    with accelerator.main_process_first():
        train_ds = load_conversations(cfg.data.train, target.tokenizer, cfg.data.max_length)
        val_ds = load_conversations(cfg.data.val, target.tokenizer, cfg.data.max_length)
    cache = (open_cache(cfg.data.hidden_state_cache, target, layer_ids, train_ds)
             if cfg.data.hidden_state_cache else None)
    train_ds = train_ds.add_column("row", list(range(len(train_ds))))  # anchors and the cache are per row
    if cfg.eval.max_samples:
        val_ds = val_ds.select(range(min(cfg.eval.max_samples, len(val_ds))))
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    collate_fn = partial(collate, pad_id=pad_id)
    sampler = EpochSampler(len(train_ds), cfg.seed)
    train_dl = DataLoader(train_ds, batch_size=cfg.train.batch_size, sampler=sampler, drop_last=True,
                          collate_fn=collate_fn)
    if len(train_ds) < cfg.train.batch_size * accelerator.num_processes:
        raise UserError(f"data.train has {len(train_ds)} usable conversations, fewer than one global batch "
                        f"({cfg.train.batch_size} x {accelerator.num_processes} processes)")
    return train_dl, sampler, val_ds, collate_fn, cache


class EpochSampler(Sampler):
    """A permutation of the dataset seeded by (seed, epoch): the order is a pure function of the
    epoch, so a resumed run continues it exactly. Set `.epoch` before iterating."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def __iter__(self):
        g = derived_generator(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self):
        return self.n


def train_batches(loader: DataLoader, sampler: EpochSampler, accelerator: Accelerator, epoch: int,
                  skip: int) -> Iterator[tuple[int, int, Batch]]:
    """Endless (epoch, batches consumed in that epoch, batch), starting `skip` batches into `epoch`."""
    while True:
        sampler.epoch = epoch
        for i, batch in enumerate(accelerator.skip_first_batches(loader, skip) if skip else loader,
                                  start=skip):
            yield epoch, i + 1, batch
        epoch, skip = epoch + 1, 0


def setup_optimization(cfg: RunConfig, accelerator: Accelerator, engine: str, drafter: torch.nn.Module,
                       target: Target, train_dl: DataLoader, resume: Path | None):
    """Distribution, AdamW and the cosine schedule (stepped once per optimizer step, on every
    process), restored from `resume` -> (drafter, opt, torch optimizer, schedule, the variant's side
    optimizer or None, train loader, (step, epoch, batches consumed in it, tokens, train time) to
    continue from)."""
    start_step, epoch, skip, tokens, train_time = 0, 0, 0, 0, 0.0
    if resume:  # full weights go in before any sharding; the optimizer state after it
        weights, state = load_checkpoint(resume)
        if (state["engine"] == "deepspeed") != (engine == "deepspeed"):
            raise UserError(f"cannot resume from {resume}: it was written under {state['engine']} and this "
                            f"run uses {engine} (DeepSpeed checkpoints resume under DeepSpeed only)")
        drafter.load_state_dict(weights)
        start_step, epoch, skip = state["step"], state["epoch"], state["batches_in_epoch"]
        tokens, train_time = state["tokens"], state["train_time"]
    self_sharded = shards_itself(engine, accelerator)
    if self_sharded:
        fully_shard_drafter(drafter, accelerator)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.train.lr, betas=cfg.train.betas,
                            weight_decay=cfg.train.weight_decay)
    raw_opt = opt  # accelerate wraps it; the state-dict API wants the torch optimizer
    sched = get_cosine_schedule_with_warmup(opt, int(cfg.train.warmup_ratio * cfg.max_steps), cfg.max_steps)
    if self_sharded:
        opt, train_dl = accelerator.prepare(opt, train_dl)
    else:
        drafter, opt, train_dl = accelerator.prepare(drafter, opt, train_dl)
    if resume:
        sched.load_state_dict(state["scheduler"])
        if engine == "deepspeed":
            accelerator.load_state(str(resume / DEEPSPEED_STATE))
        else:
            load_optimizer_state(accelerator, drafter, raw_opt, state["optimizer"])
    model = accelerator.unwrap_model(drafter)
    side_opt = model.variant.side_optimizer(model, cfg, engine, target.embed.weight, sched.lr_lambdas[0])
    if side_opt is not None and resume:
        side_opt.load_state_dict(state[SIDE_OPT_STATE])
    return drafter, opt, raw_opt, sched, side_opt, train_dl, (start_step, epoch, skip, tokens, train_time)
