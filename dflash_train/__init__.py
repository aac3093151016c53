"""dflash-train: train, export and evaluate DFlash drafters for speculative decoding."""

__version__ = "0.1.0"
