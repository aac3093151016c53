"""Helpers that several test files share (tests/ is on pytest's pythonpath: `from helpers.x import y`).

A test file never imports another test file: what two of them need lives here, one module per
subject, and fixtures stay in conftest.py."""


class Captured(Exception):
    """Raised from inside speculators' forward once its logits are known (its loss needs Triton)."""
