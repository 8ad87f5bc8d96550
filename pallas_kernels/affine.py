"""f32 weights that are exactly block-affine codes, stored as the codes: what a GGUF model's quantised weights are once
loaded (Q4_0, Q4_1, Q8_0 and kin dequantise each block of 32 weights along k as d * q + m, d and m f16, q a small
integer), read by the native products at 1.25 bytes per weight instead of 4 (0.75 where the codes are 4-bit), with the
f32 matrix's bits.

`pack_affine(w)` finds, for every block of 32 rows of `w [K, N]` and every column, an f32 scale d, offset m and int8
codes q with fl(d * q + m) == w bit for bit (d * q exact in f32, so one rounding: the native kernel's fma(q, d, m)
gives the same value), and stores them in `PackedF32`'s 64-column panels. It checks every weight and returns None
unless all of them are reproduced exactly, so a weight that is not such a code (a trained model's, a fine-tuned GGUF's
after an update) keeps its f32 layout: `linear` on a `PackedAffine` multiplies exactly the f32 matrix, never an
approximation of it.

The forms are tried per block as the formats make them, fewest code bits first (`FORMS`): asymmetric (m = the block's
minimum, code 0; d the f16 nearest (max - min) / the top code: Q4_1, Q5_1) and symmetric (m = -0, d = +-max |w| / the
top code: Q4_0, Q5_0, Q8_0). A block fits when one of them reproduces all 32 weights. SmolLM2-135M's GGUF (Q4_1
projections, a Q8_0 embedding): every block of every matrix fits, the projections with 4-bit codes; its packed loop
layout holds ~115 MB of codes instead of 538 MB of f32 panels.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # rows of k per (d, m): GGUF's block size for every format above
PANEL = 64  # columns per panel, as `pallas_kernels.linear.PackedF32`


class PackedAffine(NamedTuple):
    """An f32 `[K, N]` weight as int8 codes `q` [N / 64, K, 64] (in `PackedF32`'s panel order; where every code is
    4-bit, [N / 64, K, 32], two codes per byte: column j of the panel in byte j's low nibble, column j + 32 in its high
    one -- uint8 for Q4_1's 0..15, int8 for Q4_0's -8..7 as two's complement nibbles) and per-block f32 scales `d` and
    offsets `m` [N / 64, K / 32, 64]: weight (k, n) = fma(q, d, m) of its block, exactly the f32 value. A pytree, so
    jit takes it."""

    q: jax.Array
    d: jax.Array
    m: jax.Array

    @property
    def shape(self) -> tuple:
        return (self.q.shape[1], self.q.shape[0] * PANEL)

    @property
    def bits(self) -> int:
        """Bits per code: 4 (two per byte: `q` [P, K, 32]) or 8."""
        return 4 if self.q.shape[-1] == PANEL // 2 else 8

    @property
    def dtype(self):
        return jnp.float32  # what it stands for

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes + self.m.nbytes


def fit_codes(v: np.ndarray, d: np.ndarray, m: np.ndarray, lo: int, hi: int):
    """Codes for blocks v [B, 32, n] under (d, m) [B, n] (the nearest, clipped to lo..hi; `pallas_kernels.int_dot`'s
    lossy requantisation takes them as they are), and per block whether they reproduce v bit for bit (made from
    the integer codes, as the kernel makes them: a code 0 is +0, so d's sign sets the sign of a zero weight)."""
    safe = np.where(d == 0, np.float32(1), d)
    q = np.clip(np.rint((v - m[:, None, :]) / safe[:, None, :]), lo, hi)
    q = np.where(d[:, None, :] == 0, 0, q).astype(np.int8)
    p = d[:, None, :].astype(np.float64) * q.astype(np.float64)  # exact in f64
    made = (p.astype(np.float32) + m[:, None, :]).astype(np.float32)
    ok = (p == p.astype(np.float32)) & (made.view(np.uint32) == v.view(np.uint32))
    return q, ok.all(axis=1)


# The forms tried, in order, on the blocks no earlier form fitted, the fewest code bits first (a block may fit
# several: some of a Q4_1 matrix's fit Q8_0's form, with codes up to 127): (kind, top code).
#   "asym": m = the block's minimum (code 0), d the f16 nearest (max - min) / top, codes 0..top (Q4_1: 15; Q5_1: 31);
#   "extreme": m = -0, d = -(the block's value of largest magnitude) / top, codes -top..top-1 -- how Q4_0 (8) and Q5_0
#     (16) make their scale, so their codes fit a signed nibble (or 5 bits);
#   "sym": m = -0, d = +-max |w| / top, codes -top..top (Q8_0: 127, d > 0; a Q4_0 / Q5_0 block "extreme" missed: either
#     sign, which a block's zero weights show, d * 0 being -0 for d < 0).
FORMS = (("asym", 15), ("extreme", 8), ("sym", 8), ("sym", -8), ("asym", 31), ("extreme", 16), ("sym", 16),
         ("sym", -16), ("sym", 127))


# Whole matrices try these first, so that one format's blocks all get its 4-bit codes (a Q4_0 block whose codes span
# all 16 values also fits the asymmetric form, with codes 0..15: mixed with its neighbours' -8..7 they would need a
# byte each): unsigned 4-bit (Q4_1), then signed 4-bit (Q4_0), then every form per block.
FORM_SETS = ((("asym", 15),), (("extreme", 8),), FORMS)


def _codes(w: np.ndarray, forms=FORMS):
    """(q int8 [K, N], d f32 [K/32, N], m f32 [K/32, N]) reproducing `w` exactly with `forms`, or None."""
    K, N = w.shape
    v = w.reshape(K // BLOCK, BLOCK, N)
    lo, hi = v.min(axis=1), v.max(axis=1)
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        return None
    q = np.zeros(v.shape, np.int8)
    d, m = np.zeros_like(lo), np.zeros_like(lo)
    done = np.zeros(lo.shape, bool)
    minus_zero = np.full_like(lo, -0.0)  # x + (-0) == x for every x, +0 included: the product's own sign of zero kept
    for kind, top in forms:
        if kind == "asym":
            with np.errstate(over="ignore"):
                dd = ((hi.astype(np.float64) - lo) / top).astype(np.float16).astype(np.float32)
            mm = lo
            qq, ok = fit_codes(v, dd, mm, 0, top)
        elif kind == "extreme":
            extreme = np.where(hi > -lo, hi, lo)
            dd, mm = (-extreme / np.float32(top)).astype(np.float32), minus_zero
            qq, ok = fit_codes(v, dd, mm, -top, top - 1)
        else:
            dd, mm = (np.maximum(-lo, hi) / np.float32(top)).astype(np.float32), minus_zero
            qq, ok = fit_codes(v, dd, mm, -abs(top), abs(top))
        take = ok & ~done
        q = np.where(take[:, None, :], qq, q)
        d, m = np.where(take, dd, d), np.where(take, mm, m)
        done |= ok
        if done.all():
            return q.reshape(K, N), d, m
    return None


def affine_packable(w) -> bool:
    """Whether `w` has the shape and type `pack_affine` looks at: a concrete f32 [K, N] array, K a positive multiple of
    32 and N of 64 (a traced value cannot be checked, so it never packs)."""
    return (isinstance(w, (jax.Array, np.ndarray)) and not isinstance(w, jax.core.Tracer) and w.ndim == 2
            and w.dtype == np.float32 and w.shape[0] > 0 and w.shape[0] % BLOCK == 0 and w.shape[1] > 0
            and w.shape[1] % PANEL == 0)


def pack_affine(w) -> PackedAffine | None:
    """`w` f32[K, N] as a `PackedAffine` when every weight is exactly a block-affine code (see the module docstring),
    else None (also for shapes `affine_packable` refuses)."""
    if not affine_packable(w):
        return None
    host = np.asarray(w)
    K, N = host.shape
    step = max(PANEL, (1 << 22) // K // PANEL * PANEL)  # columns per pass: bounded temporaries for a large head
    for forms in FORM_SETS:
        parts = []
        for n0 in range(0, N, step):
            got = _codes(np.ascontiguousarray(host[:, n0:n0 + step]), forms)
            if got is None:
                break
            parts.append(got)
        else:
            break
    else:
        return None
    return pack_codes(*(np.concatenate(x, axis=1) for x in zip(*parts)))


def pack_codes(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> PackedAffine:
    """Integer codes q [K, N] with per-block scales and offsets d, m [K / 32, N] (weight = fma(q, d, m)) in
    `PackedAffine`'s panel layout: two codes per byte where every code fits 4 bits."""
    N = q.shape[1]

    def panels(a):
        rows = a.shape[0]
        return np.ascontiguousarray(a.reshape(rows, N // PANEL, PANEL).transpose(1, 0, 2))

    q = panels(q)
    lo, hi = int(q.min()), int(q.max())
    if (0 <= lo and hi <= 15) or (-8 <= lo and hi <= 7):
        # 4-bit codes, two per byte, column j low and j + 32 high: unsigned (Q4_1's 0..15) as uint8, or signed (Q4_0's
        # -8..7, two's complement nibbles) as int8
        u = q.astype(np.uint8) & 15
        q = u[..., :PANEL // 2] | (u[..., PANEL // 2:] << 4)
        if lo < 0:
            q = q.view(np.int8)
    return PackedAffine(jnp.asarray(q), jnp.asarray(panels(d)), jnp.asarray(panels(m)))


def unpack_affine(w: PackedAffine) -> jax.Array:
    """The f32 `[K, N]` matrix a `PackedAffine` stands for, bit for bit (d * q is exact, so the sum's one rounding is
    the fused one's)."""
    P, K, _ = w.q.shape
    d = jnp.repeat(w.d, BLOCK, axis=1)
    m = jnp.repeat(w.m, BLOCK, axis=1)
    if w.bits == 4:  # low nibbles then high ones; int8 bytes hold signed nibbles (the shifts are arithmetic)
        q = jnp.concatenate([jnp.left_shift(w.q, 4) >> 4, w.q >> 4], axis=2)
    else:
        q = w.q
    full = q.astype(jnp.float32) * d + m
    return full.transpose(1, 0, 2).reshape(K, P * PANEL)
