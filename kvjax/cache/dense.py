"""The exact (full-cache) forms of per-request attention state as immutable pytrees.

Layout is `[B, K, S, D]` (batch, kv heads, cached tokens, head dim): on the 2-core CPU, XLA's one-query attention read
a `[K, S, D]` f32 cache at ~32 GB/s and an `[S, K, D]` one at ~1.4 GB/s (it transposes the latter every call), so the
token axis sits next to the head dim. Every write is a masked scatter (`mode="drop"` for padding), never a reshape,
so a step compiles once per capacity bucket.

- `DenseKV`: full-attention layers; slot `s` holds absolute position `s`.
- `WindowKV`: sliding layers; a ring of exactly `W` slots, slot `p % W` holds position `p`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache.rings import ring_slot_positions, ring_write_sources

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKV:
    """Keys and values of a full-attention layer. Slot index == absolute position."""

    k: jax.Array  # [B, K, S, D]
    v: jax.Array  # [B, K, S, D]
    length: jax.Array  # i32[B] tokens written

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def write(self, k_new: jax.Array, v_new: jax.Array, n_valid: jax.Array) -> "DenseKV":
        """Append `n_valid[b]` of the `T` new tokens at `length[b]`; padding rows are dropped.

        Args:
            k_new, v_new: [B, T, K, D] new keys/values.
            n_valid: i32[B] how many of the T rows are real tokens.
        """
        B, T = k_new.shape[:2]
        t = jnp.arange(T)[None, :]
        slot = jnp.where(t < n_valid[:, None], self.length[:, None] + t, self.capacity)  # out of range -> dropped
        b = jnp.arange(B)[:, None]
        k = self.k.at[b, :, slot].set(k_new.astype(self.k.dtype), mode="drop")
        v = self.v.at[b, :, slot].set(v_new.astype(self.v.dtype), mode="drop")
        return DenseKV(k=k, v=v, length=self.length + n_valid)

    def key_positions(self, extra: int = 0) -> jax.Array:
        """i32[B, S] absolute position of each slot, -1 where empty (after `extra` more tokens were written)."""
        s = jnp.arange(self.capacity)[None, :]
        return jnp.where(s < (self.length + extra)[:, None], s, -1)

    def truncate(self, length: jax.Array) -> "DenseKV":
        """Roll back to `length[b]` tokens (a length update; stale slots are masked by position)."""
        return dataclasses.replace(self, length=jnp.minimum(self.length, length))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowKV:
    """Ring buffer of the last `window` keys/values of a sliding-window layer."""

    k: jax.Array  # [B, K, W, D]
    v: jax.Array  # [B, K, W, D]
    seen: jax.Array  # i32[B] tokens written so far (positions 0 .. seen-1)
    window: int = dataclasses.field(metadata=dict(static=True))

    def slot_positions(self) -> jax.Array:
        """i32[B, W] absolute position held by each slot, -1 where empty."""
        return ring_slot_positions(self.seen, self.window)

    def write(self, k_new: jax.Array, v_new: jax.Array, n_valid: jax.Array) -> "WindowKV":
        """Roll `n_valid[b]` new tokens into the ring (only the last `window` of them survive).

        Each slot takes the newest incoming position congruent to it mod W, so the update is a gather, deterministic
        even when T > W.
        """
        src, take = ring_write_sources(self.seen, n_valid, self.window, k_new.shape[1])
        # [B, T, K, D] -> [B, K, T, D], then gather rows per slot
        kn = jnp.swapaxes(k_new, 1, 2).astype(self.k.dtype)
        vn = jnp.swapaxes(v_new, 1, 2).astype(self.v.dtype)
        gk = jnp.take_along_axis(kn, src[:, None, :, None], axis=2)
        gv = jnp.take_along_axis(vn, src[:, None, :, None], axis=2)
        m = take[:, None, :, None]
        return dataclasses.replace(self, k=jnp.where(m, gk, self.k), v=jnp.where(m, gv, self.v),
                                   seen=self.seen + n_valid)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
    """Per-request state of a Llama-family model: one form per layer plus the shared token count."""

    layers: tuple  # DenseKV | WindowKV per layer
    length: jax.Array  # i32[B] tokens processed (= next position)

    @property
    def capacity(self) -> int:
        caps = [c.capacity for c in self.layers if isinstance(c, DenseKV)]
        return min(caps) if caps else 1 << 62
