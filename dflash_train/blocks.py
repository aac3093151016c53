"""The anchored-block pass shared by training and validation, and teacher-forced DDTree acceptance.

For a batch [b, T]: anchors [b, A] (block j = [token at anchor j, MASK x (B-1)]), the target's
taps (online forward or offline cache), one drafter pass over all A*B block tokens, and for
every drafted slot k = 1..B-1 the drafter's hidden state, the target's hidden state that
predicts the same token, the data's token there, and whether the slot counts (inside the
sequence, on an assistant token, anchor valid). Both go through the target's LM head in the
loss, chunk by chunk (dflash_train/loss.py): [b, A, K, V] logits are never built whole.
"""

from dataclasses import dataclass

import torch

from dflash_train.data import Batch, anchor_keys, block_labels_index, sample_anchors
from dflash_train.ddtree import build_tree
from dflash_train.hs_cache import HiddenStateCache
from dflash_train.target import Target, target_forward


@dataclass
class BlockOutputs:
    draft_hidden: torch.Tensor  # [b, A, K, H], K = B-1 drafted slots; logits = target.lm_head(.)
    target_hidden: torch.Tensor  # [b, A, K, H], the target's final-normed state predicting the same tokens
    tokens: torch.Tensor  # [b, A, K], the data's token at each slot
    valid: torch.Tensor  # [b, A, K] bool
    bonus: torch.Tensor | None = None  # [b, A] the anchor (bonus) token of each block (slot 0)


def draw_anchors(batch: Batch, num_anchors: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors [b, A] and their validity, drawn per dataset row (see data.anchor_keys)."""
    lengths = batch.attention_mask.sum(1).tolist()
    keys = anchor_keys(batch.rows, lengths, batch.input_ids.shape[1], seed, step)
    return sample_anchors(batch.loss_mask, num_anchors, keys)


def block_slots(batch: Batch, anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int):
    """Slot k of block j predicts token anchors[j] + k: its position [b, A, K] and validity."""
    b, T = batch.input_ids.shape
    pos, inside = block_labels_index(anchors, block_size, T)
    valid = inside & batch.loss_mask.gather(1, pos.flatten(1)).view(pos.shape) & anchor_valid[..., None]
    return pos, valid


def anchored_blocks(drafter, target: Target, batch: Batch, anchors, anchor_valid, layer_ids: list[int],
                    block_size: int, mask_id: int, cache: HiddenStateCache | None = None) -> BlockOutputs:
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
        pos, valid = block_slots(batch, anchors, anchor_valid, block_size)  # [b, A, K]
        # The target's distribution for the token at a+k is its output at a+k-1.
        H = last.shape[-1]
        t_hidden = last.gather(1, (pos - 1).flatten(1)[..., None].expand(-1, -1, H)).view(b, A, K, H)
        tokens = ids.gather(1, pos.flatten(1)).view(b, A, K)
    hidden = drafter(block_embeds, taps, anchors, batch.attention_mask.bool())  # [b, A*B, H]
    # slots 1..B-1, made contiguous: the LM head is then one matmul per chunk, not A small batched ones
    hidden = hidden.view(b, A, block_size, -1)[:, :, 1:].contiguous()
    return BlockOutputs(hidden, t_hidden, tokens, valid, block_ids[:, :, 0])


def ddtree_acceptance(draft_logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, budgets: list[int],
                      max_blocks: int) -> torch.Tensor:
    """Teacher-forced DDTree acceptance: per block, the tree from the drafter's slot
    distributions, walked along the target's tokens (labels) while they are in the tree.
    Returns summable counts [len(budgets) + 1]: accepted tokens per budget, then blocks."""
    logits = draft_logits.reshape(-1, *draft_logits.shape[-2:])[: max_blocks]  # [N, K, V]
    labels = labels.reshape(-1, labels.shape[-1])[: max_blocks].tolist()
    valid = valid.reshape(-1, valid.shape[-1])[: max_blocks].tolist()
    # Nodes are numbered in best-first pop order, so the tree of budget b is exactly the nodes
    # 1..b of the largest tree: build that once and count, per budget, the path nodes <= b.
    counts = torch.zeros(len(budgets) + 1, dtype=torch.float64)
    for i, (lab, ok) in enumerate(zip(labels, valid)):
        if not ok[0] or not budgets:
            continue
        counts[-1] += 1
        tree, cur, path = build_tree(logits[i], max(budgets)), 0, []
        for tok, v in zip(lab, ok):
            if not v or tok not in tree.children[cur]:
                break
            cur = tree.children[cur][tok]
            path.append(cur)  # increasing indices along the path
        for j, budget in enumerate(budgets):
            counts[j] += sum(1 for node in path if node <= budget)
    return counts
