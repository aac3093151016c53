"""Inputs to training: chat data and its loss masks, regeneration, the hidden-state cache, the real target."""
