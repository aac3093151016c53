"""Training a drafter: the recipe, the trainer (objective, validation, output folder, resume), anchored
blocks, engines, tree distillation."""
