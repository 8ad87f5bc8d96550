"""Llama / Qwen2 / Qwen3 / Mistral forward pass over a params pytree and a `ModelCache`.

One function serves prefill chunks, one-token decode, drafting and verification: it takes `T` new tokens per
sequence (`n_valid[b]` of them real, the rest padding), writes their keys/values into the cache with masked scatters
and attends by absolute position. Shapes depend only on `(B, T)` and the cache's static capacities.

Params layout (all matrices `[in, out]`):
    embed [V, H]; final_norm [H]; lm_head [H, V] (absent when embeddings are tied);
    layers: tuple of dicts with attn_norm [H], wq [H, N*D], wk [H, K*D], wv [H, K*D], wo [N*D, H],
    optional bq/bk/bv (Qwen2), q_norm/k_norm [D] (Qwen3), mlp_norm [H], w_gate/w_up [H, I], w_down [I, H].
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from kvjax.cache.chunked import ChunkedKV
from kvjax.cache.dense import ModelCache, WindowKV
from kvjax.models.llama.cache import init_cache
from kvjax.models.llama.config import ModelConfig
from kvjax.models.attention import attention as dispatched_attention
from kvjax.models.attention import attention_parts
from kvjax.models.llama.layers import Params, decoder_stack, lm_head

# attention(q [B,T,N,D], k [B,K,S,D], v, q_pos i32[B,T], k_pos i32[B,S] | [B,K,S], *, window) -> [B,T,N,D]
AttentionFn = Callable[..., jax.Array]


def _attend_layer(form, q, k, v, positions, n_valid, attention_fn, implementation=None):
    """Write the new k/v into this layer's form and attend. Returns (out [B, T, N, D], new form)."""
    if isinstance(form, ChunkedKV):
        # a decode loop's layer: the base is read in place, the new rows go to the chunk (kvjax.cache.chunked)
        form = form.write(k, v, n_valid)
        return attention_parts(q, form.parts(), positions, window=None, implementation=implementation), form
    if isinstance(form, WindowKV):
        # Attend over the ring as it was (old positions) plus the new chunk, then roll the chunk in.
        T = k.shape[1]
        ring_pos = form.slot_positions()  # [B, W]
        t = jnp.arange(T)[None, :]
        new_pos = jnp.where(t < n_valid[:, None], positions, -1)
        keys = jnp.concatenate([form.k, jnp.swapaxes(k, 1, 2).astype(form.k.dtype)], axis=2)
        vals = jnp.concatenate([form.v, jnp.swapaxes(v, 1, 2).astype(form.v.dtype)], axis=2)
        kpos = jnp.concatenate([ring_pos, new_pos], axis=1)
        out = attention_fn(q, keys, vals, positions, kpos, window=form.window)
        return out, form.write(k, v, n_valid)
    form = form.write(k, v, n_valid)
    out = attention_fn(q, form.k, form.v, positions, form.key_positions(), window=None)
    return out, form


def forward(
    params: Params,
    config: ModelConfig,
    cache: ModelCache,
    tokens: jax.Array,
    n_valid: jax.Array | None = None,
    *,
    attention_fn: AttentionFn = dispatched_attention,
    return_hidden: bool = False,
    implementation: str | None = None,
    logit_rows: jax.Array | None = None,
):
    """Run `T` new tokens per sequence through the model, appending them to `cache`.

    Args:
        params: the params pytree (layout in the module docstring).
        config: static model config.
        cache: state before these tokens; new tokens take positions `cache.length + t`.
        tokens: i32[B, T] token ids (padding rows beyond `n_valid` are ignored).
        n_valid: i32[B] real tokens per row (default: all T).
        attention_fn: attention implementation with `attend`'s signature (default: the dispatcher — Pallas on
            GPU, XLA on CPU).
        return_hidden: also return the final normalised hidden states [B, T, H].
        implementation: the attention implementation of a decode loop's `ChunkedKV` layers (`attention_parts`).
        logit_rows: i32[B, R] the rows to compute logits for (default: all T). A prefill chunk needs only its last
            real row: the vocabulary projection of every row was 1/6 of a chunk's FLOPs on the bundled model.

    Returns:
        (logits f32[B, T, V] — f32[B, R, V] with `logit_rows` —, new cache) — and hidden states when asked.
    """
    B, T = tokens.shape
    if n_valid is None:
        n_valid = jnp.full((B,), T, jnp.int32)
    positions = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]

    def attend(i, form, q, k, v):
        out, form = _attend_layer(form, q, k, v, positions, n_valid, attention_fn, implementation)
        return out, form, None

    h, layers, _ = decoder_stack(params, config, tokens, positions, cache.layers, attend)
    logits = lm_head(params, config, h if logit_rows is None else jnp.take_along_axis(h, logit_rows[..., None], 1))
    new_cache = ModelCache(layers=layers, length=cache.length + n_valid)
    if return_hidden:
        return logits, new_cache, h
    return logits, new_cache


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random params (normal, std 0.02; output projections scaled by 1/sqrt(2 * layers), GPT-2 style) for training."""
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    N, K, D = config.num_heads, config.num_kv_heads, config.head_dim
    keys = iter(jax.random.split(key, 8 * config.num_layers + 4))
    std = 0.02
    out_std = std / (2 * config.num_layers) ** 0.5

    def w(shape, s=std):
        return (jax.random.normal(next(keys), shape, jnp.float32) * s).astype(dtype)

    layers = []
    for _ in range(config.num_layers):
        layer = {
            "attn_norm": jnp.ones((H,), dtype), "mlp_norm": jnp.ones((H,), dtype),
            "wq": w((H, N * D)), "wk": w((H, K * D)), "wv": w((H, K * D)), "wo": w((N * D, H), out_std),
            "w_gate": w((H, I)), "w_up": w((H, I)), "w_down": w((I, H), out_std),
        }
        if config.attention_bias:
            layer.update(bq=jnp.zeros((N * D,), dtype), bk=jnp.zeros((K * D,), dtype), bv=jnp.zeros((K * D,), dtype))
        if config.qk_norm:
            layer.update(q_norm=jnp.ones((D,), dtype), k_norm=jnp.ones((D,), dtype))
        layers.append(layer)
    params = {"embed": w((V, H)), "final_norm": jnp.ones((H,), dtype), "layers": tuple(layers)}
    if not config.tie_word_embeddings:
        params["lm_head"] = w((H, V))
    return params


def forward_train(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Full causal forward with no carried state (training / evaluation): logits f32[B, T, V]."""
    B, T = tokens.shape
    cache = init_cache(config, B, T, params["embed"].dtype)
    logits, _ = forward(params, config, cache, tokens)
    return logits
