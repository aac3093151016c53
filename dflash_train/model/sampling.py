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


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One independent draw from each row of probs [n, V] (CPU, rows summing to ~1) -> [n] token ids.

    Inverts each row's CDF: u ~ U[0, 1) times the row's total, then the first index whose float64 running
    sum exceeds it, so a token of probability 0 is never drawn. Why not torch.multinomial: on a CPU it
    costs ~1.2 ms a row at SmolLM2's 49,152 tokens (a DDTree@3 verify samples 4 rows: ~4.9 ms of a ~65 ms
    round at temperature 1), this ~0.1 ms (benchmarks/results/sampling.json). A row at a time: one cumsum
    over all [n, V] at once took 4-10 ms at some row counts here (8, 17), a row at a time never."""
    u = torch.rand(probs.shape[0], generator=generator, dtype=torch.float64)
    out = torch.empty(probs.shape[0], dtype=torch.long)
    for i, row in enumerate(probs):
        cdf = torch.cumsum(row, 0, dtype=torch.float64)
        j = int(torch.searchsorted(cdf, u[i:i + 1] * cdf[-1:], right=True))
        # u * total rounded up to the total (u within ~1e-16 of 1): the last token that has probability
        out[i] = j if j < len(cdf) else int(torch.nonzero(row)[-1])
    return out
