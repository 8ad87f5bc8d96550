"""The full cache of a Llama-family model: a DenseKV per full-attention layer, a WindowKV ring per sliding layer."""

from __future__ import annotations

import jax.numpy as jnp

from kvjax.cache.dense import DenseKV, ModelCache, WindowKV
from kvjax.models.layer_types import SLIDING
from kvjax.models.llama.config import ModelConfig


def init_cache(config: ModelConfig, batch: int, capacity: int, dtype=jnp.float32) -> ModelCache:
    """An empty cache: DenseKV of `capacity` slots for full layers, a `sliding_window` ring for sliding layers."""
    K, D = config.num_kv_heads, config.head_dim
    layers = []
    for t in config.layer_types:
        if t == SLIDING:
            W = config.sliding_window
            shape = (batch, K, W, D)
            layers.append(WindowKV(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                                    seen=jnp.zeros((batch,), jnp.int32), window=W))
        else:
            # separate buffers per leaf: the cache is donated, and XLA refuses one buffer donated twice
            shape = (batch, K, capacity, D)
            layers.append(DenseKV(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                                  length=jnp.zeros((batch,), jnp.int32)))
    return ModelCache(layers=tuple(layers), length=jnp.zeros((batch,), jnp.int32))


def read_bytes(cache: ModelCache, length: int) -> int:
    """Bytes one forward over a cache holding `length` tokens must read: every dense layer's `length` rows of k and v,
    and every ring whole."""
    total = 0
    for l in cache.layers:
        K, D = l.k.shape[1], l.k.shape[3]
        rows = l.window if isinstance(l, WindowKV) else min(int(length), l.capacity)
        total += 2 * K * D * rows * l.k.dtype.itemsize * l.k.shape[0]
    return total
