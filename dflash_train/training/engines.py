"""How training is distributed: one process, DDP, FSDP2 or DeepSpeed ZeRO, and the state-dict
calls that make checkpoints and the final drafter independent of the engine.

The engine is whatever the launcher asked for (`accelerate launch --config_file
recipes/accelerate/<engine>.yaml`, torchrun, or a plain `python`):

    single / ddp  accelerate: DDP over NCCL, or over gloo on a CPU-only host
    fsdp          FSDP2, each DFlashDecoderLayer its own unit, then the root (fsdp.yaml). On GPUs
                  accelerate shards the drafter. On a CPU-only host accelerate silently trains
                  without FSDP, so we shard it ourselves with torch's fully_shard over a gloo mesh,
                  exactly as the config's wrap policy says.
    deepspeed     DeepSpeed ZeRO-2/3 through accelerate. On a CPU-only host accelerate also drops
                  DeepSpeed unless the process group is named gloo; then DeepSpeed runs on its CPU
                  accelerator.

Checkpoints. single, DDP and FSDP: full (unsharded) model and optimizer state dicts from torch's
distributed-checkpoint API, keyed by parameter names, so a checkpoint written under one of them,
at one process count, resumes under another. DeepSpeed: its engine's own checkpoint (accelerate's
save_state / load_state), which resumes under DeepSpeed at the same process count.
"""

import contextlib
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from dflash_train.core.errors import UserError

