"""Prefix-cache forms of a DeepSeek-V4 hybrid cache (`kvjax.cache.hybrid.HybridCache`).

Four stored forms (the fifth, "offloaded prefix", is the tiers themselves):

- "compressed" (path): every CSA/HCA layer's compressed entries of a block — `P / m` entries per layer — flattened
  into one vector per block. Append-only: entry `w` depends only on tokens `< (w + 1) * m`, so blocks are shared.
- "indexer" (path): the lightning indexer's compressed keys of every CSA layer, the same way.
- "swa" (snapshot): every layer's sliding ring `[L, W, D]` at a block boundary.
- "tail" (snapshot): every compressor's (and indexer compressor's) uncompressed buffer, including CSA's overlap
  slice, at a block boundary, flattened. At a boundary that is a multiple of every rate the buffer holds no pending
  tokens, but the overlap slice (the previous window's first series) is still read by the next entry.

`P` must be a multiple of lcm(csa_rate, hca_rate) so every block boundary is a compression boundary (vLLM aligned
hits to the lcm of five group block sizes and short prompts never hit; here the one block size *is* the alignment).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from kvjax.arrays import np_dtype

from kvjax.cache.hybrid import HybridCache
from kvjax.models.deepseek_v4.cache import init_cache
from kvjax.prefix.layouts.llama import PATH, SNAPSHOT, FormSpec, check_block_size
from kvjax.models.layer_types import CSA, SLIDING


def default_block_size(config) -> int:
    m = math.lcm(config.csa_rate, config.hca_rate)
    return m * max(1, -(-64 // m))


def _tails(cache: HybridCache):
    """Every Tail in a fixed order: (layer, which) for which in ("comp", "index")."""
    out = []
    for st in cache.layers:
        if st.tail is not None:
            out.append(st.tail)
        if st.indexer is not None:
            out.append(st.indexer.tail)
    return out


def _tail_leaves(t):
    return [x for x in (t.kv, t.gate, t.overlap_kv, t.overlap_gate) if x is not None]


@functools.partial(jax.jit, static_argnames=("P",))
def _blocks(cache: HybridCache, *, P: int):
    comp, idx = [], []
    for st in cache.layers:
        if st.compressed is None:
            continue
        e = st.compressed.entries[0]  # [C, D]
        per = P // st.compressed.rate
        comp.append(e.reshape(e.shape[0] // per, per * e.shape[1]))
        if st.indexer is not None:
            k = st.indexer.keys.entries[0]
            idx.append(k.reshape(k.shape[0] // per, per * k.shape[1]))
    return (jnp.concatenate(comp, axis=1) if comp else None), (jnp.concatenate(idx, axis=1) if idx else None)


@jax.jit
def _snapshot(cache: HybridCache):
    swa = jnp.stack([st.window.kv[0] for st in cache.layers])  # [L, W, D]
    leaves = [x[0].reshape(-1) for t in _tails(cache) for x in _tail_leaves(t)]
    return swa, (jnp.concatenate(leaves) if leaves else None)


def _unflat_entries(form, vec, boundary, P):
    """Write one layer's entries from `vec` [maxB, per*D] into a CompressedKV, masked to `boundary // rate`."""
    C, D = form.entries.shape[1:]
    e = vec.reshape(C, D)
    n = boundary // form.rate
    keep = (jnp.arange(C) < n)[:, None]
    return dataclasses.replace(form, entries=jnp.where(keep, e, form.entries[0])[None].astype(form.entries.dtype),
                               count=jnp.reshape(n, (1,)).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("P",), donate_argnames="cache")
