"""Jit-compiled decoding steps and the loops built on them."""
