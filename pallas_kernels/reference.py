"""Pure-jnp f32 references: the definitions every kernel must match (same signatures as the public functions).

Every reference reduces to one masked softmax, `masked_softmax_attention`, over an explicit visibility mask; each
kernel's masking rule is written here once, in the plainest form, next to its docstring. Everything is computed in f32
(inputs upcast), so bf16 kernels are judged against the exact answer with a bf16 tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import online_softmax as osm


def masked_softmax_attention(q, k, v, vis, *, scale=None, sinks=None, return_stats=False):
    """f32 GQA attention over an explicit mask.

    Args:
        q: [B, T, N, D].
        k, v: [B, K, S, D] or per-query [B, K, T, S, D] (v None: keys are the values).
        vis: bool[B, K|1, T, S].
        scale: default D ** -0.5; sinks: f32[N] per-head sink logits or None.
        return_stats: return `(o f32[B, T, N, D] un-normalised, m f32[B, T, N], l f32[B, T, N])` instead.

    Returns:
        [B, T, N, D] in q's dtype; rows with nothing visible (and no sink) are zeros.
    """
    B, T, N, D = q.shape
    K = k.shape[1]
    G = N // K
    v = k if v is None else v
    scale = D**-0.5 if scale is None else scale
    qg = q.astype(jnp.float32).reshape(B, T, K, G, D)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    if k.ndim == 4:
        s = jnp.einsum("BTKGD,BKSD->BKGTS", qg, kf, precision=hp) * scale
    else:
        s = jnp.einsum("BTKGD,BKTSD->BKGTS", qg, kf, precision=hp) * scale
    p, m, l = _softmax_parts(s, vis[:, :, None])  # mask [B, K|1, 1, T, S]
    if v.ndim == 4:
        o = jnp.einsum("BKGTS,BKSD->BTKGD", p, vf, precision=hp)
    else:
        o = jnp.einsum("BKGTS,BKTSD->BTKGD", p, vf, precision=hp)
    return _rows_out(o.reshape(B, T, N, D), m, l, q.dtype, sinks, return_stats)


def _softmax_parts(s, mask):
    """(p, m, l) of scores s [B, K, G, T, S] under a visibility mask broadcastable to it: m the row max of the
    visible scores (MASK_VALUE where none), p = exp(s - m) where visible else 0, l its row sum."""
    s = jnp.where(mask, s, osm.MASK_VALUE)
    m = jnp.max(s, axis=-1)  # [B, K, G, T]
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    return p, m, jnp.sum(p, axis=-1)


def _rows_out(o, m, l, dtype, sinks, return_stats):
    """o [B, T, N, D] with m, l [B, K, G, T] as the references return them: the statistics, or the normalised
    output in `dtype`."""
    B, T, N, _ = o.shape
    m = jnp.transpose(m, (0, 3, 1, 2)).reshape(B, T, N)
    l = jnp.transpose(l, (0, 3, 1, 2)).reshape(B, T, N)
    if return_stats:
        return o, m, l
    return osm.finalize(o, m, l, sinks).astype(dtype)


def position_visible(q_pos, k_pos, window=None):
    """bool[B, K|1, T, S]: key visible iff 0 <= k_pos <= q_pos (and k_pos > q_pos - W). k_pos: [B, S] or [B, K, S]."""
    kp = k_pos[:, None, :] if k_pos.ndim == 2 else k_pos
    q = q_pos[:, None, :, None]
    kk = kp[:, :, None, :]
    ok = (kk >= 0) & (kk <= q)
    if window is not None:
        ok &= kk > q - window
    return ok


def attend_reference(q, k, v, q_pos, k_pos, *, window=None, scale=None, sinks=None, return_stats=False):
    """Kernel 0: position-masked attention (the rule of `kvjax.models.attention.attend`)."""
    return masked_softmax_attention(q, k, v, position_visible(q_pos, k_pos, window), scale=scale, sinks=sinks,
                                    return_stats=return_stats)


def dense_query_positions(lengths, T):
    """i32[B, T]: the T newest tokens of a dense cache holding `lengths[b]` tokens sit at lengths - T + t."""
    return lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None, :]


def decode_reference(q, k, v, lengths, *, window=None, scale=None, sinks=None):
    """Kernels 1/2: dense cache (slot == position) holding `lengths[b]` tokens, the last T of which are the queries.

    T = 1 is decode; T = x + 1 is verification (the draft block was written into the cache, so the queries are causal
    among themselves and see the whole prefix).
    """
    S = k.shape[2]
    T = q.shape[1]
    k_pos = jnp.where(jnp.arange(S)[None, :] < lengths[:, None], jnp.arange(S)[None, :], -1)
    return attend_reference(q, k, v, dense_query_positions(lengths, T), k_pos, window=window, scale=scale,
                            sinks=sinks)


def ring_positions(seen, capacity):
    """i32[B, C]: position held by each slot of a ring of capacity C after `seen[b]` writes (-1 empty)."""
    c = jnp.arange(capacity)[None, :]
    last = seen[:, None] - 1
    pos = last - jnp.mod(last - c, capacity)
    return jnp.where(pos >= 0, pos, -1)


def window_reference(q, k, v, q_pos, seen, *, window, scale=None, sinks=None):
    """Kernel 3: sliding window over a ring of capacity C >= W (slot p % C holds position p)."""
    return attend_reference(q, k, v, q_pos, ring_positions(seen, k.shape[2]), window=window, scale=scale,
                            sinks=sinks)


def compressed_reference(q, k, v, q_pos, *, ratio, scale=None, sinks=None):
    """Kernel 4: compressed entries `[B, K, E, D]`; entry w visible to the query at t iff w < (t + 1) // m."""
    E = k.shape[2]
    w = jnp.arange(E)[None, None, None, :]
    vis = w < ((q_pos + 1) // ratio)[:, None, :, None]
    vis &= (q_pos >= 0)[:, None, :, None]
    return masked_softmax_attention(q, k, v, vis, scale=scale, sinks=sinks)


def sparse_reference(q, k, v, indices, *, scale=None, sinks=None, return_stats=False):
    """Kernel 5: each query attends to the entries `indices[b, t, :]` of `[B, K, E, D]`; -1 marks an invalid pick."""
    idx = jnp.maximum(indices, 0)  # [B, T, P]
    gather = jax.vmap(lambda kb, ib: kb[:, ib])  # [K, E, D], [T, P] -> [K, T, P, D]
    kg = gather(k, idx)
    vg = None if v is None else gather(v, idx)
    vis = (indices >= 0)[:, None]  # [B, 1, T, P]
    return masked_softmax_attention(q, kg, vg, vis, scale=scale, sinks=sinks, return_stats=return_stats)


def quantize_query_rows(q):
    """Each query row and head as int8 codes (the native kernel's `qscores`): per [..., D] row amax = max |q|, codes
    round(q * (127 / amax)) to nearest (ties to even), scale amax / 127; a zero row: codes 0, scale 0.
    Returns (codes i32[..., D], scale f32[..., 1])."""
    qf = q.astype(jnp.float32)
    amax = jnp.max(jnp.abs(qf), axis=-1, keepdims=True)
    inv = jnp.where(amax > 0, jnp.float32(127) / jnp.where(amax > 0, amax, 1), 0)
    codes = jnp.clip(jnp.round(qf * inv), -127, 127).astype(jnp.int32)
    return codes, amax / jnp.float32(127)


def int8_qscores_reference(q, k, v, k_scale, v_scale, q_pos, k_pos, *, window=None, scale=None, ring=None,
                           return_stats=False):
    """Attention over int8 codes read as integers (`native.attend_stats_int8(..., qscores=True)`): a score is the
    exact integer dot product of the row's codes (`quantize_query_rows`) and the key's, times (the row's scale times
    `scale`), times the key's scale; a value enters as its codes with its scale multiplied into its probability.
    `ring`: (k, v, pos) of a second part attended in f32 as `attend_reference` does, in the same softmax.

    Args:
        q: [B, T, N, D]; k, v: int8[B, K, S, D]; k_scale, v_scale: f32[B, K, S]; q_pos i32[B, T]; k_pos i32[B, S]
            or [B, K, S]; window, scale, return_stats: as `attend_reference`.
    """
    B, T, N, D = q.shape
    K = k.shape[1]
    G = N // K
    scale = D**-0.5 if scale is None else scale
    hp = jax.lax.Precision.HIGHEST
    codes, qs = quantize_query_rows(q)
    rs = (qs * jnp.float32(scale)).reshape(B, T, K, G)
    idot = jnp.einsum("BTKGD,BKSD->BKGTS", codes.reshape(B, T, K, G, D), k.astype(jnp.int32))
    s = (idot.astype(jnp.float32) * jnp.transpose(rs, (0, 2, 3, 1))[..., None]) * k_scale[:, :, None, None, :]
    vis = position_visible(q_pos, k_pos, window)[:, :, None]  # [B, K|1, 1, T, S]
    vis = jnp.broadcast_to(vis, s.shape)
    vals = jnp.broadcast_to(v.astype(jnp.float32)[:, :, None], (B, K, G, *v.shape[2:]))
    pscale = jnp.broadcast_to(v_scale[:, :, None, None, :], s.shape)
    if ring is not None:
        rk, rv, rpos = ring
        qg = q.astype(jnp.float32).reshape(B, T, K, G, D)
        s2 = jnp.einsum("BTKGD,BKSD->BKGTS", qg, rk.astype(jnp.float32), precision=hp) * scale
        vis2 = jnp.broadcast_to(position_visible(q_pos, rpos, window)[:, :, None], s2.shape)
        s, vis = jnp.concatenate([s, s2], -1), jnp.concatenate([vis, vis2], -1)
        vals = jnp.concatenate([vals, jnp.broadcast_to(rv.astype(jnp.float32)[:, :, None], (B, K, G, *rv.shape[2:]))],
                               -2)
        pscale = jnp.concatenate([pscale, jnp.ones(s2.shape, jnp.float32)], -1)
    p, m, l = _softmax_parts(s, vis)
    o = jnp.einsum("BKGTS,BKGSD->BTKGD", p * pscale, vals, precision=hp).reshape(B, T, N, D)
    return _rows_out(o, m, l, q.dtype, None, return_stats)