ENGINES = ("single", "ddp", "fsdp", "deepspeed")
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered, on rank 0's CPU


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def launched_engine() -> str:
    """The engine the launcher asked for (accelerate's config sets ACCELERATE_USE_*)."""
    if _flag("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if _flag("ACCELERATE_USE_FSDP"):
        return "fsdp"
    return "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "single"


def skip_deepspeed_shm_op() -> None:
    """DeepSpeed's CPU comm backend JIT-builds its shared-memory all-reduce op at every start (~40 s of
    C++ on 2 CPU cores on a fresh machine, behind torch's ownerless lock file, which a launch killed
    mid-build leaves for every later launch to wait on forever). Only inference_all_reduce (tensor-
    parallel inference) uses the op, never training's all_reduce, so mark it unavailable: DeepSpeed
    then skips the build (deepspeed.ops keeps the probed dict in the module so that edits persist)."""
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def make_accelerator(engine: str, precision: str, log_with: str | None) -> Accelerator:
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    cuda = torch.cuda.is_available()
    if engine == "deepspeed" and not cuda:
        skip_deepspeed_shm_op()
        # cpu=True would make accelerate drop DeepSpeed for plain gloo DDP; naming the backend
        # keeps DeepSpeed, which then runs on its CPU accelerator over gloo.
        accelerator = Accelerator(mixed_precision=precision, log_with=log_with,
                                  kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    else:
        # accelerate sets up multi-process gloo on CPU-only hosts only when told cpu=True
        accelerator = Accelerator(cpu=multi and not cuda, mixed_precision=precision, log_with=log_with)
    if engine == "deepspeed" and accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise UserError("the launcher asked for DeepSpeed but accelerate did not enable it (single process "
                        "without LOCAL_RANK?): launch with `accelerate launch --config_file "
                        "recipes/accelerate/deepspeed_zero2.yaml`")
    return accelerator


def shards_itself(engine: str, accelerator: Accelerator) -> bool:
    """FSDP asked for on a host where accelerate will not apply it (CPU-only, several processes)."""
    return engine == "fsdp" and accelerator.distributed_type == DistributedType.MULTI_CPU


def fully_shard_drafter(drafter: torch.nn.Module, accelerator: Accelerator) -> None:
    """FSDP2 as recipes/accelerate/fsdp.yaml asks (TRANSFORMER_BASED_WRAP of the classes named in
    FSDP_TRANSFORMER_CLS_TO_WRAP, then the root), over all processes of a gloo mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    wrap = {c.strip()
            for c in os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "DFlashDecoderLayer").split(",")}
    reshard = _flag("FSDP_RESHARD_AFTER_FORWARD") or "FSDP_RESHARD_AFTER_FORWARD" not in os.environ
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    units = [m for m in drafter.modules() if type(m).__name__ in wrap]
    if not units:
        raise UserError(f"FSDP wraps {sorted(wrap)} but the drafter has no such module (it has "
                        "DFlashDecoderLayer)")
    for m in units:
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(drafter, mesh=mesh, reshard_after_forward=reshard)


def gradient_sync(model: torch.nn.Module, accelerator: Accelerator, sync: bool):
    """Skip the gradient all-reduce / reduce-scatter on micro-steps before the last one."""
    if sync:
        return contextlib.nullcontext()
    module = accelerator.unwrap_model(model)
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(False)
        return _restore_sync(module)
    return accelerator.no_sync(model)


@contextlib.contextmanager
def _restore_sync(module):
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def configure_deepspeed(accelerator: Accelerator, clip_grad: float, grad_accum: int) -> None:
    """DeepSpeed owns clipping and accumulation: its config must say what the recipe says
    (accelerate would fill an "auto" gradient_clipping with 1.0, not the recipe's value)."""
    if grad_accum > 1:
        raise UserError("train.grad_accum > 1 with DeepSpeed: its engine owns accumulation; set "
                        "gradient_accumulation_steps in the DeepSpeed config and keep train.grad_accum=1")
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = clip_grad
    elif float(ds["gradient_clipping"]) != clip_grad:
        raise UserError(f"the DeepSpeed config clips at {ds['gradient_clipping']} but train.clip_grad is "
                        f"{clip_grad}: make them agree (or set gradient_clipping to \"auto\")")
    if ds.get("gradient_accumulation_steps", 1) not in (1, "auto"):
        raise UserError(f"the DeepSpeed config accumulates {ds['gradient_accumulation_steps']} micro-steps; "
                        "dflash-train normalises each step itself: set gradient_accumulation_steps to 1")


@contextlib.contextmanager
def whole_model_loading(accelerator: Accelerator, engine: str):
    """Load the frozen target whole. Under ZeRO-3, accelerate keeps transformers' DeepSpeed config
    alive, and transformers then partitions every model it loads (zero.Init), the target too, whose
    weights no engine would ever gather again."""
    if engine != "deepspeed":
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


def full_model_state(accelerator: Accelerator, model, engine: str) -> dict[str, torch.Tensor]:
    """The unsharded drafter weights (on the main process; a collective under FSDP / ZeRO-3)."""
    if engine == "deepspeed":
        return accelerator.get_state_dict(model)
    return get_model_state_dict(accelerator.unwrap_model(model), options=FULL)


def full_optimizer_state(accelerator: Accelerator, model, opt: torch.optim.Optimizer) -> dict:
    """The unsharded optimizer state keyed by parameter names (a collective under FSDP)."""
    return get_optimizer_state_dict(accelerator.unwrap_model(model), opt, options=FULL)


def load_optimizer_state(accelerator: Accelerator, model, opt: torch.optim.Optimizer, state: dict) -> None:
    """Every process reads the full state; each keeps its shard (FSDP) or all of it.

    AdamW makes a parameter's state at its first gradient, so a parameter that had none before the
    checkpoint (a head whose loss had not started, or never ran) has nothing saved: it must start fresh,
    as in the run that was never stopped. Not strict for that alone: the weights were loaded strictly."""
    model = accelerator.unwrap_model(model)
    set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True, strict=False))
    # torch's loader gave such a parameter a zero state at step 1 (its one step of zero gradients): drop
    # it, or its first real step would be bias-corrected as a second
    for name, p in model.named_parameters():
        if p.requires_grad and name not in state["state"]:
            opt.state.pop(p, None)


def grad_norm_of(model, engine: str, clipped) -> float | None:
    """The pre-clip gradient norm of the step (DeepSpeed clips inside its engine and reports it)."""
    if engine == "deepspeed":
        norm = model.get_global_grad_norm()
        return None if norm is None else float(norm)
    if clipped is None:
        return None
    return float(clipped.full_tensor() if isinstance(clipped, DTensor) else clipped)  # FSDP2: a DTensor
