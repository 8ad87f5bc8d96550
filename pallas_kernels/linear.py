"""Products with low-precision weights, dispatched like the attention kernels: what a draft with bf16 or int8 weights
(`kvjax.decode.draft_weights`) multiplies by.

Weights are a plain bf16 `[K, N]` array or an `Int8Weight` (int8 codes `[K, N]` and one f32 scale per output column:
w ~ codes * scale, symmetric, scale = max |w[:, n]| / 127 -- per-channel weight quantization as in LLM.int8's
vector-wise scheme, arXiv 2208.07339, without its outlier split: drafts only need to be good, verification is exact).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import native


class Int8Weight(NamedTuple):
    """A `[K, N]` weight as int8 codes and f32 scales `[N]` (w ~ codes * scale[None, :]); a pytree, so jit takes it."""

    codes: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes


def quantize_int8(w: jax.Array) -> Int8Weight:
    """`w [K, N]` as int8 codes with one scale per output column: scale = max |w[:, n]| / 127 (1 for an all-zero
    column), code = round(w / scale) in [-127, 127]."""
    if w.ndim != 2:
        raise ValueError(f"quantize_int8 needs a [K, N] weight, got shape {w.shape}")
    w = jnp.asarray(w, jnp.float32)
    top = jnp.max(jnp.abs(w), axis=0)
    scale = jnp.where(top > 0, top / 127.0, 1.0)
    codes = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return Int8Weight(codes, scale.astype(jnp.float32))


def dequantize_int8(w: Int8Weight) -> jax.Array:
    """The f32 `[K, N]` weight an `Int8Weight` stands for."""
    return w.codes.astype(jnp.float32) * w.scale


def bf16_weights_supported() -> tuple[bool, str]:
    """(whether bf16 weights are read without an f32 copy on the default backend, why not). CPU: the native kernel
    (`pallas_kernels.native`); XLA:CPU itself converts a bf16 matrix to f32 before multiplying (measured ~10x slower
    than the f32 product). GPU/TPU: XLA's bf16 dot. The same holds for int8 codes (`Int8Weight`)."""
    if jax.default_backend() != "cpu":
        return True, ""
    if native.available():
        return True, ""
    return False, f"the native CPU kernel is not available ({native.status()['reason']})"


# f32 weights: calls of this many rows (inclusive) take the native product's register tiles on CPU (`native/matmul.cc`);
# one row (decode) and prefill chunks keep XLA's dot. Measured, SmolLM2's verify at 8K in one process: 9 and 17 rows
# 0.90-0.93x XLA's time.
F32_NATIVE_ROWS = (2, 64)


def linear(x: jax.Array, w) -> jax.Array:
    """x @ w. With f32 `x` and a bf16 `w` or an `Int8Weight`: on CPU the native kernel reads the weights as stored
    (`native.matmul.matmul_bf16` / `matmul_int8`); elsewhere a bf16 dot with f32 results (int8 codes are exact in
    bf16), times the scales for int8. f32 `x` and `w` [K, N] with `F32_NATIVE_ROWS` rows: on CPU the native f32 product
    (a verify block's rows; each row's bits independent of the others). Anything else: `x @ w` unchanged."""
    native_cpu = jax.default_backend() == "cpu" and native.available()
    if isinstance(w, Int8Weight):
        if native_cpu and x.dtype == jnp.float32:
            from pallas_kernels.native.matmul import matmul_int8  # noqa: PLC0415 - only where the library built

            return matmul_int8(x, w.codes, w.scale)
        y = jnp.dot(x.astype(jnp.bfloat16), w.codes.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        return y * w.scale
    if (native_cpu and w.dtype == jnp.float32 and x.dtype == jnp.float32 and w.ndim == 2
            and F32_NATIVE_ROWS[0] <= math.prod(x.shape[:-1]) <= F32_NATIVE_ROWS[1]):
        from pallas_kernels.native.matmul import matmul_f32  # noqa: PLC0415 - only where the library built

        return matmul_f32(x, w)
    if w.dtype != jnp.bfloat16 or x.dtype != jnp.float32:
        return x @ w
    if native_cpu:
        from pallas_kernels.native.matmul import matmul_bf16  # noqa: PLC0415 - only where the library built

        return matmul_bf16(x, w)
    return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
