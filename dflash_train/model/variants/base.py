"""Plain DFlash as a variant, and what the rest of the package asks of one.

A variant is one object of `VARIANTS` (model/variants/__init__.py), named by DrafterConfig.variant and
reached as `drafter.variant`. DSpark (dspark.py) and DFlash2 (dflash2.py) override what they change;
everything here is DFlash's: no modules beyond the backbone, each slot's argmax as the chain, DDTree
from the backbone's marginals, no fields of its own.

    decoding      chain, states_confidence, scorer
    drafter       conv, add_modules
"""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class ChainDraft:
    """One block's greedy chain."""
    tokens: torch.Tensor  # [B-1] long, the drafted slots 1..B-1
    confidence: torch.Tensor | None = None  # [B-1] acceptance logits (DSpark's confidence head), or None


class Variant:
    name = "dflash"

    # --- decoding ---------------------------------------------------------------------------------

    def chain(self, drafter, hidden: torch.Tensor, base_logits: torch.Tensor, bonus: int) -> ChainDraft:
        """The greedy chain of one block: hidden [B, H] the drafter's final-normed states (slot 0: the
        bonus token's), base_logits [B-1, V] the backbone's (-inf outside a draft vocabulary).
        DFlash: every slot's argmax, drafted independently."""
        return ChainDraft(base_logits.argmax(-1))

    def states_confidence(self, drafter) -> bool:
        """Whether `chain` states each slot's acceptance (decoding then tabulates it against the target)."""
        return False

    def scorer(self, drafter, hidden: torch.Tensor, bonus: int):
        """The path-conditioned children of this block's DDTree (for `ddtree.build_tree`), from hidden
        [B, H]; None: the tree from the backbone's marginals."""
        return None

    # --- the drafter's modules ----------------------------------------------------------------------

    def conv(self, config) -> tuple[int, int, int] | None:
        """Each decoder layer's local convolutions as (block_size, kernel_size, group_size); None: none."""
        return None

    def add_modules(self, drafter: nn.Module, config) -> None:
        """Add this variant's modules to a drafter whose backbone is built and initialised."""
