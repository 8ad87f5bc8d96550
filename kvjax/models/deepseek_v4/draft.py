"""DeepSeek-V4's draft cache for VeriCache: a lossy copy of the hybrid state, drafted from by the same forward.

The draft keeps the small forms exact (SWA rings, compressor and indexer tails) and makes the two growing forms lossy:
compressed KV entries and the indexer's compressed keys of the prompt are dropped (all but `sinks` oldest and the
newest entries, so that `1 / ratio` of them stay) and/or quantized (symmetric per-entry absmax, `bits` bits).
Dropped entries are invisible to the draft's attention and indexer (`CompressedKV.keep`); entries the model completes
after the prompt are exact and kept.

After each verification `draft_commit` brings the draft up to date incrementally: the rings, tails and counts are
taken from the committed full cache, and only the entries completed since the draft was last committed are copied
(exact) — the prompt's lossy entries are never rebuilt.

Limits: the draft stores dequantized values in the cache dtype and hides dropped entries with a mask, so its
*compact* size (`HybridDraft.prompt_nbytes`) is what a packed store would hold, while the arrays it computes over
keep the full cache's shapes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.hybrid import CompressedKV, HybridCache
from kvjax.models.deepseek_v4.config import DeepseekV4Config
from kvjax.models.deepseek_v4.model import forward

COMPRESSORS = ("streaming", "kivi4", "kivi2", "dropquant")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridDraft:
    """The draft cache of a DeepSeek-V4 request: a degraded `HybridCache`.

    Its byte counts are computed from its arrays (kept entries, ring and tail shapes), not carried as static fields,
    so every request's draft has the same pytree structure (the schedulers stack them into one slot batch).
    """

    cache: HybridCache
    bits: int = dataclasses.field(metadata=dict(static=True))  # 0 = entries kept in the cache dtype

    @property
    def length(self) -> jax.Array:
        return self.cache.length

    def prompt_nbytes(self) -> int:
        """Bytes of the lossy compressed state a packed store would hold: every kept entry below each form's count
        at `bits` bits plus one scale (or in the cache dtype when `bits` is 0)."""
        total = 0
        for st in self.cache.layers:
            for form in (st.compressed, None if st.indexer is None else st.indexer.keys):
                if form is None:
                    continue
                B, C, d = form.entries.shape
                item = form.entries.dtype.itemsize
                below = np.arange(C)[None, :] < np.asarray(form.count)[:, None]
                kept = int(np.sum(np.asarray(form.visible()) & below))
                total += kept * (d * self.bits // 8 + item if self.bits else d * item)
        return total

    def nbytes(self) -> int:
        """Compact prompt state plus the exact rings and tails the drafter reads."""
        ring = 0
        for st in self.cache.layers:
            ring += st.window.kv.size * st.window.kv.dtype.itemsize
            for t in (st.tail, None if st.indexer is None else st.indexer.tail):
                if t is not None:
                    ring += sum(a.size * a.dtype.itemsize for a in (t.kv, t.gate))
        return self.prompt_nbytes() + int(ring)

    def room(self) -> int:
        """Tokens this draft can still take (its compressed capacities bound it)."""
        return int(self.cache.capacity - int(np.max(np.asarray(self.cache.length))))


@dataclasses.dataclass(frozen=True)
class EntryDraft:
    """A V4 draft maker: drop (keep `sinks` + the newest entries, 1/ratio in all) and/or quantize to `bits`.

    Attributes:
        ratio: prompt entries / kept entries per layer when `drop`.
        sinks: oldest entries always kept.
        drop: drop entries; bits: 0 = no quantization, else 2..8.
        name: the compressor's public name.
    """

    ratio: float = 4.0
    sinks: int = 1
    drop: bool = True
    bits: int = 0
    name: str = "streaming"

    # What every drafter answers (`kvjax.compress.base.Compressor`'s fields of the same names): a V4 draft reads the
    # model's f32 weights and takes no prompt masses from the prefill.
    draft_weights = "float32"
    prompt_scoring = None

    def keep_recent(self, count: int) -> int:
        return max(0, math.ceil(count / self.ratio) - self.sinks)

    def __call__(self, params, config: DeepseekV4Config, full: HybridCache, prompt, *, recent_slots: int = 0):
        """The draft of a prefilled prompt (`full` is not consumed)."""
        del params, prompt, recent_slots
        counts = [int(st.compressed.count[0]) if st.compressed is not None else 0 for st in full.layers]
        recent = tuple(self.keep_recent(c) for c in counts)
        return HybridDraft(cache=_degrade_cache(full, self, recent), bits=self.bits)


def make_compressor(name: str, **kw) -> EntryDraft:
    """'streaming' (drop) | 'kivi4' / 'kivi2' (quantize) | 'dropquant' (drop + 4-bit) -> an EntryDraft."""
    table = {"streaming": dict(drop=True, bits=0), "kivi4": dict(drop=False, bits=4),
             "kivi2": dict(drop=False, bits=2), "dropquant": dict(drop=True, bits=4)}
    return EntryDraft(**{**table[name], **kw, "name": name})


def _degrade(form: CompressedKV, spec: EntryDraft, keep_recent: int) -> CompressedKV:
    C = form.entries.shape[1]
    c = jnp.arange(C)[None, :]
    keep = jnp.ones(form.entries.shape[:2], bool)
    if spec.drop:
        keep = (c < spec.sinks) | (c >= form.count[:, None] - keep_recent)
    # dropped entries are never read (masked out of attention and the indexer): zeros, so a stored draft holds
    # only what it keeps (zero rows cost nothing in `kvjax.remote.cache_codec`)
    entries = jnp.where(keep[..., None], form.entries, 0).astype(form.entries.dtype)
    if spec.bits:
        e = entries.astype(jnp.float32)
        qmax = 2 ** (spec.bits - 1) - 1
        scale = jnp.max(jnp.abs(e), axis=-1, keepdims=True) / qmax
        scale = jnp.where(scale > 0, scale, 1.0)
        entries = (jnp.clip(jnp.round(e / scale), -qmax, qmax) * scale).astype(entries.dtype)
    return dataclasses.replace(form, entries=entries, keep=keep)


def _degrade_cache(full: HybridCache, spec: EntryDraft, recent: tuple) -> HybridCache:
    # copies throughout: the draft is donated to the draft step, the full cache must survive it
    full = jax.tree.map(lambda a: jnp.array(a, copy=True), full)
    layers = []
    for st, r in zip(full.layers, recent):
        if st.compressed is not None:
            st = dataclasses.replace(st, compressed=_degrade(st.compressed, spec, r))
        if st.indexer is not None:
            st = dataclasses.replace(st, indexer=dataclasses.replace(st.indexer,
                                                                     keys=_degrade(st.indexer.keys, spec, r)))
        layers.append(st)
    return dataclasses.replace(full, layers=tuple(layers))


def draft_forward(params, config: DeepseekV4Config, draft: HybridDraft, tokens, n_valid=None, *,
                  implementation: str | None = None):
    """The V4 forward over the draft copy: (logits f32[B, T, V], new HybridDraft)."""
    logits, cache = forward(params, config, draft.cache, tokens, n_valid, implementation=implementation)
    return logits, dataclasses.replace(draft, cache=cache)


def _catch_up(d: CompressedKV, f: CompressedKV, since: jax.Array) -> CompressedKV:
    """Draft entries with every entry index in [since, f.count) taken exact from the full cache; drafted entries at or
    beyond f.count are dropped from view (they are rewritten before any query can see them)."""
    C = d.entries.shape[1]
    c = jnp.arange(C)[None, :]
    new = (c >= since[:, None]) & (c < f.count[:, None])
    entries = jnp.where(new[:, :, None], f.entries.astype(d.entries.dtype), d.entries)
    keep = jnp.where(c < f.count[:, None], d.keep | new, False)
    return dataclasses.replace(d, entries=entries, keep=keep, count=f.count)


def draft_commit(draft: HybridDraft, full: HybridCache, start: jax.Array, keep: jax.Array, *, block: int):
    """After a verify at positions start..: the draft's rings, tails and counts from the committed full cache, and the
    entries completed since `start` copied exact; the prompt's lossy entries stay as they are."""
    del keep, block
    layers = []
    for d, f in zip(draft.cache.layers, full.layers):
        st = dataclasses.replace(d, window=f.window, tail=f.tail)
        if d.compressed is not None:
            since = start // d.compressed.rate
            st = dataclasses.replace(st, compressed=_catch_up(d.compressed, f.compressed, since))
        if d.indexer is not None:
            since = start // d.indexer.keys.rate
            st = dataclasses.replace(st, indexer=dataclasses.replace(
                d.indexer, keys=_catch_up(d.indexer.keys, f.indexer.keys, since), tail=f.indexer.tail))
        layers.append(st)
    return dataclasses.replace(draft, cache=HybridCache(layers=tuple(layers), length=full.length))


def draft_split(draft: HybridDraft):
    """(nothing invariant, the whole draft): every V4 draft form may change while drafting."""
    return None, draft


def draft_join(frozen, live: HybridDraft) -> HybridDraft:
    """Inverse of `draft_split`."""
    del frozen
    return live
