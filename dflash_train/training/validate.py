"""Validation: the held-out loss and its terms, per-slot accuracy and acceptance, chain EAL and
teacher-forced DDTree tau at the recipe's budgets, with fixed anchors, summed over processes."""

import torch
from tqdm.auto import tqdm

from dflash_train.core.progress import BAR_INTERVAL
from dflash_train.model.loss import acceptance_counts, acceptance_metrics, loss_divisor
from dflash_train.training.blocks import BlockOutputs, anchored_blocks, ddtree_acceptance, draw_anchors
from dflash_train.training.config import RunConfig
from dflash_train.training.objective import term_names, training_loss

VAL_SEED = 1234  # validation anchors are the same at every validation and in every run


@torch.no_grad()
def validate(accelerator, drafter, target, val_ds, collate_fn, cfg: RunConfig, layer_ids, mask_id) -> dict:
    """Held-out loss and each of its terms, per-position accuracy and acceptance rate alpha, chain
    EAL and teacher-forced DDTree tau at the recipe's budgets with the on-/off-spine accuracy of
    the largest tree (path-conditioned where the variant's tree is) and the variant's own entries
    (Variant.validation_entries), with fixed anchors; each process takes every P-th conversation and
    the counts are summed, so the result does not depend on the process count."""
    drafter.eval()
    model, B = accelerator.unwrap_model(drafter), cfg.model.block_size
    rows = list(range(accelerator.process_index, len(val_ds), accelerator.num_processes))
    totals = torch.zeros(sum(count_sizes(cfg, model)), dtype=torch.float64)
    conditional = cpu_tree_scorer(model)  # a variant's path-conditioned trees are built on CPU
    # Every process runs the same number of forwards (FSDP / ZeRO-3 gather weights inside them);
    # a process out of rows repeats row 0 and counts nothing.
    bs = cfg.train.batch_size
    tree_blocks_left = cfg.eval.ddtree_max_blocks  # over the whole validation, on this process
    for i in tqdm(range(0, -(-len(val_ds) // accelerator.num_processes), bs), desc="validate",
                  leave=False, position=0,
                  disable=not accelerator.is_main_process, dynamic_ncols=True, mininterval=BAR_INTERVAL):
        chunk = rows[i : i + bs]
        batch = collate_fn([{**val_ds[r], "row": r} for r in chunk or [0]]).to(accelerator.device)
        anchors, anchor_valid = draw_anchors(batch, cfg.eval.num_anchors, VAL_SEED, 0)
        with accelerator.autocast():
            o = anchored_blocks(model, target, batch, anchors, anchor_valid, layer_ids, B, mask_id)
            loss_sum, m = training_loss(o, target, model, cfg, normalizer=1.0)
            if not chunk:
                continue
            tree, tree_blocks_left = tree_counts(model, target, o, m["labels"], conditional, cfg,
                                                 tree_blocks_left)
        totals += chunk_counts(model, o, m, loss_sum, tree, cfg)
    totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu()
    drafter.train()
    return validation_result(totals, cfg, model)


def count_sizes(cfg: RunConfig, model) -> list[int]:
    """The parts of validation's summable counts: loss and term numerators and the divisor;
    acceptance counts; tree counts per budget, blocks and on-/off-spine hits and nodes; the
    variant's own (Variant.validation_counts)."""
    T, K = len(term_names(cfg)), cfg.model.block_size - 1
    return [1 + T + 1, 3 * K + 2, len(cfg.eval.ddtree_budgets) + 1 + 4,
            model.variant.validation_count_size(model, cfg)]


def tree_counts(model, target, o: BlockOutputs, block_labels, conditional, cfg: RunConfig,
                blocks_left: int) -> tuple[torch.Tensor, int]:
    """Teacher-forced trees from the drafter's block distributions (the backbone's; path-conditioned
    by the variant's scorer `conditional`, if any), a chunk of blocks at a time, on at most
    `blocks_left` of the batch's blocks -> (summable tree counts, blocks left)."""
    budgets, K = cfg.eval.ddtree_budgets, cfg.model.block_size - 1
    flat = [x.flatten(0, 1)[:blocks_left] for x in (o.draft_hidden, block_labels, o.valid)]
    if conditional is not None:
        flat += [x.flatten(0, 1)[:blocks_left] for x in (o.block_hidden, o.bonus, o.before)]
    blocks_left -= len(flat[0])
    n = max(1, cfg.loss.chunk_slots // K if cfg.loss.chunk_slots else len(flat[0]))
    tree = torch.zeros(count_sizes(cfg, model)[2], dtype=torch.float64)
    for j in range(0, len(flat[0]), n):
        hidden, labels, valid, *path_inputs = (x[j : j + n] for x in flat)
        tree += ddtree_acceptance(model.full_logits(hidden, target.lm_head).float().cpu(), labels.cpu(),
                                  valid.cpu(), budgets, n,
                                  conditional, *(x.float().cpu() if x.is_floating_point() else x.cpu()
                                               for x in path_inputs))
    return tree, blocks_left


def chunk_counts(model, o: BlockOutputs, m: dict, loss_sum, tree, cfg: RunConfig) -> torch.Tensor:
    """One validation batch's summable counts, laid out as count_sizes() says."""
    return torch.cat([torch.stack([loss_sum.double().cpu(), *m["terms"].double().cpu(),
                                   loss_divisor(o.valid, cfg.loss).double().cpu()]),
                      acceptance_counts(m["correct"], m["valid"], m["alpha"]).cpu(), tree,
                      model.variant.validation_counts(o, m)])


def validation_result(totals: torch.Tensor, cfg: RunConfig, model) -> dict:
    """The counts summed over processes -> validate()'s result (the variant's entries last)."""
    budgets = cfg.eval.ddtree_budgets
    T = len(term_names(cfg))
    head, counts, tree, variant = totals.split(count_sizes(cfg, model))
    divisor = head[1 + T].clamp(min=1e-8)
    blocks = max(tree[len(budgets)].item(), 1.0)
    on_hit, on_n, off_hit, off_n = tree[len(budgets) + 1:].tolist()
    out = {"loss": (head[0] / divisor).item(),
           "terms": {name: (head[1 + t] / divisor).item() for t, name in enumerate(term_names(cfg))},
           **acceptance_metrics(counts),
           "ddtree_tau": {str(b): 1.0 + tree[j].item() / blocks for j, b in enumerate(budgets)},
           "on_spine_acc": on_hit / on_n if on_n else None,
           "off_spine_acc": off_hit / off_n if off_n else None, "off_spine_nodes": int(off_n)}
    return {**out, **model.variant.validation_entries(variant, cfg)}


def cpu_tree_scorer(model):
    """For validation's path-conditioned trees: (block hidden [B, H], bonus, before=None) -> the block's
    scorer over a CPU float32 copy of the variant's head (gathered from its shards under FSDP, so every
    process calls this; Variant.cpu_tree_scorer); None for the marginal tree."""
    return model.variant.cpu_tree_scorer(model)


def validation_record(val: dict, variant) -> dict:
    """validate()'s result -> the val_* keys of a metrics record (the variant's last,
    Variant.validation_record)."""
    record = {"val_loss": round(val["loss"], 6), "val_eal": round(val["eal"], 4),
              "val_terms": {name: round(v, 6) for name, v in val["terms"].items()},
              "val_acc_per_position": [round(a, 4) for a in val["acc_per_position"]],
              "val_alpha_per_position": [round(a, 4) for a in val["alpha_per_position"]],
              "val_ddtree_tau": {b: round(t, 4) for b, t in val["ddtree_tau"].items()},
              **{f"val_{k}": None if val[k] is None else round(val[k], 4)
                 for k in ("on_spine_acc", "off_spine_acc")}}
    return {**record, **variant.validation_record(val)}
