"""The drafter variants by DrafterConfig.variant: plain DFlash (base.py, what the package asks of a
variant) and what DSpark (dspark.py), DFlash2 (dflash2.py) and XPress (xpress.py) add to it."""

from dflash_train.model.variants.base import Variant
from dflash_train.model.variants.dflash2 import DFlash2
from dflash_train.model.variants.dspark import DSpark
from dflash_train.model.variants.xpress import XPress

VARIANTS: dict[str, Variant] = {"dflash": Variant(), "dspark": DSpark(), "dflash2": DFlash2(),
                                "xpress": XPress()}