def _restore(cache: HybridCache, comp, idx, swa, tail, boundary, *, P: int):
    b = jnp.asarray(boundary, jnp.int32)
    use = b > 0
    seen = jnp.reshape(b, (1,))
    layers, co, io, to = [], 0, 0, 0
    flat_tail = tail

    def restore_tail(t):
        nonlocal to
        new = {}
        for name in ("kv", "gate", "overlap_kv", "overlap_gate"):
            x = getattr(t, name)
            if x is None:
                continue
            n = x[0].size
            new[name] = jnp.where(use, flat_tail[to:to + n].reshape(x.shape[1:]), x[0])[None].astype(x.dtype)
            to += n
        return dataclasses.replace(t, **new, seen=seen)

    for li, st in enumerate(cache.layers):
        ring = jnp.where(use, swa[li], st.window.kv[0])[None].astype(st.window.kv.dtype)
        win = dataclasses.replace(st.window, kv=ring, seen=seen)
        if st.compressed is None:
            layers.append(dataclasses.replace(st, window=win))
            continue
        C, D = st.compressed.entries.shape[1:]
        w = C * D // comp.shape[0]
        compressed = _unflat_entries(st.compressed, comp[:, co:co + w], b, P)
        co += w
        t = restore_tail(st.tail)
        indexer = st.indexer
        if indexer is not None:
            Ci, Di = indexer.keys.entries.shape[1:]
            wi = Ci * Di // idx.shape[0]
            keys = _unflat_entries(indexer.keys, idx[:, io:io + wi], b, P)
            io += wi
            indexer = dataclasses.replace(indexer, keys=keys, tail=restore_tail(indexer.tail))
        layers.append(dataclasses.replace(st, window=win, compressed=compressed, tail=t, indexer=indexer))
    return HybridCache(layers=tuple(layers), length=seen)


class DeepseekV4BlockLayout:
    """BlockLayout of a DeepSeek-V4 config: "compressed", "indexer" (path) and "swa", "tail" (snapshot)."""

    def __init__(self, config, dtype, block_size: int | None = None):
        self.config = config
        self.dtype = np_dtype(dtype)
        P = self.block_size = int(block_size or default_block_size(config))
        rates = (config.csa_rate, config.hca_rate)
        check_block_size(P, rates)
        D, W, c = config.head_dim, config.sliding_window, config.index_head_dim
        kinds = config.layer_types
        comp_layers = tuple(i for i, k in enumerate(kinds) if k != SLIDING)
        csa_layers = tuple(i for i, k in enumerate(kinds) if k == CSA)
        m = math.lcm(*rates)
        specs = []
        if comp_layers:
            n = sum(P // config.rate(kinds[i]) * D for i in comp_layers)
            desc = ",".join(f"{i}:{P // config.rate(kinds[i])}x{D}" for i in comp_layers)
            specs.append(FormSpec("compressed", PATH, comp_layers, (n,), self.dtype.name, f"flat[{desc}]", align=m))
        if csa_layers:
            n = sum(P // config.csa_rate * c for _ in csa_layers)
            desc = ",".join(f"{i}:{P // config.csa_rate}x{c}" for i in csa_layers)
            specs.append(FormSpec("indexer", PATH, csa_layers, (n,), self.dtype.name, f"flat[{desc}]",
                                  align=config.csa_rate))
        specs.append(FormSpec("swa", SNAPSHOT, tuple(range(len(kinds))), (len(kinds), W, D), self.dtype.name, "LWD"))
        probe = jax.eval_shape(lambda: _snapshot(init_cache(config, 1, P, self.dtype)))
        if probe[1] is not None:
            layout = "flat[tails:kv,gate,overlap_kv,overlap_gate per compressor, indexer after its layer]"
            specs.append(FormSpec("tail", SNAPSHOT, comp_layers, tuple(probe[1].shape), self.dtype.name, layout))
        self.specs = tuple(specs)
        self._names = [s.name for s in specs]

    def blocks(self, cache: HybridCache) -> dict:
        comp, idx = _blocks(cache, P=self.block_size)
        out = {}
        if comp is not None:
            out["compressed"] = comp
        if idx is not None:
            out["indexer"] = idx
        return out

    def snapshot(self, cache: HybridCache) -> dict:
        swa, tail = _snapshot(cache)
        return {"swa": swa, **({"tail": tail} if tail is not None else {})}

    def restore(self, cache: HybridCache, staged: dict, boundary: int) -> HybridCache:
        return _restore(cache, staged.get("compressed"), staged.get("indexer"), staged["swa"], staged.get("tail"),
                        jnp.asarray(boundary, jnp.int32), P=self.block_size)

    def new_cache(self, capacity: int) -> HybridCache:
        check_block_size(self.block_size, capacities=(capacity,))
        return init_cache(self.config, 1, capacity, self.dtype)
