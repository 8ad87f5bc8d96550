"""A full-attention layer while a decode loop runs: the cache before the loop, read-only, plus the loop's own rows.

Why: inside a `lax.fori_loop`, XLA:CPU copies a loop-carried cache whenever a dot reads it and a
dynamic-update-slice writes it in the same iteration (measured on the bundled checkpoint at 32K: 32 full-cache copies
per 32-step chunk, 2.6x slower per token than the blocked loop). Keeping the prompt's keys/values out of the carry
(a loop invariant that nothing writes) lets the one-shot attention read them in place, and the loop writes only
`R` small rows; `merge` writes those rows into the cache once, after the loop, on a donated buffer.

`ChunkedKV.base` is None inside the carry (`decode_split` keeps the bases apart) and is put back by `decode_join`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache.dense import DenseKV, ModelCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkedKV:
    """`base` (read-only during the loop) + rows of positions base.length + r, r < n."""

    base: DenseKV | None
    k: jax.Array  # [B, K, R, D]
    v: jax.Array  # [B, K, R, D]
    n: jax.Array  # i32[B] rows written

    @property
    def capacity(self) -> int:
        return self.base.capacity

    def write(self, k_new: jax.Array, v_new: jax.Array, n_valid: jax.Array) -> "ChunkedKV":
        """Append `n_valid[b]` of the `T` rows of k_new/v_new [B, T, K, D]; rows past R are dropped."""
        B, T = k_new.shape[:2]
        R = self.k.shape[2]
        t = jnp.arange(T)[None, :]
        slot = jnp.where(t < n_valid[:, None], self.n[:, None] + t, R)
        b = jnp.arange(B)[:, None]
        k = self.k.at[b, :, slot].set(k_new.astype(self.k.dtype), mode="drop")
        v = self.v.at[b, :, slot].set(v_new.astype(self.v.dtype), mode="drop")
        return dataclasses.replace(self, k=k, v=v, n=self.n + n_valid)

    def parts(self):
        """[(k, v, pos i32[B, S])] of the base and of the rows, for `attention_parts`."""
        r = jnp.arange(self.k.shape[2])[None, :]
        pos = jnp.where(r < self.n[:, None], self.base.length[:, None] + r, -1)
        return [(self.base.k, self.base.v, self.base.key_positions()), (self.k, self.v, pos)]


def decode_split(cache: ModelCache, rows: int):
    """(bases: per layer the DenseKV or None — the loop invariant —, the carry: `cache` with every DenseKV replaced
    by an empty `ChunkedKV` of `rows` rows)."""
    bases, layers = [], []
    for l in cache.layers:
        if isinstance(l, DenseKV):
            B, K, _, D = l.k.shape
            shape = (B, K, rows, D)
            bases.append(l)
            layers.append(ChunkedKV(base=None, k=jnp.zeros(shape, l.k.dtype), v=jnp.zeros(shape, l.v.dtype),
                                    n=jnp.zeros((B,), jnp.int32)))
        else:
            bases.append(None)
            layers.append(l)
    return tuple(bases), dataclasses.replace(cache, layers=tuple(layers))


def decode_join(bases, carry: ModelCache) -> ModelCache:
    """The carry with its bases put back (what the forward runs over)."""
    layers = tuple(dataclasses.replace(l, base=b) if isinstance(l, ChunkedKV) else l
                   for b, l in zip(bases, carry.layers))
    return dataclasses.replace(carry, layers=layers)


def decode_carry(cache: ModelCache) -> ModelCache:
    """The forward's output with the bases dropped again (the next iteration's carry)."""
    layers = tuple(dataclasses.replace(l, base=None) if isinstance(l, ChunkedKV) else l for l in cache.layers)
    return dataclasses.replace(cache, layers=layers)


def decode_merge(bases, carry: ModelCache) -> ModelCache:
    """The full cache after the loop: every layer's rows written into its base (one write per layer)."""
    layers = []
    for b, l in zip(bases, carry.layers):
        if isinstance(l, ChunkedKV):
            layers.append(b.write(jnp.swapaxes(l.k, 1, 2), jnp.swapaxes(l.v, 1, 2), l.n))
        else:
            layers.append(l)
    return dataclasses.replace(carry, layers=tuple(layers))
