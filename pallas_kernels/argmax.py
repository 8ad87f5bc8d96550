"""argmax over the last axis, as the dispatcher takes it: on the CPU the native kernel (`native/argmax.cc`: two vector
passes over each row), elsewhere `jnp.argmax` -- the same indices either way (each row's first maximum, or its first
NaN, which jnp.argmax counts as the largest value).

Why: XLA:CPU's argmax ran at ~3 ns per element, 0.16 ms of a SmolLM2 decode step or draft token and 0.84 ms of its
9-row verify (`scripts/bench_step_ops.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import native


def argmax(x: jax.Array) -> jax.Array:
    """i32[...]: the index of the largest value of each row of `x` [..., V] (its first maximum; a row holding a NaN:
    its first NaN) -- `jnp.argmax(x, axis=-1)`'s indices."""
    if x.dtype == jnp.float32 and x.ndim >= 1 and x.shape[-1] >= 1 and native.runs_here():
        call = jax.ffi.ffi_call(native.ARGMAX_TARGET, jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32),
                                vmap_method="broadcast_all")
        return call(x)
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
