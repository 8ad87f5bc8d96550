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


# Rows (the product of x's leading dims, static per shape) for which the native f32 product runs on CPU, measured
# against XLA:CPU's dot on SmolLM2's 120 per-token products (2-core Xeon, one process): 3 rows 0.75x its time, 9 rows
# 0.75x, 17 rows 0.85x, 33 rows 1.07x; one row is XLA's at its memory floor (1.03x a reduction over the weights).
F32_NATIVE_ROWS = (2, 24)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w. With f32 `x` and bf16 `w`: on CPU the native kernel reads `w` as bf16 (`native.matmul.matmul_bf16`);
    elsewhere a bf16 x bf16 -> f32 dot. With f32 `x` and `w` on CPU, for `F32_NATIVE_ROWS` rows (a verify block's),
    the native f32 product (`native.matmul.matmul_f32`), where it measured faster. Any other case: `x @ w` unchanged.
    The choice depends on the shape only, so one shape always takes one path (a row's bits then depend on the call's
    shape, as with XLA's dot, and never on the other rows' values)."""
    if x.dtype == jnp.float32 and w.dtype == jnp.float32 and w.ndim == 2:
        rows = x.size // max(x.shape[-1], 1)
        if (F32_NATIVE_ROWS[0] <= rows <= F32_NATIVE_ROWS[1] and jax.default_backend() == "cpu"
                and native.available()):
            from pallas_kernels.native.matmul import matmul_f32  # noqa: PLC0415 - only where the library built

            return matmul_f32(x, w)
        return x @ w
    if w.dtype != jnp.bfloat16 or x.dtype != jnp.float32:
        return x @ w
    if jax.default_backend() == "cpu" and native.available():
        from pallas_kernels.native.matmul import matmul_bf16  # noqa: PLC0415 - only where the library built

        return matmul_bf16(x, w)
    return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
