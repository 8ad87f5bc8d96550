"""Products with low-precision weights, dispatched like the attention kernels: what a draft with bf16 or int8 weights
(`kvjax.decode.draft_weights`) multiplies by.

Weights are a plain bf16 `[K, N]` array or an `Int8Weight` (int8 codes `[K, N]` and one f32 scale per output column:
w ~ codes * scale, symmetric, scale = max |w[:, n]| / 127 -- per-channel weight quantization as in LLM.int8's
vector-wise scheme, arXiv 2208.07339, without its outlier split: drafts only need to be good, verification is exact).
On CPU with the native kernel, f32 matrices and int8 codes can also be stored as 64-column panels (`PackedF32`,
`PackedInt8`): the same bits as the plain layout, read as contiguous streams by the native register tiles; an f32
matrix whose weights are all exactly bf16 values is stored in bf16 panels, the same bits at half the bytes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import native
from pallas_kernels.affine import PackedAffine, unpack_affine
from pallas_kernels.int_dot import IntDot8, IntDotCodes, int_dot8_reference, int_dot_reference


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


# f32 weights: calls of this many rows (inclusive) take the native product on CPU (`native/matmul.cc`: one row a
# streaming panel, 2-64 rows register tiles); prefill chunks keep XLA's dot. Measured in one process, SmolLM2's 120
# products of a step as a dependent chain: 1 row 23.2 ms vs XLA's 25.2 (packed 22.0), 9 rows 43.6 vs 60.8 (packed
# 31.5); the decode step with the packed loop layout 44.2 vs 49.0 ms (same tokens). One bound for both layouts keeps
# `PackedF32` giving the plain matrix's bits.
F32_NATIVE_ROWS = (1, 64)

PANEL = 64  # columns per panel of a `PackedF32` / `PackedInt8`


class PackedF32(NamedTuple):
    """An f32 `[K, N]` weight stored as 64-column panels, `panels` [N / 64, K, 64] (panel p: columns 64p..64p+63, each
    k's 64 weights contiguous), so the native register tiles read each panel as one contiguous stream (`matmul.cc`
    `MatmulF32Packed`). The panels are f32, or bf16 where every weight is exactly a bf16 value (`pack_f32`: a
    checkpoint stored in bf16 and loaded as f32) -- the same weights at half the bytes, widened exactly as they are
    read. `linear` gives exactly the bits it gives for the plain matrix, for any number of rows: the rows the native
    tiles take (`F32_NATIVE_ROWS`) run the same FMA chains; any other call multiplies the unpacked matrix with XLA's
    dot, as it would the plain one. A pytree, so jit takes it."""

    panels: jax.Array

    @property
    def shape(self) -> tuple:
        return (self.panels.shape[1], self.panels.shape[0] * PANEL)

    @property
    def dtype(self):
        """f32: the matrix's values (bf16 panels hold f32 weights exactly)."""
        return jnp.dtype(jnp.float32)

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes


def packed_weights_supported() -> bool:
    """Whether `PackedF32` weights are read natively here (the CPU backend with the native library); elsewhere packing
    would only add an unpacking copy per call."""
    return native.runs_here()


def packable(w) -> bool:
    """Whether `w` is a plain f32 `[K, N]` matrix `pack_f32` takes (N a positive multiple of 64)."""
    return (isinstance(w, jax.Array) and w.ndim == 2 and w.dtype == jnp.float32 and w.shape[1] > 0
            and w.shape[1] % PANEL == 0)


def pack_f32(w: jax.Array) -> PackedF32:
    """`w` f32[K, N] (N a multiple of 64) as a `PackedF32`: bf16 panels where every weight is exactly a bf16 value
    (its low 16 bits zero: nothing rounds), else f32 ones; ValueError for any other shape or dtype.

    Why bf16 where exact: a decode row or verify block reads every weight once, so its products are bound by the bytes
    they read; most checkpoints are stored in bf16, and loaded as f32 they are exactly bf16 values. Measured (the
    bundled model from its bf16 safetensors, its loop layout 12.0 MiB instead of 20.0; bf16 against f32 panels
    interleaved in one process, medians, the same tokens and logits bits): the full-cache decode step 0.68-0.77x the
    time at 4K, 0.85x at 8K, 0.90-0.96x at 32K; the x = 8 verify 0.91x, 0.96-0.97x and 0.96-0.99x."""
    if not packable(w):
        raise ValueError(f"pack_f32 needs an f32 [K, N] matrix with N a positive multiple of {PANEL}, got "
                         f"{getattr(w, 'dtype', type(w).__name__)}{tuple(getattr(w, 'shape', ()))}")
    # cast before the panel transpose: one copy of the matrix, in the bytes it is stored in (not an f32 one, then bf16)
    return PackedF32(_panel(w.astype(jnp.bfloat16) if bf16_exact(w) else w))


def bf16_exact(w: jax.Array) -> bool:
    """Whether every element of the f32 array `w` is exactly a bf16 value (so `w.astype(bf16).astype(f32) == w`, bit
    for bit, NaN payloads and signed zeros included). False inside a trace, where the values are not known: such
    a matrix keeps its f32 panels (the same bits either way)."""
    if isinstance(w, jax.core.Tracer):
        return False
    bits = jax.lax.bitcast_convert_type(jnp.asarray(w, jnp.float32), jnp.uint32)
    return bool(jnp.all((bits & 0xFFFF) == 0))


