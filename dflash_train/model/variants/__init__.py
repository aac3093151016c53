"""The drafter variants by DrafterConfig.variant: plain DFlash (base.py, what the package asks of a
variant) and what DSpark (dspark.py), DFlash2 (dflash2.py) and XPress (xpress.py) add to it."""

from typing import Literal

from dflash_train.model.variants.base import Variant
from dflash_train.model.variants.dflash2 import DFlash2
from dflash_train.model.variants.dspark import DSpark
from dflash_train.model.variants.xpress import XPress

VARIANTS: dict[str, Variant] = {"dflash": Variant(), "dspark": DSpark(), "dflash2": DFlash2(),
                                "xpress": XPress()}

# The `variant` key of recipes and config.json: one of VARIANTS (one line listing them when it is not)
VariantName = Literal[tuple(VARIANTS)]


def variant_bases(part: str) -> tuple[type, ...]:
    """The variants' `part` classes (Variant.model_keys, loss_keys, drafter_keys or speculators_keys), as
    the first bases of the class that gathers them, before its core class: pydantic and dataclasses take
    fields from the last base first, so the variants' keys follow the core's, in registry order."""
    return tuple(reversed([keys for v in VARIANTS.values() if (keys := getattr(v, part)) is not None]))
