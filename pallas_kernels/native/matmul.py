"""The native product with bf16 weights (`matmul.cc`): y f32[..., N] = x f32[..., K] @ w bf16[K, N], each weight read
once as bf16 and widened in registers (XLA:CPU would first convert `w` to an f32 copy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import native


def matmul_bf16(x: jax.Array, w: jax.Array) -> jax.Array:
    """x f32[..., K] @ w bf16[K, N] -> f32[..., N]; each output one FMA chain over k in order (no row depends on
    another row of `x`). Raises RuntimeError (naming why) where the native library is not available."""
    if not native.available():
        raise RuntimeError(f"the native matmul kernel is not available: {native.status()['reason']}")
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"matmul_bf16 needs x [..., K] and w [K, N], got {x.shape} and {w.shape}")
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[1],), jnp.float32)
    call = jax.ffi.ffi_call(native.MATMUL_TARGET, out, vmap_method="broadcast_all")
    return call(x.astype(jnp.float32), w.astype(jnp.bfloat16))
