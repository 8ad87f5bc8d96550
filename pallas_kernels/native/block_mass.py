"""The refreshing drafter's block masses by native code (`block_mass.cc`, in the library `pallas_kernels.native`
builds): the same definition as `kvjax.models.attention_scores.block_mass_reference`, in one pass over the keys.

Measured (`scripts/bench_refresh_step.py --reps 9 [--smollm2-shape]`, 2-core EPYC shared with other jobs, medians of
interleaved rounds, three runs): the bundled model's 4 layers at 32,768 slots, R = 2 verify rows, native 0.27-0.37x
XLA's time and 1.25-1.75x a same-run reduction over the 64 MiB of keys (its memory floor; XLA 3.4-6.1x), e.g. 4.6 vs
12.4 ms on a quiet machine; R = 16 prompt rows 0.14-0.15x XLA (17 vs 114 ms; compute-bound, 4.3x the floor);
SmolLM2-135M's shape (30 layers, 9 / 3 heads, D = 64, 8,192 slots, random arrays) R = 2 0.52-0.59x XLA (1.5-1.7x the
floor), R = 16 0.33x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.native import BLOCK_MASS_TARGET, available, status


def block_mass(q: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array, block: int) -> jax.Array:
    """Softmax mass f32[B, K, ceil(S / block)] that queries q [B, R, N, D] at q_pos i32[B, R] put on each block of
    `block` keys k [B, K, S, D] (positions k_pos i32[B, S] or i32[B, K, S], -1 empty), summed over each KV head's
    query group and the R rows; key s is visible to a row iff 0 <= k_pos[s] <= q_pos, and a row that sees no key
    adds 0. Scale D ** -0.5. Inputs are taken as f32. Deterministic: the same inputs give the same bits."""
    if not available():
        raise RuntimeError(f"the native block-mass kernel is not available: {status()['reason']}")
    B, R, N, D = q.shape
    if k.ndim != 4 or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be [B, K, S, D] = [{B}, K, S, {D}], got {k.shape}")
    K, S = k.shape[1], k.shape[2]
    if K == 0 or N % K:
        raise ValueError(f"query heads N={N} must be a multiple of kv heads K={K}")
    if q_pos.shape != (B, R):
        raise ValueError(f"q_pos must be [B, R] = [{B}, {R}], got {q_pos.shape}")
    if k_pos.shape not in ((B, S), (B, K, S)):
        raise ValueError(f"k_pos must be [B, S] or [B, K, S], got {k_pos.shape} for k {k.shape}")
    if int(block) < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    f32 = jnp.float32
    out = jax.ShapeDtypeStruct((B, K, -(-S // int(block))), f32)
    call = jax.ffi.ffi_call(BLOCK_MASS_TARGET, out, vmap_method="sequential")
    return call(q.astype(f32), k.astype(f32), q_pos.astype(jnp.int32), k_pos.astype(jnp.int32),
                block=np.int64(block), scale=np.float32(D**-0.5))
