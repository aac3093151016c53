"""DFlash2 drafters for tests: the config and non-trivial random weights."""

import torch

from dflash_train.training.build import drafter_config_for
from dflash_train.training.config import ModelConfig

B = 8


def dflash2_config(target, **kw):
    return drafter_config_for(target, ModelConfig(variant="dflash2", num_layers=2, block_size=B,
                                                  selector_rank=16, selector_top_k=8, **kw))


def randomize(drafter, seed=0):
    """Non-trivial weights everywhere (norms, convolutions and selector included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            scale = 0.3 if "conv" in name else (0.2 if p.ndim > 1 else 1.0)
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if "norm" in name
                                                                 and p.ndim == 1 else 0.0))
    return drafter
