"""kvjax's full-cache reference decoder (the exactness contract's "full-cache decoding") and plain decoding.

`reference_step` is one full-cache decode step through the verify shape: feed [tok, pad x] (T = x + 1) through the
family's `verify_forward` and read row 0 — so every token it emits is computed by exactly the arithmetic VeriCache's
verification uses, bit for bit. Plain one-token decoding (`kvjax.decode.steps.decode`) uses a different matmul shape
and may differ in the last float bits; it is the speed baseline.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.decode import sampling


@functools.partial(jax.jit, static_argnames=("x", "temperature", "family", "impl"), donate_argnames="full")
def reference_step(params, config, full, tok: jax.Array, seed: jax.Array, *, x: int, temperature: float = 0.0,
                   family, impl: str):
    """One full-cache decode step through the verify shape.

    Returns:
        (next i32[B], row-0 logits f32[B, V], full with length + 1, the verify forward's aux).
    """
    B = tok.shape[0]
    tokens = jnp.zeros((B, x + 1), jnp.int32).at[:, 0].set(tok)
    logits, full, aux = family.verify_forward(params, config, full, tokens, jnp.ones((B,), jnp.int32),
                                              implementation=impl)
    nxt = sampling.select_tokens(logits[:, :1], full.length[:, None], seed, temperature)[:, 0]
    # aux is an output although nobody reads it: every verify-shape program then has the same outputs of the
    # forward, so XLA compiles the forward the same way in all of them (the bits of the logits depend on it)
    return nxt, logits[:, 0], full, aux
