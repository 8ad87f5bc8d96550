"""Host offload of a Llama-family full cache: the prompt's dense KV lives in host memory between verifications.

`offload_split` keeps, per full-attention layer, the prompt's (k, v) buffers for the host and starts an empty
on-device tail (DenseKV, slot = position - prompt_len) for the tokens decoded since; sliding layers' rings are small
and stay on the device whole. `offload_join` assembles, on the device, a cache bitwise equal to the resident one from
the fetched prompt buffers and the tail (the fetched buffers are donated, so the assembly writes in place);
`offload_update` appends a verify's accepted rows to the tail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache.dense import DenseKV, ModelCache, WindowKV
from kvjax.models.llama.draft import layer_rows


def offload_split(full: ModelCache, tail_capacity: int):
    """(host part: per layer (k, v) or None, device part: per layer an empty DenseKV tail or the WindowKV ring)."""
    host = tuple(None if isinstance(l, WindowKV) else (l.k, l.v) for l in full.layers)
    tail = tuple(l if isinstance(l, WindowKV) else
                 DenseKV(k=jnp.zeros(l.k.shape[:2] + (tail_capacity,) + l.k.shape[3:], l.k.dtype),
                         v=jnp.zeros(l.v.shape[:2] + (tail_capacity,) + l.v.shape[3:], l.v.dtype),
                         length=jnp.zeros(l.length.shape, jnp.int32)) for l in full.layers)
    return host, tail


def offload_join(prompt_kv, tail, length: jax.Array, prompt_len: jax.Array) -> ModelCache:
    """The full cache from fetched prompt buffers (per layer (k, v) [B, K, C, D] or None) and the device tail."""
    layers = []
    for kv, t in zip(prompt_kv, tail):
        if kv is None:
            layers.append(t)
            continue
        k, v = kv
        B = k.shape[0]
        b = jnp.arange(B)[:, None]
        slot = prompt_len[:, None] + jnp.arange(t.capacity)[None, :]  # beyond the capacity -> dropped
        k = k.at[b, :, slot].set(jnp.swapaxes(t.k, 1, 2), mode="drop")
        v = v.at[b, :, slot].set(jnp.swapaxes(t.v, 1, 2), mode="drop")
        layers.append(DenseKV(k=k, v=v, length=length))
    return ModelCache(layers=tuple(layers), length=length)


def offload_update(tail, full: ModelCache, start: jax.Array, keep: jax.Array, prompt_len: jax.Array, *, block: int):
    """The tail after a verify: rings taken from the committed cache, `keep[b]` rows at start.. appended."""
    new = []
    for t, f in zip(tail, full.layers):
        if isinstance(t, WindowKV):
            new.append(f)
            continue
        rk, rv = layer_rows(f, start, block)
        new.append(DenseKV(k=t.k, v=t.v, length=start - prompt_len).write(rk, rv, keep))
    return tuple(new)
