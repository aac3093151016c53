"""The frozen target, the drafter backbone, the loss; each variant's own modules in variants/."""
