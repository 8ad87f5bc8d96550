"""Attention scores as a side computation: where queries put their softmax mass over a cache, block by block.

Used to choose what a draft cache keeps (`kvjax.compress.refresh`); never part of a forward's own arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.models.attention import MASK_VALUE, visible


def block_mass(q: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array, block: int) -> jax.Array:
    """Softmax mass f32[B, K, S // block] that queries q [B, R, N, D] at q_pos i32[B, R] put on each block of keys
    k [B, K, S, D] (positions k_pos i32[B, S]), summed over each KV head's query group and the R rows."""
    B, R, N, D = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, R, K, N // K, D)
    s = jnp.einsum("BRKGD,BKSD->BKGRS", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * D**-0.5
    mask = visible(q_pos, k_pos, None)[:, :, None]
    s = jnp.where(mask, s, MASK_VALUE)
    p = jnp.where(mask, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    mass = jnp.sum(p, axis=(2, 3))  # [B, K, S]
    pad = (-S) % block
    mass = jnp.pad(mass, ((0, 0), (0, 0), (0, pad)))
    return mass.reshape(B, K, -1, block).sum(-1)
