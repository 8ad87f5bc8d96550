"""Attention each cached prompt token receives from a block of scoring queries (for SnapKV / KVzip-style drafts).

`attention_received` runs the model over `T` scoring tokens at given positions, attending to the prefilled cache
(only slots with position < `limit[b]`) plus the block itself (causal), and never writes the cache. For every
full-attention layer it returns the softmax weight each cache slot gets, reduced over the block's queries (mean for
SnapKV's observation window, max for KVzip's reconstruction pass). Sliding layers are run (their outputs feed later
layers) but not scored.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.cache.dense import ModelCache, WindowKV
from kvjax.models.llama.config import ModelConfig
from kvjax.models.attention import MASK_VALUE, visible
from kvjax.models.llama.layers import decoder_stack


def _attend_with_probs(q, k_c, v_c, pos_c, k_n, v_n, pos_n, q_pos, window):
    """Attention over cache part (k_c [B,K,S,D]) + new block (k_n [B,K,T,D]); also returns probs on the cache part."""
    B, T, N, D = q.shape
    K = k_c.shape[1]
    qg = q.reshape(B, T, K, N // K, D)
    s_c = jnp.einsum("BTKGD,BKSD->BKGTS", qg, k_c) * D**-0.5
    s_n = jnp.einsum("BTKGD,BKSD->BKGTS", qg, k_n) * D**-0.5
    m_c = visible(q_pos, pos_c, window)[:, :, None]
    m_n = visible(q_pos, pos_n, window)[:, :, None]
    s = jnp.concatenate([jnp.where(m_c, s_c, MASK_VALUE), jnp.where(m_n, s_n, MASK_VALUE)], axis=-1)
    m = jnp.concatenate([jnp.broadcast_to(m_c, s_c.shape), jnp.broadcast_to(m_n, s_n.shape)], axis=-1)
    p = jnp.where(m, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    S = k_c.shape[2]
    o = jnp.einsum("BKGTS,BKSD->BTKGD", p[..., :S], v_c) + jnp.einsum("BKGTS,BKSD->BTKGD", p[..., S:], v_n)
    return o.reshape(B, T, N, D).astype(q.dtype), p[..., :S].reshape(B, N, T, S)


@functools.partial(jax.jit, static_argnames="reduce")
def attention_received(params, config: ModelConfig, cache: ModelCache, tokens: jax.Array, positions: jax.Array,
                       limit: jax.Array, *, reduce: str = "mean"):
    """Scores f32[B, N, S] per full-attention layer (None for sliding layers).

    Args:
        tokens: i32[B, T] scoring tokens at absolute `positions` i32[B, T] (unused rows: position -1).
        limit: i32[B] cache slots with position >= limit are invisible (SnapKV re-reads its own window).
        reduce: "mean" or "max" over the T queries.
    """
    qpos = jnp.maximum(positions, 0)
    valid = (positions >= 0)[:, None, :, None]

    def attend(i, form, q, k, v):
        if isinstance(form, WindowKV):
            pos_c, window = form.slot_positions(), form.window
        else:
            pos_c, window = form.key_positions(), None
        pos_c = jnp.where(pos_c < limit[:, None], pos_c, -1)
        out, p = _attend_with_probs(q, form.k, form.v, pos_c, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
                                    positions, qpos, window)
        if isinstance(form, WindowKV):
            return out, form, None
        if reduce == "max":
            return out, form, jnp.max(jnp.where(valid, p, 0.0), axis=2)
        return out, form, jnp.sum(jnp.where(valid, p, 0.0), axis=2) / jnp.maximum(jnp.sum(valid, axis=2), 1)

    _, _, scores = decoder_stack(params, config, tokens, qpos, cache.layers, attend)
    return tuple(scores)
