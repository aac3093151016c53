"""Anchor sampling, the anchored-block pass shared by training and validation, teacher-forced DDTree
acceptance.

For a batch [b, T]: anchors [b, A] (block j = [token at anchor j, MASK x (B-1)]), the target's
taps (online forward or offline cache), one drafter pass over all A*B block tokens, and for
every drafted slot k = 1..B-1 the drafter's hidden state, the target's hidden state that
predicts the same token, the data's token there, and whether the slot counts (inside the
sequence, on an assistant token, anchor valid). Both go through the target's LM head in the
loss, chunk by chunk (dflash_train/model/loss.py): [b, A, K, V] logits are never built whole.
A variant's heads run on the true previous tokens (teacher forcing, `Variant.teacher_forced`); what they
give comes along for the variant's own loss terms (a low-rank logit bias u . w2^T is added in the loss's
chunks, `Variant.logit_bias`).
"""

from dataclasses import dataclass, field

import torch
from accelerate.utils import extract_model_from_parallel

from dflash_train.core.seeds import derived_generator
from dflash_train.data.dataset import Batch
from dflash_train.data.hs_cache import HiddenStateCache
from dflash_train.decoding.ddtree import build_tree, spine_counts
from dflash_train.model.target import Target, target_forward


@dataclass
class BlockOutputs:
    draft_hidden: torch.Tensor  # [b, A, K, H], K = B-1 drafted slots; logits = target.lm_head(.)
    target_hidden: torch.Tensor  # [b, A, K, H], the target's final-normed state predicting the same tokens
    tokens: torch.Tensor  # [b, A, K], the data's token at each slot
    valid: torch.Tensor  # [b, A, K] bool
    # what the variant's heads give on the true previous tokens (Variant.teacher_forced; {} for DFlash),
    # read by the variant's own methods only
    heads: dict = field(default_factory=dict)
    # [b, A, B, H] every slot's state (slot 0 too: a variant's head may read it)
    block_hidden: torch.Tensor | None = None
    bonus: torch.Tensor | None = None  # [b, A] the anchor (bonus) token of each block
    # [b, A] the token before each anchor (the anchor itself at position 0)
    before: torch.Tensor | None = None
    # the target's greedy token at each slot, from a cache that stores it (None: not read; see target_labels)
    cached_labels: torch.Tensor | None = None  # [b, A, K] long


def target_labels(o: BlockOutputs, target: Target, rows: int = 1024) -> torch.Tensor:
    """The target's greedy token at each slot [b, A, K]: from the cache, else argmax of its LM head
    over the full vocabulary (no grad, `rows` slots at a time: only a draft vocabulary's step asks)."""
    if o.cached_labels is not None:
        return o.cached_labels
    with torch.no_grad():
        flat = o.target_hidden.flatten(0, -2)
        out = torch.cat([target.lm_head(flat[i : i + rows]).argmax(-1) for i in range(0, len(flat), rows)])
    return out.view(o.target_hidden.shape[:-1])


def anchor_keys(rows: list[int], lengths: list[int], T: int, seed: int, step: int) -> torch.Tensor:
    """Uniform random keys [b, T] for anchor sampling, a row's keys drawn from its own generator
    seeded by (seed, step, dataset row): a sequence gets the same anchors whichever process or
    micro-batch it lands in, so runs with other process counts or padding see the same blocks."""
    keys = torch.full((len(rows), T), -1.0)
    for i, (row, n) in enumerate(zip(rows, lengths)):
        g = derived_generator((seed * 1_000_003 + step) * 10_000_019 + row)
        keys[i, :n] = torch.rand(n, generator=g)
    return keys


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int,
                   keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors among assistant tokens: a is a candidate when token a+1 is supervised
    (block slot 1 predicts it). keys [b, T] uniform in [0, 1) (see anchor_keys); the A
    candidates with the largest keys are a uniform sample without replacement.
    Returns anchors [b, A] (sorted, 0 where unused) and valid [b, A]."""
    b, T = loss_mask.shape
    cand = torch.zeros_like(loss_mask)
    cand[:, :-1] = loss_mask[:, 1:]
    keys = torch.where(cand, keys.to(loss_mask.device), torch.full_like(keys, -1.0, device=loss_mask.device))
    A = min(num_anchors, T)
    top, idx = keys.topk(A, dim=1)
    valid = top >= 0
    anchors = torch.where(valid, idx, torch.zeros_like(idx))
    order = torch.argsort(torch.where(valid, anchors, torch.full_like(anchors, T)), dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def block_labels_index(anchors: torch.Tensor, block_size: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For block slots k = 1..B-1: the predicted token's position a+k [b, A, B-1] and
    whether it is inside the sequence. The target's distribution for it sits at a+k-1."""
    k = torch.arange(1, block_size, device=anchors.device)
    pos = anchors[:, :, None] + k  # [b, A, B-1]
    inside = pos < T
    return pos.clamp(max=T - 1), inside


