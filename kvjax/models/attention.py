"""Position-masked attention over any cache form: the pure-jnp definition every kernel must match.

Queries carry their absolute positions, keys carry theirs (-1 = empty slot), so one function serves dense caches,
ring buffers, sparse draft caches and verification blocks: key `s` is visible to a query at position `t` iff
`0 <= pos[s] <= t` (and `pos[s] > t - W` for sliding layers). Softmax is f32 with a finite mask value, so a fully
masked row (padding) yields zeros, never NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def visible(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """bool[B, K|1, T, S] mask. q_pos: i32[B, T]; k_pos: i32[B, S] or i32[B, K, S]."""
    if k_pos.ndim == 2:
        k_pos = k_pos[:, None, :]
    q = q_pos[:, None, :, None]
    k = k_pos[:, :, None, :]
    ok = (k >= 0) & (k <= q)
    if window is not None:
        ok &= k > q - window
    return ok


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Grouped-query attention with position masks.

    Args:
        q: [B, T, N, D] queries.
        k, v: [B, K, S, D] keys/values (N a multiple of K).
        q_pos: i32[B, T] absolute query positions.
        k_pos: i32[B, S] or i32[B, K, S] absolute key positions, -1 for empty slots.
        window: sliding window W (keys with pos <= t - W are hidden), or None.
        scale: softmax scale, default D ** -0.5.

    Returns:
        [B, T, N, D] in q's dtype.
    """
    B, T, N, D = q.shape
    K = k.shape[1]
    G = N // K
    scale = D**-0.5 if scale is None else scale
    qg = q.reshape(B, T, K, G, D)
    s = jnp.einsum("BTKGD,BKSD->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
    mask = visible(q_pos, k_pos, window)[:, :, None]  # [B, K|1, 1, T, S]
    s = jnp.where(mask, s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("BKGTS,BKSD->BTKGD", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o / jnp.maximum(jnp.transpose(l, (0, 3, 1, 2, 4)), 1e-30)  # l: [B, K, G, T, 1] -> [B, T, K, G, 1]
    return o.reshape(B, T, N, D).astype(q.dtype)
