"""Moving between the public layouts and the kernels' tiles.

Public layouts: queries `[B, T, N, D]`, caches `[B, K, S, D]`. Inside a kernel one program owns one KV head of one
sequence and all `R = T * G` query rows that read it (`G = N // K`), so the query tile is `[R, D]` with row `r` holding
query `t = r // G`, head `k * G + r % G`. Rows are padded to a power of two of at least 16 (Triton's `tl.dot` needs
M >= 16 and power-of-two tiles); padded rows carry position -1, see nothing, and finalise to zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MIN_ROWS = 16
MIN_BLOCK = 16  # Triton's tl.dot needs every tile dimension >= 16


def block_size(requested: int, extent: int) -> int:
    """A power-of-two block in [MIN_BLOCK, next_pow2(extent)] (padding covers the rest)."""
    return max(MIN_BLOCK, min(next_pow2(requested), next_pow2(extent)))


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def row_count(T: int, G: int) -> int:
    """Padded row count R of the query tile."""
    return max(MIN_ROWS, next_pow2(T * G))


def queries_to_rows(q: jax.Array, K: int, R: int) -> jax.Array:
    """[B, T, N, D] -> [B, K, R, D] (rows beyond T * G are zeros)."""
    B, T, N, D = q.shape
    G = N // K
    rows = jnp.transpose(q.reshape(B, T, K, G, D), (0, 2, 1, 3, 4)).reshape(B, K, T * G, D)
    return jnp.pad(rows, ((0, 0), (0, 0), (0, R - T * G), (0, 0)))


def positions_to_rows(q_pos: jax.Array, G: int, R: int) -> jax.Array:
    """i32[B, T] -> i32[B, R]: each query's position repeated over its G heads, -1 on padding rows."""
    B, T = q_pos.shape
    rows = jnp.repeat(q_pos.astype(jnp.int32), G, axis=1)
    return jnp.pad(rows, ((0, 0), (0, R - T * G)), constant_values=-1)


def rows_to_queries(o: jax.Array, T: int, N: int) -> jax.Array:
    """[B, K, R, D] -> [B, T, N, D] (drops padding rows)."""
    B, K, R, D = o.shape
    G = N // K
    o = o[:, :, : T * G].reshape(B, K, T, G, D)
    return jnp.transpose(o, (0, 2, 1, 3, 4)).reshape(B, T, N, D)


def sinks_to_rows(sinks: jax.Array | None, K: int, T: int, R: int) -> jax.Array | None:
    """f32[N] per-head sink logits -> f32[1, K, R] matching the row layout (padding rows get the finite mask value:
    they have no keys either, so they stay zeros)."""
    if sinks is None:
        return None
    G = sinks.shape[0] // K
    rows = jnp.tile(sinks.astype(jnp.float32).reshape(K, 1, G), (1, T, 1)).reshape(K, T * G)
    rows = jnp.pad(rows, ((0, 0), (0, R - T * G)), constant_values=-0.7 * float(jnp.finfo(jnp.float32).max))
    return rows[None]


TARGET_PROGRAMS = 128  # about one wave of thread blocks on a current datacenter GPU (132 SMs on H100/H200)
MIN_BLOCKS_PER_SPLIT = 8


def auto_splits(num_splits: int | None, B: int, K: int, S: int, block_k: int) -> int:
    """Split-K factor: the given one, or (None) enough splits that `B * K * splits` fills about one wave of the GPU
    while each split keeps at least 8 blocks (an untuned heuristic, see README)."""
    if num_splits is not None:
        return max(1, int(num_splits))
    want = max(1, TARGET_PROGRAMS // max(1, B * K))
    cap = max(1, S // (MIN_BLOCKS_PER_SPLIT * block_k))
    return 1 << (min(want, cap).bit_length() - 1)