def draw_anchors(batch: Batch, num_anchors: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors [b, A] and their validity, drawn per dataset row (see anchor_keys)."""
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
    """One target pass (or a cache read) and one drafter pass over every anchored block of the batch,
    then the variant's heads on the true previous tokens."""
    ids = batch.input_ids
    b, T = ids.shape
    A, K = anchors.shape[1], block_size - 1
    with torch.no_grad():
        labels = None  # the target's greedy token after each position, when the cache stores it
        if cache is None:
            taps, last = target_forward(target, ids, batch.attention_mask, layer_ids)
        else:
            taps, last = cache.batch(batch.rows, T, ids.device, target.embed.weight.dtype)
            labels = cache.labels(batch.rows, T, ids.device)
        block_ids = torch.full((b, A, block_size), mask_id, dtype=torch.long, device=ids.device)
        block_ids[:, :, 0] = ids.gather(1, anchors)  # slot 0: the anchor (bonus) token
        block_embeds = target.embed(block_ids.view(b, A * block_size))
        pos, valid = block_slots(batch, anchors, anchor_valid, block_size)  # [b, A, K]
        # The target's distribution for the token at a+k is its output at a+k-1.
        H = last.shape[-1]
        t_hidden = last.gather(1, (pos - 1).flatten(1)[..., None].expand(-1, -1, H)).view(b, A, K, H)
        tokens = ids.gather(1, pos.flatten(1)).view(b, A, K)
        if labels is not None:
            labels = labels.gather(1, (pos - 1).flatten(1)).view(b, A, K)
    block_hidden = drafter(block_embeds, taps, anchors,
                           batch.attention_mask.bool()).view(b, A, block_size, -1)
    # slots 1..B-1, made contiguous: the LM head is then one matmul per chunk, not A small batched ones
    hidden = block_hidden[:, :, 1:].contiguous()
    model = extract_model_from_parallel(drafter)  # the DDP / DeepSpeed wrapper has no heads
    # [b, A, B] the true tokens at slots 0..B-1
    block_tokens = torch.cat([block_ids[:, :, :1], tokens], dim=2)
    # the token before each anchor (a variant's slot 0 may read it; rows are single right-padded sequences)
    before = torch.where(anchors > 0, ids.gather(1, (anchors - 1).clamp(min=0)), block_ids[:, :, 0])
    heads = model.variant.teacher_forced(model, block_hidden, block_tokens, before)
    return BlockOutputs(hidden, t_hidden, tokens, valid, heads=heads, block_hidden=block_hidden,
                        bonus=block_ids[:, :, 0], before=before, cached_labels=labels)


def ddtree_acceptance(draft_logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                      budgets: list[int], max_blocks: int, conditional=None,
                      hidden: torch.Tensor | None = None, bonus: torch.Tensor | None = None,
                      before: torch.Tensor | None = None) -> torch.Tensor:
    """Teacher-forced DDTree acceptance: per block, the tree from the drafter's slot
    distributions, walked along the target's tokens (labels) while they are in the tree.
    With `conditional` (block hidden [B, H], bonus, before: the token before it) -> scorer
    (Variant.cpu_tree_scorer), draft_logits are the backbone's and the tree is path-conditioned, on
    hidden [.., B, H] and the bonus tokens [..].
    Returns summable counts [len(budgets) + 1 + 4]: accepted tokens per budget, blocks, then
    the spine counts of the largest tree (ddtree.spine_counts: on-spine hits, nodes, off-spine
    hits, nodes)."""
    logits = draft_logits.reshape(-1, *draft_logits.shape[-2:])[: max_blocks]  # [N, K, V]
    labels = labels.reshape(-1, labels.shape[-1])[: max_blocks].tolist()
    valid = valid.reshape(-1, valid.shape[-1])[: max_blocks].tolist()
    if conditional is not None:
        hidden = hidden.reshape(-1, *hidden.shape[-2:])[: max_blocks]  # [N, B, H]
        bonus = bonus.reshape(-1)[: max_blocks].tolist()
        before = None if before is None else before.reshape(-1)[: max_blocks].tolist()
    # Nodes are numbered in best-first pop order, so the tree of budget b is exactly the nodes
    # 1..b of the largest tree: build that once and count, per budget, the path nodes <= b.
    counts = torch.zeros(len(budgets) + 1 + 4, dtype=torch.float64)
    for i, (lab, ok) in enumerate(zip(labels, valid)):
        if not ok[0] or not budgets:
            continue
        counts[len(budgets)] += 1
        scorer = None if conditional is None else conditional(hidden[i], bonus[i],
                                                              None if before is None else before[i])
        tree, cur, path = build_tree(logits[i], max(budgets), scorer), 0, []
        for tok, v in zip(lab, ok):
            if not v or tok not in tree.children[cur]:
                break
            cur = tree.children[cur][tok]
            path.append(cur)  # increasing indices along the path
        for j, budget in enumerate(budgets):
            counts[j] += sum(1 for node in path if node <= budget)
        # the target's token after the node at depth d is label d+1 (when valid)
        nxt = [lab[d] if d < len(lab) and ok[d] else None for d in range(1, len(path) + 1)]
        counts[len(budgets) + 1:] += torch.tensor(spine_counts(tree, path, nxt), dtype=torch.float64)
    return counts