def unpack_f32(w: PackedF32) -> jax.Array:
    """The plain f32 `[K, N]` matrix a `PackedF32` stores."""
    return _unpanel(w.panels).astype(jnp.float32)


class PackedInt8(NamedTuple):
    """An `Int8Weight` with its codes stored as 64-column panels, `panels` int8[N / 64, K, 64] (as `PackedF32`), and
    the scales f32[N]: `linear` gives exactly the bits it gives for the `Int8Weight`, for any number of rows, reading
    each panel as one contiguous stream (a draft token's one-row products: 64 contiguous bytes per k instead of runs of
    64 bytes N bytes apart). A pytree, so jit takes it."""

    panels: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple:
        return (self.panels.shape[1], self.panels.shape[0] * PANEL)

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes + self.scale.nbytes


def pack_int8(w: Int8Weight) -> PackedInt8:
    """An `Int8Weight` [K, N] (N a positive multiple of 64) as a `PackedInt8`; ValueError for any other shape."""
    K, N = w.codes.shape
    if N == 0 or N % PANEL:
        raise ValueError(f"pack_int8 needs codes [K, N] with N a positive multiple of {PANEL}, got {w.codes.shape}")
    return PackedInt8(_panel(w.codes), w.scale)


def unpack_int8(w: PackedInt8) -> Int8Weight:
    """The `Int8Weight` a `PackedInt8` stores."""
    return Int8Weight(_unpanel(w.panels), w.scale)


def _panel(w: jax.Array) -> jax.Array:
    K, N = w.shape
    return w.reshape(K, N // PANEL, PANEL).transpose(1, 0, 2)


def _unpanel(panels: jax.Array) -> jax.Array:
    P, K, _ = panels.shape
    return panels.transpose(1, 0, 2).reshape(K, P * PANEL)


def linear(x: jax.Array, w) -> jax.Array:
    """x @ w. With f32 `x` and a bf16 `w` or an `Int8Weight`: on CPU the native kernel reads the weights as stored
    (`native.matmul.matmul_bf16` / `matmul_int8`); elsewhere a bf16 dot with f32 results (int8 codes are exact in
    bf16), times the scales for int8. f32 `x` and `w` [K, N] with `F32_NATIVE_ROWS` rows: on CPU the native f32 product
    (a decode row, a verify block's rows; each row's bits independent of the others); a `PackedF32` / `PackedAffine` /
    `PackedInt8` gives the same bits as its plain matrix / `Int8Weight`. Anything else: `x @ w` unchanged."""
    native_cpu = native.runs_here()
    # the calls of f32 weights the native product takes: one predicate for plain and packed weights (the same bits)
    f32_native = (native_cpu and x.dtype == jnp.float32
                  and F32_NATIVE_ROWS[0] <= math.prod(x.shape[:-1]) <= F32_NATIVE_ROWS[1])
    if isinstance(w, IntDotCodes):  # a draft's lossy product (`pallas_kernels.int_dot`)
        if native_cpu and x.dtype == jnp.float32:
            from pallas_kernels.native.matmul import matmul_int_dot  # noqa: PLC0415 - only where the library built

            return matmul_int_dot(x, w.q, w.d, w.m)
        return int_dot_reference(x, w)
    if isinstance(w, IntDot8):  # ... and its int8 codes' form
        if native_cpu and x.dtype == jnp.float32:
            from pallas_kernels.native.matmul import matmul_int_dot8  # noqa: PLC0415 - only where the library built

            return matmul_int_dot8(x, w.q, w.scale)
        return int_dot8_reference(x, w)
    if isinstance(w, PackedAffine):  # exactly an f32 matrix (`pallas_kernels.affine`): its bits, fewer bytes read
        if f32_native:
            from pallas_kernels.native.matmul import matmul_affine_packed  # noqa: PLC0415 - where the library built

            return matmul_affine_packed(x, w.q, w.d, w.m)
        return x @ unpack_affine(w)
    if isinstance(w, PackedF32):
        if f32_native:
            from pallas_kernels.native.matmul import matmul_f32_packed  # noqa: PLC0415 - only where the library built

            return matmul_f32_packed(x, w.panels)
        return x @ unpack_f32(w)  # what the plain matrix would take (a copy: these calls are not the packed ones' use)
    if isinstance(w, PackedInt8):
        if native_cpu and x.dtype == jnp.float32:
            from pallas_kernels.native.matmul import matmul_int8_packed  # noqa: PLC0415 - only where the library built

            return matmul_int8_packed(x, w.panels, w.scale)
        w = unpack_int8(w)  # what the Int8Weight would take (a copy: these calls are not the packed ones' use)
    if isinstance(w, Int8Weight):
        if native_cpu and x.dtype == jnp.float32:
            from pallas_kernels.native.matmul import matmul_int8  # noqa: PLC0415 - only where the library built

            return matmul_int8(x, w.codes, w.scale)
        y = jnp.dot(x.astype(jnp.bfloat16), w.codes.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        return y * w.scale
    if f32_native and w.dtype == jnp.float32 and w.ndim == 2:
        from pallas_kernels.native.matmul import matmul_f32  # noqa: PLC0415 - only where the library built

        return matmul_f32(x, w)
    if w.dtype != jnp.bfloat16 or x.dtype != jnp.float32:
        return x @ w
    if native_cpu:
        from pallas_kernels.native.matmul import matmul_bf16  # noqa: PLC0415 - only where the library built

        return matmul_bf16(x, w)
    return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
