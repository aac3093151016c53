"""Exact reference distributions for the lossless-sampling tests, by enumeration."""

import torch


@torch.no_grad()
def next_two_marginals(model, prompt: torch.Tensor, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own distribution of the 2nd and 3rd sampled tokens after `prompt` [1, P] at
    temperature 1, summed exactly over every first (and second) token: (p2 [V], p3 [V]) in float64."""
    p1 = torch.softmax(model(prompt).logits[0, -1].double(), -1)
    p2, p3 = torch.zeros(V, dtype=torch.float64), torch.zeros(V, dtype=torch.float64)
    for a in range(V):
        after_a = torch.cat([prompt, torch.tensor([[a]])], 1)
        pa = p1[a] * torch.softmax(model(after_a).logits[0, -1].double(), -1)
        p2 += pa
        for b in range(V):
            seq = torch.cat([prompt, torch.tensor([[a, b]])], 1)
            p3 += pa[b] * torch.softmax(model(seq).logits[0, -1].double(), -1)
    return p2, p3
