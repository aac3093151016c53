"""Training a drafter: the recipe, the trainer, anchored blocks, engines, tree distillation."""
