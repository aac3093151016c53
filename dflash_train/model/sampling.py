"""Sampling probabilities at a temperature, shared by the decoder (decoding/decode.py choose) and the
regeneration engine (data/engine.py pick)."""

import torch


def tempered_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) over the last dim, in float32, for temperature > 0.

    Shifted by the row's max before dividing, and the divisor kept a nonzero float32: the same numbers
    wherever logits / temperature fits a float, and the argmax row (not inf - inf or 0 / 0 = nan) as
    temperature -> 0."""
    logits = logits.float()
    tempered = (logits - logits.amax(-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)
    return torch.softmax(tempered, dim=-1)
