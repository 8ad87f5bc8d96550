"""A draft's products with 4-bit block codes, or int8 codes, by integer dot products: the row quantised to int16 per
block of 32 k, the codes times the row's codes summed exactly in int32, then scaled per block (the integer-dot form of
llama.cpp's quantised products; no code taken).

Lossy by the row's quantisation (~1e-5 relative), so only a draft reads it: verification multiplies the exact weights,
and the output stays bit-identical to full-cache decoding whatever the draft reads (`draft_weights="int_dot"`). Why: on
the CPU the exact 4-bit product (`pallas_kernels.affine`) makes every weight in f32 before its FMA -- 5 vector ops per
16 weights, about as long as reading their bytes, and the two do not overlap -- while VPDPWSSD multiplies 32 code
pairs per instruction, so the product comes near its memory stream (`native/int_dot.cc`).

`int_dot_codes(w)` rearranges a `PackedAffine` with 4-bit codes (Q4_1's unsigned, or Q4_0's signed ones stored as
code + 8 with the offset m - 8d) into the pair layout the kernel loads -- the draft's own copy of the codes, as many
bytes; `int_dot_reference` is the product's definition in jnp, which the native kernel matches up to f32 rounding
(`tests/kernels/test_int_dot.py`).

`IntDot8` is the same product for a float model's int8 draft codes (`pallas_kernels.linear.Int8Weight`: a scale per
column, no offset), rearranged into k pairs by `int_dot8_codes`: where the exact int8 product widens each code to f32
before its FMA (24 vector ops per 128 weights and row), this one takes 4 widening loads per 128 weights and 4 dot
instructions per row. `int_dot8_reference` is its definition (`tests/kernels/test_int_dot8.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.affine import BLOCK, PANEL, PackedAffine, fit_codes, pack_codes

TOP = 32767  # a row's largest int16 code


class IntDotCodes(NamedTuple):
    """A `[K, N]` weight as unsigned 4-bit codes in the integer-dot pair layout, `q` uint8[N / 64, K / 2, 64] (per
    panel and k pair g: byte 32s + 2i + j holds column 16s + i at k = 2g + j in its low nibble and column 32 + 16s + i
    in its high one), and per-block f16 scales `d` and offsets `m` [N / 64, K / 32, 64] (a GGUF block's own f16
    values; others rounded to f16): weight (k, n) = q * d + m.
    A pytree, so jit takes it."""

    q: jax.Array
    d: jax.Array
    m: jax.Array

    @property
    def shape(self) -> tuple:
        return (2 * self.q.shape[1], self.q.shape[0] * PANEL)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes + self.m.nbytes


def int_dot_fast() -> bool:
    """Whether the integer-dot product runs natively with VNNI instructions here (the CPU backend, the native library
    built with AVX-512 VNNI); elsewhere it is still exact to its definition, but no cheaper than the exact product."""
    from pallas_kernels import native  # noqa: PLC0415 - builds the library on first use

    return native.runs_here() and bool(native.status().get("int_dot_vnni"))


def int_dot_codes(w) -> IntDotCodes | None:
    """`w`'s codes in the integer-dot layout, or None unless `w` is a `PackedAffine` of 4-bit codes."""
    if not isinstance(w, PackedAffine) or w.bits != 4:
        return None
    q = np.asarray(w.q)
    P, K, _ = q.shape
    low, high = (q & 15).astype(np.uint8), ((q >> 4) & 15).astype(np.uint8)  # columns j and j + 32 of each k
    d, m = np.asarray(w.d, np.float32), np.asarray(w.m, np.float32)
    if q.dtype == np.int8:  # Q4_0's two's complement nibbles: code + 8 in 0..15, the offset moved by -8d
        low, high = low ^ 8, high ^ 8
        m = (m - np.float32(8) * d).astype(np.float32)
    c = np.concatenate([low, high], axis=2).reshape(P, K // 2, 2, 2, 2, 16)  # [P, K/2, j, nibble, s, i]
    byte = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # [P, K/2, j, s, i]
    out = np.ascontiguousarray(byte.transpose(0, 1, 3, 4, 2)).reshape(P, K // 2, 64)  # bytes [s, i, j]
    return IntDotCodes(jnp.asarray(out), jnp.asarray(d, jnp.float16), jnp.asarray(m, jnp.float16))


def requantize_4bit(w) -> IntDotCodes:
    """An f32 `[K, N]` weight (K a multiple of 32, N of 64) as 4-bit codes in the integer-dot layout: per block of 32 k
    and column, d = (max - min) / 15 and m = min in f16, codes round((w - m) / d) clamped to 0..15 (lossy: for a
    draft's coarse pass only: its output head's candidates, `kvjax.models.llama.layers.coarse_head_logits`)."""
    w = np.asarray(w, np.float32)
    K, N = w.shape
    b = w.reshape(K // BLOCK, BLOCK, N)
    lo, hi = b.min(axis=1), b.max(axis=1)  # [K / 32, N]
    d = ((hi - lo) / np.float32(15)).astype(np.float16).astype(np.float32)
    m = lo.astype(np.float16).astype(np.float32)
    codes, _ = fit_codes(b, d, m, 0, 15)  # the codes nearest w (exact or not: lossy here)
    return int_dot_codes(pack_codes(codes.reshape(K, N), d, m))


def unpack_codes(w: IntDotCodes) -> jax.Array:
    """The codes uint8[K, N] of an `IntDotCodes` (its layout undone)."""
    P, G, _ = w.q.shape
    b = w.q.reshape(P, G, 2, 16, 2)  # [P, K/2, s, i, j]
    nib = jnp.stack([b & 15, b >> 4], axis=2)  # [P, K/2, nibble, s, i, j]
    cols = nib.transpose(0, 1, 5, 2, 3, 4).reshape(P, 2 * G, PANEL)  # [P, K, 64]: column 32 nibble + 16s + i
    return cols.transpose(1, 0, 2).reshape(2 * G, P * PANEL)


def _quantise_rows(x: jax.Array, K: int):
    """(xq i32[M, K / 32, 32], xs f32[M, K / 32], xsum f32[M, K / 32]) of x f32[..., K] flattened to M rows: per row and
    block of 32 k, xs = max |x| / 32767 and xq = round(x * (32767 / max |x|)) (0 for an all-zero block), xsum the
    block's sum; a block holding NaN or inf gets codes 0 and xs NaN."""
    xb = x.reshape(-1, K // BLOCK, BLOCK).astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(xb), axis=-1)
    amax = jnp.max(jnp.where(jnp.isfinite(xb), jnp.abs(xb), 0), axis=-1)
    inv = jnp.where(finite & (amax > 0), jnp.float32(TOP) / jnp.where(amax > 0, amax, 1), 0)
    xq = jnp.round(jnp.where(finite[..., None], xb, 0) * inv[..., None]).astype(jnp.int32)
    xs = jnp.where(finite, amax / jnp.float32(TOP), jnp.nan)
    return xq, xs, jnp.sum(xb, axis=-1)


def int_dot_reference(x: jax.Array, w: IntDotCodes) -> jax.Array:
    """The product `native.matmul.matmul_int_dot` computes, x f32[..., K] -> f32[..., N]: per row and block of 32 k,
    xs = max |x| / 32767 and xq = round(x * (32767 / max |x|)) (0 for an all-zero block); y = the sum over blocks of
    d * xs * (codes . xq, exact) + m * (the block's sum of x); a block holding NaN or inf makes its row NaN."""
    K, N = w.shape
    lead = x.shape[:-1]
    xq, xs, xsum = _quantise_rows(x, K)
    codes = unpack_codes(w).astype(jnp.int32).reshape(K // BLOCK, BLOCK, N)
    isum = jnp.einsum("mbk,bkn->mbn", xq, codes)  # exact in int32: |sum| <= 32 * 15 * 32767
    d = w.d.astype(jnp.float32).transpose(1, 0, 2).reshape(K // BLOCK, N)
    m = w.m.astype(jnp.float32).transpose(1, 0, 2).reshape(K // BLOCK, N)
    terms = d[None] * xs[..., None] * isum.astype(jnp.float32) + m[None] * xsum[..., None]
    return jnp.sum(terms, axis=1).reshape(*lead, N)


class IntDot8(NamedTuple):
    """A `[K, N]` weight as int8 codes with a scale per column (`pallas_kernels.linear.Int8Weight`'s) in the
    integer-dot pair layout, `q` int8[N / 64, K / 2, 128] (per panel and k pair g: byte 32s + 2i + j holds column
    16s + i at k = 2g + j), and `scale` f32[N]: weight (k, n) ~ q * scale. A pytree, so jit takes it."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple:
        return (2 * self.q.shape[1], self.q.shape[0] * PANEL)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def int_dot8_codes(codes, scale) -> IntDot8 | None:
    """int8 `codes` [K, N] with `scale` f32[N] (an `Int8Weight`'s) in the integer-dot layout, or None where K is not a
    multiple of 32 or N not a positive multiple of 64 (the kernel's blocks and panels)."""
    codes = np.asarray(codes)
    K, N = codes.shape
    if codes.dtype != np.int8 or K % BLOCK or N == 0 or N % PANEL:
        return None
    c = codes.reshape(K // 2, 2, N // PANEL, 4, 16)  # [g, j, p, s, i]
    q = np.ascontiguousarray(c.transpose(2, 0, 3, 4, 1)).reshape(N // PANEL, K // 2, 2 * PANEL)  # bytes [s, i, j]
    return IntDot8(jnp.asarray(q), jnp.asarray(scale, jnp.float32))


def unpack_int_dot8(w: IntDot8) -> jax.Array:
    """The codes int8[K, N] of an `IntDot8` (its layout undone)."""
    P, G, _ = w.q.shape
    c = w.q.reshape(P, G, 4, 16, 2)  # [p, g, s, i, j]
    return c.transpose(1, 4, 0, 2, 3).reshape(2 * G, P * PANEL)


def int_dot8_reference(x: jax.Array, w: IntDot8) -> jax.Array:
    """The product `native.matmul.matmul_int_dot8` computes, x f32[..., K] -> f32[..., N]: the rows quantised as in
    `int_dot_reference`; y = scale * (the sum over blocks of xs * (codes . xq, exact)); a block holding NaN or inf makes
    its row NaN."""
    K, N = w.shape
    lead = x.shape[:-1]
    xq, xs, _ = _quantise_rows(x, K)
    codes = unpack_int_dot8(w).astype(jnp.int32).reshape(K // BLOCK, BLOCK, N)
    isum = jnp.einsum("mbk,bkn->mbn", xq, codes)  # exact in int32: |sum| <= 32 * 127 * 32767
    y = jnp.sum(xs[..., None] * isum.astype(jnp.float32), axis=1) * w.scale
    return y.reshape(*lead, N)
