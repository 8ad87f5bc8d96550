"""Stateless DeepSeek-V4 building blocks: norms, interleaved partial RoPE, hyper-connections, MoE, window pooling.
Each follows transformers 5.24 `modeling_deepseek_v4.py` (the definition); quirks are noted inline. Attention itself
(window, HCA, CSA parts with sinks) goes through the dispatcher, `kvjax.models.attention.attention_merged`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.models.rope import RopeConfig, rope_inv_freq
from kvjax.models.attention import MASK_VALUE
from kvjax.models.layers import trig_tables

F32 = jnp.float32


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm in f32; the (f32) weight multiplies in f32 and the result is cast once (V4 keeps norm weights in f32)."""
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        xf = weight.astype(F32) * xf
    return xf.astype(x.dtype)


def rope_tables(rope: RopeConfig, rope_dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Half-width cos/sin f32[..., rope_dim // 2] for integer `positions` (one angle per interleaved pair)."""
    inv, scale = rope_inv_freq(rope, rope_dim)
    freqs = positions.astype(F32)[..., None] * jnp.asarray(inv, F32)
    return trig_tables(freqs, scale)  # computed once, not in every use (`kvjax.models.layers.trig_tables`)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Interleaved RoPE on the trailing `2 * cos.shape[-1]` channels of `x [..., D]` (leading channels untouched).

    Pairs are consecutive channels `(2i, 2i+1)` of the rope slice; `cos`/`sin` must broadcast to `x[..., :rd // 2]`.
    """
    rd = 2 * cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    x1, x2 = rope[..., 0::2].astype(F32), rope[..., 1::2].astype(F32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    rotated = jnp.stack([o1, o2], axis=-1).reshape(rope.shape).astype(x.dtype)
    return jnp.concatenate([nope, rotated], axis=-1)


def hyper_weights(p: dict, x: jax.Array, *, iters: int, hc_eps: float, norm_eps: float):
    """Manifold-constrained hyper-connection weights (Sinkhorn-projected mixing) and the collapsed block input.

    Args:
        p: {"fn" [hc*H, (2+hc)*hc], "base" [(2+hc)*hc], "scale" [3]}.
        x: [B, T, hc, H] residual streams.

    Returns:
        (post [B, T, hc], comb [B, T, hc, hc], collapsed [B, T, H]).
    """
    B, T, hc, H = x.shape
    flat = rms_norm(x.reshape(B, T, hc * H).astype(F32), None, norm_eps)
    mix = flat @ p["fn"].astype(F32)
    base, scale = p["base"].astype(F32), p["scale"].astype(F32)
    pre = jax.nn.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(mix[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = mix[..., 2 * hc:].reshape(B, T, hc, hc) * scale[2] + base[2 * hc:].reshape(hc, hc)
    comb = jax.nn.softmax(comb, axis=-1) + hc_eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + hc_eps)

    def sinkhorn(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    comb = jax.lax.fori_loop(0, iters - 1, sinkhorn, comb)
    collapsed = jnp.sum(pre[..., None] * x, axis=2).astype(x.dtype)
    return post, comb, collapsed


def hyper_merge(post: jax.Array, comb: jax.Array, out: jax.Array, x: jax.Array) -> jax.Array:
    """New streams `post_k * out + sum_j comb[j, k] x_j` (comb is read transposed, as transformers does)."""
    dt = x.dtype
    return post.astype(dt)[..., None] * out[:, :, None, :] + jnp.einsum("BTjk,BTjH->BTkH", comb.astype(dt), x)


def hyper_head(p: dict, x: jax.Array, *, hc_eps: float, norm_eps: float) -> jax.Array:
    """Final collapse of the hc streams: x [B, T, hc, H] -> [B, T, H]."""
    B, T, hc, H = x.shape
    flat = rms_norm(x.reshape(B, T, hc * H).astype(F32), None, norm_eps)
    pre = jax.nn.sigmoid((flat @ p["fn"].astype(F32)) * p["scale"].astype(F32) + p["base"].astype(F32)) + hc_eps
    return jnp.sum(pre[..., None] * x, axis=2).astype(x.dtype)


def _clamped_swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    return jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)


def moe(p: dict, x: jax.Array, tokens: jax.Array, *, hashed: bool, top_k: int, scoring: str, scaling: float,
        limit: float) -> jax.Array:
    """Routed experts + one shared expert. x: [B, T, H]; tokens: i32[B, T] (hash routing reads them).

    Routing as transformers: scores = f(x @ gate); experts = top-k of scores + bias (or `tid2eid[token]` for hash
    layers); weights = the chosen scores normalised to sum 1 (always — transformers ignores `norm_topk_prob`) times
    `routed_scaling_factor`. A duplicated expert id (e.g. an all-zero `tid2eid`) counts once per occurrence, like
    transformers' `index_add_`. Experts run densely (every expert on every token, weighted by a combine matrix that is
    zero off the chosen ones): exact and differentiable, fine for the small configs this runs on the CPU.
    """
    logits = (x @ p["gate"]).astype(F32)  # [B, T, E]
    E = logits.shape[-1]
    if scoring == "sqrtsoftplus":
        scores = jnp.sqrt(jax.nn.softplus(logits))
    else:  # "sigmoid" (the config rejects anything else)
        scores = jax.nn.sigmoid(logits)
    if hashed:
        idx = p["tid2eid"][tokens]  # [B, T, k]
    else:
        # ties: lax.top_k keeps the lower expert index (torch.topk's order on ties is unspecified)
        _, idx = jax.lax.top_k(jax.lax.stop_gradient(scores + p["bias"].astype(F32)), top_k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * scaling
    combine = jnp.sum(jax.nn.one_hot(idx, E, dtype=F32) * w[..., None], axis=-2)  # [B, T, E]
    g = jnp.einsum("BTH,EHI->BTEI", x, p["w1"])
    u = jnp.einsum("BTH,EHI->BTEI", x, p["w3"])
    y = jnp.einsum("BTEI,EIH->BTEH", _clamped_swiglu(g, u, limit), p["w2"])
    routed = jnp.einsum("BTEH,BTE->BTH", y, combine.astype(y.dtype))
    s = p["shared"]
    shared = _clamped_swiglu(x @ s["w1"], x @ s["w3"], limit) @ s["w2"]
    return (routed + shared).astype(x.dtype)


def pool_windows(win_kv: jax.Array, win_gate: jax.Array, slot_ok: jax.Array, bias: jax.Array) -> jax.Array:
    """Softmax-gated pooling of each window's slots: sum_s softmax_s(gate + bias) * kv.

    Args:
        win_kv, win_gate: [B, J, S, d]; slot_ok: bool[B, J, S] (False = no token there, weight exactly 0);
        bias: [S, d] learned position bias.

    Returns:
        [B, J, d] pooled (before the compressor's norm and rope).
    """
    g = win_gate.astype(F32) + bias.astype(F32)
    g = jnp.where(slot_ok[..., None], g, MASK_VALUE)
    w = jax.nn.softmax(g, axis=2)
    w = jnp.where(slot_ok[..., None], w, 0.0)
    return jnp.sum(win_kv * w.astype(win_kv.dtype), axis=2)
