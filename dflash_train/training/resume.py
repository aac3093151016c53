"""Training checkpoints: writing checkpoints/step_N/ (only with finite weights), reading the recipe a
run to resume was saved with and checking it against this one, and choosing the best validated
drafter of a run for its summary."""

import json
import os
import shutil
from pathlib import Path

import torch
import yaml

from dflash_train.checkpoint.folders import newest_checkpoint, write_checkpoint
from dflash_train.core.errors import UserError
from dflash_train.core.paths import resolve_input
from dflash_train.training.config import PATH_KEYS, RunConfig, dump_recipe
from dflash_train.training.engines import full_model_state, full_optimizer_state

DEEPSPEED_STATE = "deepspeed"  # the engine's own checkpoint inside checkpoints/step_N/
# Recipe keys (or whole sections) that may change between a run and its resumption (they do not
# affect the math; a run folder may be moved or copied; the deploy budget only names a checkpoint).
RESUMABLE_CHANGES = {"output_dir", "overwrite", "log_every", "checkpoint_every", "wandb",
                     "eval.deploy_budget"}


def saved_recipe(checkpoint: Path) -> dict:
    """The recipe a checkpoint was written with (its recipe.yaml); a damaged one is refused."""
    try:
        saved = yaml.safe_load((checkpoint / "recipe.yaml").read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"checkpoint '{checkpoint}' is damaged (its recipe.yaml: {type(e).__name__}): "
                        "delete it to resume from the one before") from None
    if not isinstance(saved, dict):
        raise UserError(f"checkpoint '{checkpoint}' is damaged (its recipe.yaml is not a mapping): "
                        "delete it to resume from the one before")
    return saved


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_same_recipe(saved: dict, cfg: RunConfig, where: Path, what: str) -> None:
    now, before = _flat(cfg.model_dump(mode="json")), _flat(saved)
    # a section added after the run was saved (tree_distill) reads as its defaults: an older run resumes
    before |= {k: v for k, v in _flat(RunConfig().model_dump(mode="json")).items()
               if k.split(".")[0] not in saved}

    def same(k: str) -> bool:
        if k in PATH_KEYS and isinstance(now[k], str) and isinstance(before.get(k), str):
            return resolve_input(now[k]) == resolve_input(before[k])
        return now[k] == before.get(k)

    resumable = {k for k in now if any(k == r or k.startswith(r + ".") for r in RESUMABLE_CHANGES)}
    changed = [k for k in now if k not in resumable and not same(k)]
    if changed:
        raise UserError(f"cannot resume from {where}: the recipe changed ({', '.join(changed)}); rerun with "
                        "the same recipe to resume, choose another output_dir, or pass overwrite=true to "
                        f"delete this run ({what})")


def save_training_checkpoint(folder: Path, accelerator, engine: str, drafter, opt, target, cfg: RunConfig,
                             state: dict) -> None:
    """checkpoints/step_N/: the full drafter weights (loadable like final/) plus what an exact
    resume needs. Every process takes part (gathers under FSDP / ZeRO); the main process writes
    into a temporary folder that is renamed only when complete, so a restart never picks half a
    checkpoint. DeepSpeed's engine writes its own sharded state into it first."""
    weights = full_model_state(accelerator, drafter, engine)
    check_finite_weights(weights, accelerator, state["step"], folder.parent.parent)
    optimizer = None if engine == "deepspeed" else full_optimizer_state(accelerator, drafter, opt)
    tmp = folder.with_name(f".{folder.name}.partial")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if engine == "deepspeed":  # optimizer partitions, per process
        accelerator.save_state(str(tmp / DEEPSPEED_STATE))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_checkpoint(tmp, accelerator.unwrap_model(drafter), target, dump_recipe(cfg),
                        state={**state, "optimizer": optimizer, "engine": engine}, weights=weights)
        os.replace(tmp, folder)
    accelerator.wait_for_everyone()


def kept_state(out: Path) -> str:
    """What a stopped run leaves to resume from."""
    newest = newest_checkpoint(out)
    return f"its newest checkpoint {newest} is kept" if newest else "it has no checkpoint yet"


def check_finite_weights(weights: dict, accelerator, step: int, out: Path) -> None:
    """Before writing a checkpoint or final/: every weight finite, decided on every process together
    (under FSDP / ZeRO-3 only the main process holds the gathered weights: the others hold {} or None)."""
    bad = [k for k, v in (weights or {}).items() if v.is_floating_point() and not torch.isfinite(v).all()]
    n = accelerator.reduce(torch.tensor([float(len(bad))], device=accelerator.device), reduction="sum").item()
    if n:
        raise UserError(f"step {step}: the drafter's weights are not finite{f' ({bad[0]})' if bad else ''}: "
                        f"nothing of this step was saved, {kept_state(out)} (lower train.lr)")


def choose_checkpoint(out: Path, cfg: RunConfig) -> dict:
    """Of the saved drafters that were validated (checkpoints/step_N/ still on disk, and final/),
    the one with the best held-out DDTree tau at eval.deploy_budget (the chain's EAL without one;
    ties: the later step). Read from metrics.jsonl, so validations before a resume count too."""
    key = "val_eal" if cfg.eval.deploy_budget is None else "val_ddtree_tau"
    def folder(step: int) -> str:
        return "final" if step == cfg.max_steps else f"checkpoints/step_{step:06d}"

    scores = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if key in r and (folder(r["step"]) == "final" or (out / folder(r["step"])).is_dir()):
            scores[r["step"]] = (r[key] if cfg.eval.deploy_budget is None
                                 else r[key][str(cfg.eval.deploy_budget)])
    step = max(scores, key=lambda s: (scores[s], s))
    return {"budget": cfg.eval.deploy_budget,
            "metric": "ddtree_tau" if cfg.eval.deploy_budget else "chain_eal",
            "step": step, "folder": folder(step), "value": scores[step],
            "validated": {str(s): v for s, v in sorted(scores.items())}}
