"""DFlash loss and acceptance metrics: pure functions, tensors in, (loss, metrics) out.

Block slot k (1..B-1) predicts the token k places after the anchor. Its loss weighs
w_k = exp(-(k-1)/gamma) (early slots matter most: a miss at k ends acceptance there),
normalised by the sum of weights over valid slots.
"""

import torch
import torch.nn.functional as F


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[B-1] weights for slots k = 1..B-1."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def slot_weights(valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """valid [b, A, K] bool -> the loss weight of every slot [b, A, K] (0 where invalid)."""
    return position_weights(valid.shape[-1] + 1, gamma, valid.device) * valid


def dflash_loss(draft_logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, gamma: float,
                ce_weight: float = 1.0, kl_weight: float = 0.0, target_logits: torch.Tensor | None = None,
                normalizer: torch.Tensor | float | None = None) -> tuple[torch.Tensor, dict]:
    """draft_logits [b, A, K, V] for slots 1..K (K = B-1); labels [b, A, K] long;
    valid [b, A, K] bool; target_logits [b, A, K, V] (needed when kl_weight > 0).
    Returns sum(w * loss) / normalizer (default: this batch's sum(w), the weighted mean) and
    detached tensors for `acceptance_counts`. Training passes the weight sum of the whole
    optimizer step (all micro-batches, all processes), so the step's loss is one weighted
    mean whatever the split across processes and accumulation."""
    logp = F.log_softmax(draft_logits.float(), dim=-1)
    w = slot_weights(valid, gamma)  # [b, A, K]
    per_slot = torch.zeros_like(w)
    if ce_weight:
        per_slot = per_slot + ce_weight * -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if kl_weight:
        t_logp = F.log_softmax(target_logits.float(), dim=-1)
        per_slot = per_slot + kl_weight * (t_logp.exp() * (t_logp - logp)).sum(-1)
    loss = (per_slot * w).sum() / (w.sum().clamp(min=1e-8) if normalizer is None else normalizer)
    correct = (draft_logits.argmax(-1) == labels) & valid
    return loss, {"correct": correct.detach(), "valid": valid.detach()}


def acceptance_counts(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """correct/valid [..., K] bool over blocks -> summable counts [2K + 2]:
    correct per slot, valid per slot, accepted tokens, blocks. The chain accepts slots
    1..k while every one matches the target; an invalid slot (past the response) ends it.
    Blocks count when slot 1 is valid. Counts add up across batches and processes."""
    K = correct.shape[-1]
    correct, valid = correct.reshape(-1, K), valid.reshape(-1, K)
    blocks = valid[:, 0]
    accepted = torch.cumprod((correct & valid).long(), dim=1).sum(1)
    return torch.cat([(correct & valid).sum(0), valid.sum(0), accepted[blocks].sum()[None], blocks.sum()[None]]).double()


def acceptance_metrics(counts: torch.Tensor) -> dict:
    """Per-position accuracy and the chain's expected acceptance length (EAL, the bonus token
    counted: EAL = 1 + mean accepted drafted tokens per block)."""
    K = (counts.numel() - 2) // 2
    correct, valid, accepted, blocks = counts[:K], counts[K : 2 * K], counts[-2], counts[-1]
    return {
        "eal": 1.0 + (accepted / blocks).item() if blocks > 0 else 1.0,
        "acc_per_position": (correct / valid.clamp(min=1)).tolist(),
        "blocks": int(blocks),
    }
