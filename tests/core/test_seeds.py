"""core/seeds.py: a derived seed (user seed x step x row products) may pass torch's 64-bit range; it is
reduced mod 2**63, so it never fails and a seed that already fit draws as torch's own seed would."""

import torch

from dflash_train.core.seeds import SEED_LIMIT, derived_generator


def draws(generator: torch.Generator) -> torch.Tensor:
    return torch.rand(8, generator=generator)


def test_a_seed_that_fits_draws_as_torch_seeds_it():
    for seed in [0, 1, SEED_LIMIT - 1, 2**63 - 1]:
        assert torch.equal(draws(derived_generator(seed)), draws(torch.Generator().manual_seed(seed)))


def test_a_product_past_64_bits_is_reduced_not_refused():
    seed = (SEED_LIMIT - 1) ** 3  # ~2**96: torch.Generator().manual_seed would raise
    reference = torch.Generator().manual_seed(seed - (seed // 2**63) * 2**63)
    assert torch.equal(draws(derived_generator(seed)), draws(reference))
    assert not torch.equal(draws(derived_generator(seed)), draws(derived_generator(seed + 1)))
    assert torch.equal(draws(derived_generator(2**63 + 5)), draws(derived_generator(5)))
