"""Products with bf16 weights, dispatched like the attention kernels: what a draft with bf16 weights
(`kvjax.decode.draft_weights`) multiplies by."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import native


def bf16_weights_supported() -> tuple[bool, str]:
    """(whether bf16 weights are read without an f32 copy on the default backend, why not). CPU: the native kernel
    (`pallas_kernels.native`); XLA:CPU itself converts a bf16 matrix to f32 before multiplying (measured ~10x slower
    than the f32 product). GPU/TPU: XLA's bf16 dot."""
    if jax.default_backend() != "cpu":
        return True, ""
    if native.available():
        return True, ""
    return False, f"the native CPU kernel is not available ({native.status()['reason']})"


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w. With f32 `x` and bf16 `w`: on CPU the native kernel reads `w` as bf16 (`native.matmul.matmul_bf16`);
    elsewhere a bf16 x bf16 -> f32 dot. Any other dtypes: `x @ w` unchanged."""
    if w.dtype != jnp.bfloat16 or x.dtype != jnp.float32:
        return x @ w
    if jax.default_backend() == "cpu" and native.available():
        from pallas_kernels.native.matmul import matmul_bf16  # noqa: PLC0415 - only where the library built

        return matmul_bf16(x, w)
    return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
