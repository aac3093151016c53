"""Seeds: the range a user may give (recipe `seed`, dflash-prepare and dflash-eval --seed), and torch
generators for seeds derived from one (user seed x step x row products)."""

import torch

SEED_LIMIT = 2**32  # user seeds are 0 .. 2**32 - 1 everywhere


def derived_generator(seed: int) -> torch.Generator:
    """A CPU generator for a derived seed, reduced mod 2**63: torch's seed is 64-bit, so big products
    would overflow; the same draws wherever the seed already fit."""
    return torch.Generator().manual_seed(seed % 2**63)
