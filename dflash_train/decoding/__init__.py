"""Speculative decoding: the draft tree (DDTree) and the one loop for AR, the chain and DDTree."""
