"""Kernels 0-4: attention over contiguous caches, each with an `implementation=` switch.

0. `attend`             -- position-masked GQA attention, `kvjax.models.attention.attend`'s signature.
1. `decode_attention`   -- dense cache, per-sequence lengths, split-K (T = 1).
2. `verify_attention`   -- dense cache, the last `x + 1` tokens are queries, causal among themselves.
3. `window_attention`   -- sliding window over a ring buffer; reads only the ring.
4. `compressed_attention` -- CSA/HCA entries with the per-query threshold `w < (t + 1) // m`.

All take queries `[B, T, N, D]` and caches `[B, K, S, D]`, optional per-head `sinks` (f32[N]), and `v=None` for
caches whose keys are their values (DeepSeek-V4 shares K and V; the kernel then reads the cache once). The "xla"
implementation is the f32 reference of `reference.py`; the Pallas ones run `flash.flash_partials`; "native" runs the
C++ kernel of `native/attention.cc` (kernels 1-4 as kernel 0 with the positions their rule implies).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import native
from pallas_kernels import online_softmax as osm
from pallas_kernels import reference as ref
from pallas_kernels.backend import interpret_arg, resolve
from pallas_kernels.flash import flash_partials
from pallas_kernels.layout import positions_to_rows, queries_to_rows, row_count, rows_to_queries, sinks_to_rows


def _run(q, k, v, q_pos, *, sinks, scale, implementation, return_stats=False, **kw):
    """Shared Pallas path: rows in, partials, finalize (with sinks), rows out."""
    B, T, N, D = q.shape
    K = k.shape[1]
    G = N // K
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of kv heads K={K}")
    R = row_count(T, G)
    scale = D**-0.5 if scale is None else scale
    o, m, l = flash_partials(queries_to_rows(q, K, R), positions_to_rows(q_pos, G, R), k, v, scale=scale,
                             interpret=interpret_arg(implementation), **kw)
    if return_stats:  # un-normalised, in the public layout, for combining with another part of the cache
        stats_m = rows_to_queries(m[..., None], T, N)[..., 0]
        stats_l = rows_to_queries(l[..., None], T, N)[..., 0]
        return rows_to_queries(o, T, N), stats_m, stats_l
    out = osm.finalize(o, m, l, sinks_to_rows(sinks, K, T, R))
    return rows_to_queries(out, T, N).astype(q.dtype)


def _native(q, k, v, q_pos, k_pos, *, window, scale, sinks, return_stats=False):
    """Kernel 0 by the native CPU kernel: statistics, then `finalize` (with sinks) unless they are asked for."""
    o, m, l = native.attend_stats(q, k, v, q_pos, k_pos, window=window, scale=scale)
    if return_stats:
        return o, m, l
    return osm.finalize(o, m, l, sinks).astype(q.dtype)


def attend(q, k, v, q_pos, k_pos, *, window=None, scale=None, sinks=None, implementation=None, block_k=64,
           num_splits=None, return_stats=False):
    """Kernel 0: position-masked GQA attention over any cache form.

    Args:
        q: [B, T, N, D] queries.
        k, v: [B, K, S, D] keys/values (v None: keys are the values).
        q_pos: i32[B, T] absolute query positions.
        k_pos: i32[B, S] or i32[B, K, S] key positions, -1 for empty slots. Key visible iff 0 <= k_pos <= q_pos
            (and k_pos > q_pos - W when windowed). Blocks with no visible key are skipped without reading K/V.
        window: W or None; scale: default D ** -0.5; sinks: f32[N] or None.
        implementation: None (auto), "xla", "pallas", "pallas_interpret", "pallas_debug", "native".
        block_k, num_splits: Pallas tiling (static; num_splits None = `layout.auto_splits`; the native kernel
            takes its own `native.default_block(D)` keys per block and never splits a row's keys).
        return_stats: return un-normalised `(o f32[B, T, N, D], m f32[B, T, N], l f32[B, T, N])` for
            `online_softmax.combine` with another part of the cache (sinks are then the caller's to add).

    Returns:
        [B, T, N, D] in q's dtype.
    """
    impl = resolve(implementation)
    if impl == "xla":
        return ref.attend_reference(q, k, v, q_pos, k_pos, window=window, scale=scale, sinks=sinks,
                                    return_stats=return_stats)
    if impl == "native":
        return _native(q, k, v, q_pos, k_pos, window=window, scale=scale, sinks=sinks, return_stats=return_stats)
    return _run(q, k, v, q_pos, sinks=sinks, scale=scale, implementation=impl, return_stats=return_stats,
                pos_mode="array", k_pos=k_pos, window=window, block_k=block_k, num_splits=num_splits)


def decode_attention(q, k, v, lengths, *, window=None, scale=None, sinks=None, implementation=None, block_k=64,
                     num_splits=None):
    """Kernel 1: attention of the newest token(s) over a dense cache.

    Args:
        q: [B, T, N, D]; query t sits at position `lengths[b] - T + t` (its own k/v already written).
        k, v: [B, K, S, D] dense cache, slot == position (v None: keys are the values).
        lengths: i32[B] tokens in the cache. Slots >= lengths are never read (the loop stops at the last visible
            block), so stale slots after a rollback are harmless.
        window: W or None (the loop then starts at the window's first block, not at slot 0).
        num_splits: split-K factor (None: enough to fill the GPU, see `layout.auto_splits`); the splits'
            `(o, m, l)` are merged by `online_softmax.combine`.

    Returns:
        [B, T, N, D] in q's dtype.
    """
    impl = resolve(implementation)
    if impl == "xla":
        return ref.decode_reference(q, k, v, lengths, window=window, scale=scale, sinks=sinks)
    q_pos = ref.dense_query_positions(lengths, q.shape[1])
    if impl == "native":  # slot == position below `lengths`, empty above
        S = k.shape[2]
        s = jnp.arange(S, dtype=jnp.int32)[None, :]
        k_pos = jnp.where(s < lengths[:, None], s, -1)
        return _native(q, k, v, q_pos, k_pos, window=window, scale=scale, sinks=sinks)
    return _run(q, k, v, q_pos, sinks=sinks, scale=scale, implementation=impl, pos_mode="affine", ratio=1,
                window=window, block_k=block_k, num_splits=num_splits)


def verify_attention(q, k, v, lengths, *, window=None, scale=None, sinks=None, implementation=None, block_k=64,
                     num_splits=None):
    """Kernel 2: the `x + 1` verification queries over the full cache plus the accepted suffix.

    The draft block's keys/values were written at `lengths - (x + 1) ..` before the call, so query t sees the whole
    prefix and draft tokens 0..t (causal among themselves). Same masking as `decode_attention` with T = x + 1; it is a
    separate entry point because its tiling differs (more rows, fewer splits).

    Args/Returns: as `decode_attention`, with q: [B, x + 1, N, D].
    """
    return decode_attention(q, k, v, lengths, window=window, scale=scale, sinks=sinks, implementation=implementation,
                            block_k=block_k, num_splits=num_splits)


def window_attention(q, k, v, q_pos, seen, *, window, scale=None, sinks=None, implementation=None, block_k=64,
                     num_splits=None):
    """Kernel 3: sliding-window attention over a ring buffer.

    Args:
        q: [B, T, N, D] queries at positions q_pos i32[B, T].
        k, v: [B, K, C, D] ring of capacity C >= W: slot `p % C` holds position `p` (v None: keys are the values).
            With C >= W + T - 1 the ring can be written before attending a block of T queries.
        seen: i32[B] tokens written into the ring so far (positions 0 .. seen - 1).
        window: W; key visible iff q_pos - W < pos <= q_pos.

    Returns:
        [B, T, N, D] in q's dtype. Only the C ring slots are read: the work is O(W), not O(position).
    """
    impl = resolve(implementation)
    if impl == "xla":
        return ref.window_reference(q, k, v, q_pos, seen, window=window, scale=scale, sinks=sinks)
    if impl == "native":
        return _native(q, k, v, q_pos, ref.ring_positions(seen, k.shape[2]), window=window, scale=scale,
                       sinks=sinks)
    return _run(q, k, v, q_pos, sinks=sinks, scale=scale, implementation=impl, pos_mode="ring", seen=seen,
                window=window, block_k=block_k, num_splits=num_splits)


def compressed_attention(q, k, v, q_pos, *, ratio, scale=None, sinks=None, implementation=None, block_k=64,
                         num_splits=None):
    """Kernel 4: attention over compressed (CSA/HCA) entries.

    Args:
        q: [B, T, N, D] queries at positions q_pos i32[B, T].
        k, v: [B, K, E, D] compressed entries, entry w summarising tokens w*m .. w*m + m - 1 (v None: shared K=V).
        ratio: m (static). Entry w is visible to the query at t iff w < (t + 1) // m; the loop stops at the last
            visible entry.

    Returns:
        [B, T, N, D] in q's dtype.
    """
    impl = resolve(implementation)
    if impl == "xla":
        return ref.compressed_reference(q, k, v, q_pos, ratio=ratio, scale=scale, sinks=sinks)
    if impl == "native":  # entry w visible iff w < (t + 1) // m  <=>  its last token w * m + m - 1 <= t
        E = k.shape[2]
        k_pos = jnp.broadcast_to(jnp.arange(E, dtype=jnp.int32)[None, :] * ratio + ratio - 1, (q.shape[0], E))
        return _native(q, k, v, q_pos, k_pos, window=None, scale=scale, sinks=sinks)
    return _run(q, k, v, q_pos, sinks=sinks, scale=scale, implementation=impl, pos_mode="affine", ratio=ratio,
                block_k=block_k, num_splits=num_splits)
