"""Where the refreshing drafter's scores come from, for the Llama family: block masses of queries over the full cache.

`verify_forward_scored` is `verify.verify_forward` plus, per full-attention layer, the softmax mass the queries of
some verify rows put on each block of the cache — a side computation on the layer's own queries and keys: the
attention call, and so every logit, is exactly `verify_forward`'s (tests assert bit-identity). `prompt_block_masses`
scores the prompt from its last tokens' queries, for the first selection.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.cache.dense import DenseKV, ModelCache, WindowKV
from kvjax.models.attention import attention, canonical_attention
from kvjax.models.attention_scores import block_mass
from kvjax.models.llama.config import ModelConfig
from kvjax.models.llama.layers import decoder_stack, lm_head
from kvjax.models.llama.model import _attend_layer


def verify_forward_scored(params, config: ModelConfig, cache: ModelCache, tokens, n_valid, *, rows: tuple[int, ...],
                          block: int, implementation: str | None = None):
    """(logits f32[B, T, V], new cache, per layer block mass f32[B, K, S // block] of the queries at `rows` (None for
    sliding layers)) — logits and cache bit-identical to `verify_forward`'s."""
    B, T = tokens.shape
    positions = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    attn = functools.partial(canonical_attention, implementation=implementation)
    r = jnp.asarray([i % T for i in rows], jnp.int32)

    def attend(i, form, q, k, v):
        out, new = _attend_layer(form, q, k, v, positions, n_valid, attn)
        if not isinstance(new, DenseKV):
            return out, new, None
        qr = jax.lax.stop_gradient(q[:, r])
        return out, new, block_mass(qr, new.k, positions[:, r], new.key_positions(), block)

    h, layers, masses = decoder_stack(params, config, tokens, positions, cache.layers, attend)
    return lm_head(params, config, h), ModelCache(layers=layers, length=cache.length + n_valid), masses


@functools.partial(jax.jit, static_argnames="block")
def prompt_block_masses(params, config: ModelConfig, cache: ModelCache, tokens: jax.Array, start: jax.Array, *,
                        block: int):
    """Per layer block mass f32[B, K, S // block] (None for sliding layers) that prompt tokens i32[B, T] at positions
    start + t put on the prefilled cache (which already holds them; it is read, never written)."""
    T = tokens.shape[1]
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]

    def attend(i, form, q, k, v):
        if isinstance(form, WindowKV):
            return attention(q, form.k, form.v, positions, form.slot_positions(), window=form.window), form, None
        kpos = form.key_positions()
        out = attention(q, form.k, form.v, positions, kpos)
        return out, form, block_mass(q, form.k, positions, kpos, block)

    _, _, masses = decoder_stack(params, config, tokens, positions, cache.layers, attend)
    return masses
