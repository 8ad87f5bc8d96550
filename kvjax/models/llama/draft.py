"""The same Llama-family model run over a lossy `DraftCache` (the VeriCache drafter).

Sibling of `kvjax.models.llama.forward`: it reuses `project_qkv`, `rms_norm`, `gated_mlp` and differs only in the
state it attends to — each layer's compressed prompt parts plus its recent ring, every key at its original absolute
position (per-head positions allowed). The new tokens are written into the ring first, then attended.

Attention over several parts never concatenates keys/values (that would copy the whole draft cache each step):
scores are computed per part and concatenated (T x N x S floats, tiny for T = 1), one softmax, and the weighted
values are summed part by part.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache.draft import DraftCache, DraftLayer
from kvjax.models.llama.config import ModelConfig
from kvjax.models.attention import MASK_VALUE, visible
from kvjax.models.layers import gated_mlp, rms_norm
from kvjax.models.llama import project_qkv


def attend_parts(q: jax.Array, parts, q_pos: jax.Array, *, window: int | None = None) -> jax.Array:
    """Position-masked GQA attention over several (k, v, pos) parts, as if they were one cache.

    Args:
        q: [B, T, N, D] queries.
        parts: sequence of (k [B, K, S_i, D], v [B, K, S_i, D], pos i32[B, S_i] or [B, K, S_i]).
        q_pos: i32[B, T] absolute query positions.
        window: sliding window or None.

    Returns:
        [B, T, N, D] in q's dtype.
    """
    B, T, N, D = q.shape
    K = parts[0][0].shape[1]
    G = N // K
    qg = q.reshape(B, T, K, G, D)
    scores, masks = [], []
    for k, _, pos in parts:
        s = jnp.einsum("BTKGD,BKSD->BKGTS", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * D**-0.5
        m = visible(q_pos, pos, window)[:, :, None]  # [B, K|1, 1, T, S]
        scores.append(jnp.where(m, s, MASK_VALUE))
        masks.append(jnp.broadcast_to(m, s.shape))
    s = jnp.concatenate(scores, axis=-1)
    mask = jnp.concatenate(masks, axis=-1)
    mx = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - mx), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = 0.0
    start = 0
    for k, v, _ in parts:
        S = k.shape[2]
        o = o + jnp.einsum("BKGTS,BKSD->BTKGD", p[..., start:start + S], v.astype(jnp.float32))
        start += S
    o = o / jnp.maximum(jnp.transpose(l, (0, 3, 1, 2, 4)), 1e-30)
    return o.reshape(B, T, N, D).astype(q.dtype)


def draft_forward(params, config: ModelConfig, cache: DraftCache, tokens: jax.Array, n_valid: jax.Array | None = None):
    """Run `T` tokens over the draft cache, writing their keys/values into each layer's recent ring.

    Args:
        tokens: i32[B, T] (T <= every ring's slots); rows beyond n_valid[b] are padding.

    Returns:
        (logits f32[B, T, V], new DraftCache).
    """
    B, T = tokens.shape
    if n_valid is None:
        n_valid = jnp.full((B,), T, jnp.int32)
    positions = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    x = params["embed"][tokens]
    new_layers = []
    for layer, dl in zip(params["layers"], cache.layers):
        h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        q, k, v = project_qkv(config, layer, h, positions)
        recent = dl.recent.write(k, v, positions, n_valid)
        parts = [p.dense() for p in dl.parts] + [recent.dense()]
        out = attend_parts(q, parts, positions, window=dl.window)
        x = x + out.reshape(B, T, -1) @ layer["wo"]
        h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
        x = x + gated_mlp(h, layer["w_gate"], layer["w_up"], layer["w_down"])
        new_layers.append(DraftLayer(parts=dl.parts, recent=recent, window=dl.window))
    h = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    logits = (h @ head).astype(jnp.float32)
    return logits, DraftCache(layers=tuple(new_layers), length=cache.length + n_valid)
