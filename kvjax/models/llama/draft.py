"""The same Llama-family model run over a lossy `DraftCache` (the VeriCache drafter), and the draft's update after a
verification.

The drafter is `decoder_stack` with a different attention: each layer attends over its compressed prompt parts plus
its recent ring, every key at its original absolute position (per-head positions allowed). The new tokens are
written into the ring first, then attended. Attention over several parts goes through the dispatcher's
`attention_parts` (one online-softmax partial per part, merged by `combine`), so the parts are never concatenated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache.dense import ModelCache, WindowKV
from kvjax.cache.draft import DraftCache, DraftLayer, attention_part
from kvjax.models.attention import attention_parts
from kvjax.models.llama.config import ModelConfig
from kvjax.models.llama.layers import decoder_stack, lm_head


def draft_forward(params, config: ModelConfig, cache: DraftCache, tokens: jax.Array, n_valid: jax.Array | None = None,
                  *, implementation: str | None = None):
    """Run `T` tokens over the draft cache, writing their keys/values into each layer's recent ring.

    Args:
        tokens: i32[B, T] (T <= every ring's slots); rows beyond n_valid[b] are padding.
        implementation: attention implementation for `attention_parts`.

    Returns:
        (logits f32[B, T, V], new DraftCache).
    """
    B, T = tokens.shape
    if n_valid is None:
        n_valid = jnp.full((B,), T, jnp.int32)
    positions = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]

    def attend(i, dl: DraftLayer, q, k, v):
        recent = dl.recent.write(k, v, positions, n_valid)
        parts = [attention_part(p) for p in dl.parts] + [recent.dense()]
        out = attention_parts(q, parts, positions, window=dl.window, implementation=implementation)
        return out, dataclasses.replace(dl, recent=recent), None

    h, layers, _ = decoder_stack(params, config, tokens, positions, cache.layers, attend)
    return lm_head(params, config, h), dataclasses.replace(cache, layers=layers, length=cache.length + n_valid)


def layer_rows(form, start: jax.Array, T: int):
    """Keys/values of positions start..start+T-1 from a full-cache layer form: ([B, T, K, D], [B, T, K, D])."""
    if isinstance(form, WindowKV):
        slot = jnp.mod(start[:, None] + jnp.arange(T)[None, :], form.window)
    else:
        slot = jnp.minimum(start[:, None] + jnp.arange(T)[None, :], form.capacity - 1)
    k = jnp.take_along_axis(form.k, slot[:, None, :, None], axis=2)
    v = jnp.take_along_axis(form.v, slot[:, None, :, None], axis=2)
    return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)


def draft_commit(draft: DraftCache, full: ModelCache, start: jax.Array, keep: jax.Array, *, block: int) -> DraftCache:
    """After a verify of `block` rows at positions start..: forget every drafted position >= start, then write the
    `keep[b]` exact keys/values of positions start.. (from the committed full cache) into each recent ring.

    Nothing drafted survives: the draft continues from exactly the tokens the full cache emitted.
    """
    pos = start[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]
    layers = []
    for dl, form in zip(draft.layers, full.layers):
        k, v = layer_rows(form, start, block)
        layers.append(dataclasses.replace(dl, recent=dl.recent.rollback(start).write(k, v, pos, keep)))
    return dataclasses.replace(draft, layers=tuple(layers), length=start + keep)
