"""The per-request state of a DeepSeek-V4 hybrid-attention model as immutable pytrees (DESIGN.md idea 2).

Four exact forms, each with static capacities, updated only by masked writes:

- `SharedKVWindow`: the sliding-window ring of one layer. DeepSeek-V4 shares K=V in a single head, so the ring holds one
  `[B, W, D]` array (half the bytes of `kvjax.cache.dense.WindowKV`, which keeps separate k and v). Slot `p % W`
  holds position `p`.
- `CompressedKV`: entries emitted by a CSA (one per `m` tokens) or HCA (one per `m'` tokens) compressor, append-only;
  entry `w` summarises source positions `[w*m, (w+1)*m)` (CSA: also the previous window through the overlap series).
- `Tail`: the compressor's uncompressed buffer: projected kv/gate of the tokens of the current, incomplete window,
  plus (CSA only) the overlap slice: the first series (`Ca`, `[..., :d]`) of the previous complete window, which the
  next entry still pools over.
- `IndexerState`: the lightning indexer's own compressed keys (a `CompressedKV` at `index_head_dim`) and its own `Tail`.

The fifth form, the offloaded prefix, is any of these held elsewhere (a manager's business, not this file's).
`HybridCache` holds one `LayerState` per layer and the shared token count.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache.rings import ring_slot_positions, ring_write_sources


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedKVWindow:
    """Ring of the last `window` shared key=value vectors of one attention layer."""

    kv: jax.Array  # [B, W, D]
    seen: jax.Array  # i32[B] tokens written so far (positions 0 .. seen-1)
    window: int = dataclasses.field(metadata=dict(static=True))

    def slot_positions(self) -> jax.Array:
        """i32[B, W] absolute position held by each slot, -1 where empty."""
        return ring_slot_positions(self.seen, self.window)

    def write(self, kv_new: jax.Array, n_valid: jax.Array) -> "SharedKVWindow":
        """Roll `n_valid[b]` of the `T` new rows `kv_new [B, T, D]` into the ring (only the last W survive).

        Each slot takes the newest incoming position congruent to it mod W: a gather, deterministic even when T > W.
        """
        src, take = ring_write_sources(self.seen, n_valid, self.window, kv_new.shape[1])
        g = jnp.take_along_axis(kv_new.astype(self.kv.dtype), src[:, :, None], axis=1)
        return dataclasses.replace(self, kv=jnp.where(take[:, :, None], g, self.kv), seen=self.seen + n_valid)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompressedKV:
    """Append-only compressed entries of one CSA/HCA layer (or of a CSA layer's indexer)."""

    entries: jax.Array  # [B, C, D] entry w pools source positions [w*rate, (w+1)*rate)
    count: jax.Array  # i32[B] entries written
    rate: int = dataclasses.field(metadata=dict(static=True))
    # bool[B, C] entries a lossy *draft* copy still holds (None = all: the exact full cache). Dropped entries are
    # invisible to attention and to the indexer; entries written later are kept.
    keep: jax.Array | None = None

    @property
    def capacity(self) -> int:
        """Source tokens this form can summarise."""
        return self.entries.shape[1] * self.rate

    def write(self, new: jax.Array, index: jax.Array, ok: jax.Array) -> "CompressedKV":
        """Write `new [B, J, D]` at entry indices `index i32[B, J]` where `ok bool[B, J]` (others are dropped)."""
        B, C = new.shape[0], self.entries.shape[1]
        slot = jnp.where(ok, index, C)
        b = jnp.arange(B)[:, None]
        entries = self.entries.at[b, slot].set(new.astype(self.entries.dtype), mode="drop")
        keep = None if self.keep is None else self.keep.at[b, slot].set(True, mode="drop")
        return dataclasses.replace(self, entries=entries, count=self.count + jnp.sum(ok, axis=1, dtype=jnp.int32),
                                   keep=keep)

    def visible(self) -> jax.Array:
        """bool[B, C]: entries present in this copy (all slots for the full cache; causality is the caller's)."""
        if self.keep is None:
            return jnp.ones(self.entries.shape[:2], bool)
        return self.keep


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tail:
    """A compressor's buffer: projections of the incomplete window's tokens (+ CSA's overlap slice).

    `kv`/`gate` slot `i` holds position `(seen // rate) * rate + i` (valid for `i < seen % rate`). With `overlap`, the
    projections are `2d` wide (two series); `overlap_kv/gate` hold the first series `[..., :d]` of the previous complete
    window (all `rate` slots), the only part of it a later entry reads. Gates are stored without the position bias.
    """

    kv: jax.Array  # [B, rate, Dp]  (Dp = 2d for CSA, d for HCA)
    gate: jax.Array  # [B, rate, Dp]
    overlap_kv: jax.Array | None  # [B, rate, d] (CSA) or None (HCA)
    overlap_gate: jax.Array | None
    seen: jax.Array  # i32[B] source tokens absorbed
    rate: int = dataclasses.field(metadata=dict(static=True))

    def absorb(self, kv_new: jax.Array, gate_new: jax.Array, n_valid: jax.Array):
        """Add `n_valid[b]` new projected tokens; return the windows they complete and the new tail.

        Args:
            kv_new, gate_new: [B, T, Dp] projections of the new tokens (rows beyond n_valid are padding).
            n_valid: i32[B].

        Returns:
            (win_kv [B, J, S, d], win_gate [B, J, S, d], slot_ok bool[B, J, S], index i32[B, J], ok bool[B, J], tail)
            with `J = ceil(T / rate)` candidate windows; window `j` is entry `index[b, j]`, complete iff `ok[b, j]`.
            `S = 2*rate` with overlap (previous window's first series, then this window's second series), else `rate`.
            `slot_ok` is False for the overlap slots of entry 0 (there is no previous window).
        """
        B, T, Dp = kv_new.shape
        m = self.rate
        J = -(-T // m)
        L = (J + 2) * m
        overlap = self.overlap_kv is not None
        d = Dp // 2 if overlap else Dp
        cw, r = self.seen // m, self.seen % m
        b = jnp.arange(B)[:, None]
        t = jnp.arange(T)[None, :]
        dest = jnp.where(t < n_valid[:, None], m + r[:, None] + t, L)

        def extend(prev, cur, new):
            # [prev window (m) | current window (m) | room], slot s holds position (cw - 1) * m + s
            ext = jnp.zeros((B, L, Dp), cur.dtype)
            if prev is not None:
                ext = ext.at[:, :m, :d].set(prev)
            ext = ext.at[:, m:2 * m].set(cur)
            return ext.at[b, dest].set(new.astype(cur.dtype), mode="drop")

        ext_kv = extend(self.overlap_kv, self.kv, kv_new)
        ext_gate = extend(self.overlap_gate, self.gate, gate_new)
        index = cw[:, None] + jnp.arange(J)[None, :]
        n_done = (r + n_valid) // m
        ok = jnp.arange(J)[None, :] < n_done[:, None]

        def windows(ext):
            cur = ext[:, m:(J + 1) * m].reshape(B, J, m, Dp)
            if not overlap:
                return cur
            prev = ext[:, :J * m].reshape(B, J, m, Dp)
            return jnp.concatenate([prev[..., :d], cur[..., d:]], axis=2)

        if overlap:
            slot_ok = jnp.concatenate([jnp.broadcast_to((index >= 1)[:, :, None], (B, J, m)),
                                       jnp.ones((B, J, m), bool)], axis=2)
        else:
            slot_ok = jnp.ones((B, J, m), bool)
        # the new tail starts `n_done` windows further into the extended buffer
        keep = n_done[:, None] * m + jnp.arange(m)[None, :]

        def slice_(ext, off):
            return jnp.take_along_axis(ext, (keep + off)[:, :, None], axis=1)

        tail = dataclasses.replace(
            self,
            kv=slice_(ext_kv, m),
            gate=slice_(ext_gate, m),
            overlap_kv=slice_(ext_kv, 0)[..., :d] if overlap else None,
            overlap_gate=slice_(ext_gate, 0)[..., :d] if overlap else None,
            seen=self.seen + n_valid,
        )
        return windows(ext_kv), windows(ext_gate), slot_ok, index, ok, tail


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IndexerState:
    """The lightning indexer's compressed keys and its own compressor tail (CSA layers only)."""

    keys: CompressedKV  # [B, C, index_head_dim]
    tail: Tail


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerState:
    """One attention layer's forms: the sliding ring always; compressed KV + tail for CSA/HCA; indexer for CSA."""

    window: SharedKVWindow
    compressed: CompressedKV | None = None
    tail: Tail | None = None
    indexer: IndexerState | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """Per-request state of a DeepSeek-V4 model: one `LayerState` per layer plus the shared token count."""

    layers: tuple  # LayerState per layer
    length: jax.Array  # i32[B] tokens processed (= next position)

    @property
    def capacity(self) -> int:
        """Most tokens the static compressed capacities can hold (sliding-only models are unbounded)."""
        caps = [s.compressed.capacity for s in self.layers if s.compressed is not None]
        return min(caps) if caps else 1 << 62
