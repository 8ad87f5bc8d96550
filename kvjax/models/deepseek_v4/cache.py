"""The full cache of a DeepSeek-V4 model: per layer a SharedKVWindow ring, plus compressed KV and its tail (CSA/HCA)
and the lightning indexer's state (CSA)."""

from __future__ import annotations

import math

import jax.numpy as jnp

from kvjax.cache.hybrid import CompressedKV, HybridCache, IndexerState, LayerState, SharedKVWindow, Tail
from kvjax.models.deepseek_v4.config import DeepseekV4Config
from kvjax.models.layer_types import CSA, HCA, SLIDING


def _tail(batch: int, rate: int, d: int, overlap: bool, dtype) -> Tail:
    dp = 2 * d if overlap else d
    z = lambda *s: jnp.zeros(s, dtype)  # noqa: E731 - separate buffers: donated leaves must not alias
    return Tail(kv=z(batch, rate, dp), gate=z(batch, rate, dp),
                overlap_kv=z(batch, rate, d) if overlap else None,
                overlap_gate=z(batch, rate, d) if overlap else None,
                seen=jnp.zeros((batch,), jnp.int32), rate=rate)


def init_cache(config: DeepseekV4Config, batch: int, capacity: int, dtype=jnp.float32) -> HybridCache:
    """An empty cache able to hold `capacity` tokens (compressed capacities are `ceil(capacity / rate)` entries)."""
    D, W = config.head_dim, config.sliding_window
    zeros_i = lambda: jnp.zeros((batch,), jnp.int32)  # noqa: E731
    layers = []
    for kind in config.layer_types:
        window = SharedKVWindow(kv=jnp.zeros((batch, W, D), dtype), seen=zeros_i(), window=W)
        if kind == SLIDING:
            layers.append(LayerState(window=window))
            continue
        m = config.rate(kind)
        C = math.ceil(capacity / m)
        comp = CompressedKV(entries=jnp.zeros((batch, C, D), dtype), count=zeros_i(), rate=m)
        indexer = None
        if kind == CSA:
            c = config.index_head_dim
            indexer = IndexerState(keys=CompressedKV(entries=jnp.zeros((batch, C, c), dtype), count=zeros_i(), rate=m),
                                   tail=_tail(batch, m, c, True, dtype))
        assert kind in (CSA, HCA)
        layers.append(LayerState(window=window, compressed=comp, tail=_tail(batch, m, D, kind == CSA, dtype),
                                 indexer=indexer))
    return HybridCache(layers=tuple(layers), length=zeros_i())


def read_bytes(cache: HybridCache, length: int) -> int:
    """Bytes one forward over a cache holding `length` tokens reads: every ring and tail whole, and the compressed
    entries and indexer keys those tokens produced."""
    total = 0
    for st in cache.layers:
        total += st.window.kv.size * st.window.kv.dtype.itemsize
        if st.tail is not None:
            total += sum(a.size * a.dtype.itemsize for a in (st.tail.kv, st.tail.gate))
        for form in (st.compressed, None if st.indexer is None else st.indexer.keys):
            if form is not None:
                B, C, d = form.entries.shape
                total += B * min(int(length) // form.rate, C) * d * form.entries.dtype.itemsize
    return int(total)
