"""The Llama decoder, written once: q/k/v projection and the layer stack that the full-cache forward, the draft
forward and the KV scorers all run, each with its own attention over its own state.

`decoder_stack(params, config, tokens, positions, states, attend)` runs embed -> per layer (norm, q/k/v, attend, o,
norm, gated MLP) -> final norm; `attend(i, state, q, k, v)` returns `(out [B, T, N, D], new state, aux)`, so the
three callers differ only in what they attend to. `lm_head` turns hidden states into f32 logits.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from kvjax.models.layers import apply_rope, rms_norm, rope_cos_sin
from kvjax.models.llama.config import ModelConfig
from pallas_kernels import linear
from pallas_kernels.affine import pack_affine
from pallas_kernels.linear import pack_f32, packable, packed_weights_supported

Params = dict[str, Any]


FUSED_PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")  # a layer's matrices in `fuse_projections`' layout


def fuse_projections(params: Params) -> Params:
    """`params` with each layer's q/k/v projections (and biases) as one `wqkv` [H, (N + 2K) D] and its gate/up
    projections as one `w_gate_up` [H, 2I]: two matmuls where there were five.

    For the one-token loops (decode, drafting), which call it once before their loop: a step of the bundled model is
    ~110 small ops on XLA:CPU, and the fused loops measured decode 1.11x / 1.12x / 1.00x and drafting 1.05x (8K) /
    1.12x (32K) the unfused ones at 64 / 8K / 32K tokens, same tokens (`scripts/bench_fused_loops.py`). The
    concatenation copies the projections once per call, which the loop amortises; the stored layout (weights I/O,
    sharding by heads, training) stays unfused.
    """
    def fuse(layer):
        if "wqkv" in layer:  # already fused (a draft's weights are stored fused)
            return layer
        layer = dict(layer)
        layer["wqkv"] = jnp.concatenate([layer.pop("wq"), layer.pop("wk"), layer.pop("wv")], axis=1)
        if "bq" in layer:
            layer["bqkv"] = jnp.concatenate([layer.pop("bq"), layer.pop("bk"), layer.pop("bv")], axis=0)
        layer["w_gate_up"] = jnp.concatenate([layer.pop("w_gate"), layer.pop("w_up")], axis=1)
        return layer

    return dict(params, layers=tuple(fuse(layer) for layer in params["layers"]))


def pack_projections(params: Params) -> Params:
    """`params` with each layer's f32 projection matrices (q/k/v/o, gate/up/down, fused or not) and the output head (for
    tied embeddings, the embedding transposed) as `pallas_kernels.linear.PackedF32` where the native CPU product reads
    them (elsewhere, or for a matrix whose width is not a multiple of 64: unchanged) -- or, where every weight of a
    matrix is exactly a block-affine code (a GGUF model's, `pallas_kernels.affine`), as those codes (`PackedAffine`: the
    same values and bits at 1.25 bytes per weight; SmolLM2's loop layout 170 MB instead of 538, its decode step at 8K
    27.4 ms instead of ~40), and where every weight is exactly a bf16 value (a bf16 checkpoint's), in bf16 panels (the
    same values and bits at 2 bytes per weight, `pack_f32`). `linear` gives the same bits for
    either layout, so verify-shape forwards and decode loops (`Model.verify_params()`, `Model.loop_params()`: one fused,
    packed copy) compute the plain layout's hidden states bit for bit at the native rows; their logits are the packed
    head's (the native product's rounding, not XLA's dot of the embedding), the same in VeriCache's verification, its
    reference decoder and plain decoding.

    Why: the native product runs register tiles over 64-column panels of each matrix; in the [K, N] layout a panel is K
    runs of 256 bytes N * 4 bytes apart, which the hardware prefetchers follow poorly. SmolLM2's 120 products per step
    as a dependent chain, one process: 9 rows 31.5 vs 43.6 ms, 17 rows 41.3 vs 59.5 ms, 1 row 22.0 vs 23.2 ms; its
    decode step 44.2 vs 49.0 ms (the fused layout packed, against XLA's one-row dot).
    """
    if not packed_weights_supported():
        return params
    names = ("wq", "wk", "wv", "wqkv", "wo", "w_gate", "w_up", "w_gate_up", "w_down")

    def packed(w):  # exact codes where the weights are (a GGUF model's), else the f32 panels
        return pack_affine(w) or pack_f32(w)

    def pack(layer):
        return {k: packed(v) if k in names and packable(v) else v for k, v in layer.items()}

    out = dict(params, layers=tuple(pack(layer) for layer in params["layers"]))
    # the output head packed too; tied embeddings get their own [H, V] copy (SmolLM2: 113 MB), read by the native tiles
    # instead of XLA's dot of the transposed embedding: SmolLM2 at 8K, one process, decode step 40.9 vs 43.0 ms, verify
    # x = 8 70.8 vs 73.6 ms
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    if packable(head):
        out["lm_head"] = packed(head)
    return out


def project_qkv(config: ModelConfig, layer: Params, h: jax.Array, positions: jax.Array):
    """Normalised hidden states [B, T, H] -> rotated q [B, T, N, D], k [B, T, K, D], v [B, T, K, D]."""
    B, T, _ = h.shape
    N, K, D = config.num_heads, config.num_kv_heads, config.head_dim
    if "wqkv" in layer:  # fuse_projections' layout
        qkv = linear(h, layer["wqkv"])
        if config.attention_bias:
            qkv = qkv + layer["bqkv"]
        q, k, v = qkv[..., :N * D], qkv[..., N * D:(N + K) * D], qkv[..., (N + K) * D:]
    else:
        q = linear(h, layer["wq"])
        k = linear(h, layer["wk"])
        v = linear(h, layer["wv"])
        if config.attention_bias:
            q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    q = q.reshape(B, T, N, D)
    k = k.reshape(B, T, K, D)
    v = v.reshape(B, T, K, D)
    if config.qk_norm:
        q = rms_norm(q, layer["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], config.rms_norm_eps)
    cos, sin = rope_cos_sin(config.rope, D, positions)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def decoder_stack(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array, states,
                  attend: Callable[..., tuple]):
    """Run the decoder over `T` tokens per row.

    Args:
        tokens: i32[B, T]; positions: i32[B, T] absolute positions (rope and masks).
        states: one per-layer state (any pytree, or None) handed to `attend`.
        attend: `(layer index, state, q [B, T, N, D], k [B, T, K, D], v [B, T, K, D]) -> (out [B, T, N, D],
            new state, aux)`.

    Returns:
        (final normalised hidden states [B, T, H], tuple of new states, tuple of auxes).
    """
    B, T = tokens.shape
    x = params["embed"][tokens]
    new_states, auxes = [], []
    for i, (layer, state) in enumerate(zip(params["layers"], states)):
        h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        q, k, v = project_qkv(config, layer, h, positions)
        out, state, aux = attend(i, state, q, k, v)
        x = x + linear(out.reshape(B, T, -1), layer["wo"])
        h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
        if "w_gate_up" in layer:  # fuse_projections' layout
            gate, up = jnp.split(linear(h, layer["w_gate_up"]), 2, axis=-1)
            x = x + linear(jax.nn.silu(gate) * up, layer["w_down"])
        else:
            x = x + linear(jax.nn.silu(linear(h, layer["w_gate"])) * linear(h, layer["w_up"]), layer["w_down"])
        new_states.append(state)
        auxes.append(aux)
    return rms_norm(x, params["final_norm"], config.rms_norm_eps), tuple(new_states), tuple(auxes)


def lm_head(params: Params, config: ModelConfig, h: jax.Array) -> jax.Array:
    """Logits f32[B, T, V] of final hidden states [B, T, H] (tied embeddings or `lm_head`; a draft's coarse head,
    `coarse_head_logits`)."""
    if "lm_head_coarse" in params:
        return coarse_head_logits(h, params["lm_head_coarse"], params["lm_head_rows"])
    # a draft's weights (`kvjax.decode.draft_weights`) carry their own [H, V] head even when embeddings are tied
    if "lm_head" not in params:  # tied: XLA's dot reads the embedding transposed; a product call would copy it
        return (h @ params["embed"].T).astype(jnp.float32)
    return linear(h, params["lm_head"]).astype(jnp.float32)


COARSE_BLOCK = 16  # vocabulary entries per block of a coarse head's candidates
COARSE_BLOCKS = 16  # blocks re-scored exactly


def coarse_head_logits(h: jax.Array, coarse, rows: jax.Array) -> jax.Array:
    """A draft's output head read mostly as 4-bit codes: logits f32[B, T, V] from the coarse product (`coarse`, an
    `IntDotCodes` [H, V]), except the `COARSE_BLOCKS` blocks of `COARSE_BLOCK` entries with the largest coarse logit,
    which take the exact rows `rows` [V, H] (the model's own head). The exact argmax lies in those blocks unless the
    coarse error moved it out of the top 256 (measured on SmolLM2: the coarse head's own argmax agreed with the
    exact one on 83% of 192 positions; its top 16 held the exact argmax on all of them), so greedy drafts are the exact
    head's for 60% of its bytes (SmolLM2: 18 MB of codes and 0.6 MB of rows against 30 MB of Q8_0 codes)."""
    logits = linear(h, coarse).astype(jnp.float32)
    *lead, V = logits.shape
    flat = logits.reshape(-1, V)
    best = flat.reshape(flat.shape[0], V // COARSE_BLOCK, COARSE_BLOCK).max(-1)
    _, top = jax.lax.top_k(best, min(COARSE_BLOCKS, V // COARSE_BLOCK))  # a small vocabulary: every block exact
    idx = (top[..., None] * COARSE_BLOCK + jnp.arange(COARSE_BLOCK)).reshape(flat.shape[0], -1)  # [R, C]
    exact = jnp.einsum("rh,rch->rc", h.reshape(-1, h.shape[-1]).astype(jnp.float32), rows[idx])
    flat = jax.vmap(lambda f, i, e: f.at[i].set(e))(flat, idx, exact)
    return flat.reshape(*lead, V)
