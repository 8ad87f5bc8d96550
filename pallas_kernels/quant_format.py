"""The 2-/4-bit draft-cache format (KIVI-style, arXiv 2402.02750), written from the shared spec.

- codes: u8[B, K, S, D * bits // 8], element d in byte `d // (8 // bits)` at bit offset `(d % (8 // bits)) * bits`.
- keys per channel over groups of G tokens: `k_scale, k_zero f32[B, K, S // G, D]`, key = code * scale + zero.
- values per token: `v_scale, v_zero f32[B, K, S, 1]`, value = code * scale + zero.
- scale = (max - min) / (2**bits - 1), zero = min, code = clip(round((x - min) / scale)); a zero range uses scale 1.
`kvjax/cache/draft.py` (`QuantizedKV`) implements the same format independently; a test checks the two agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """u8[..., D] codes -> u8[..., D * bits // 8], low bits first."""
    per = 8 // bits
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    return jnp.sum(c << shifts, axis=-1, dtype=jnp.uint32).astype(jnp.uint8)


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """u8[..., D * bits // 8] -> u8[..., D]."""
    per = 8 // bits
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    c = (packed[..., None] >> shifts) & jnp.uint8(2**bits - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _minmax(x, axis, bits):
    lo = jnp.min(x, axis=axis, keepdims=True)
    rng = jnp.max(x, axis=axis, keepdims=True) - lo
    scale = jnp.where(rng > 0, rng / (2**bits - 1), 1.0)
    codes = jnp.clip(jnp.round((x - lo) / scale), 0, 2**bits - 1).astype(jnp.uint8)
    return codes, scale.astype(jnp.float32), lo.astype(jnp.float32)


def quantize(k: jax.Array, v: jax.Array, *, bits: int, group: int = 32) -> dict:
    """Quantize f32 `k, v [B, K, S, D]` (S a multiple of `group`). Returns the arrays of the format as a dict."""
    B, K, S, D = k.shape
    kc, ks, kz = _minmax(k.astype(jnp.float32).reshape(B, K, S // group, group, D), 3, bits)
    vc, vs, vz = _minmax(v.astype(jnp.float32), 3, bits)
    return dict(k_codes=pack(kc.reshape(B, K, S, D), bits), k_scale=ks[:, :, :, 0], k_zero=kz[:, :, :, 0],
                v_codes=pack(vc, bits), v_scale=vs, v_zero=vz)


def dequantize(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, *, bits: int, group: int):
    """The format's f32 keys and values, `[B, K, S, D]` each."""
    B, K, S, _ = k_codes.shape
    kc = unpack(k_codes, bits).astype(jnp.float32)
    D = kc.shape[-1]
    k = (kc.reshape(B, K, S // group, group, D) * k_scale[:, :, :, None] + k_zero[:, :, :, None]).reshape(B, K, S, D)
    v = unpack(v_codes, bits).astype(jnp.float32) * v_scale + v_zero
    return k, v
