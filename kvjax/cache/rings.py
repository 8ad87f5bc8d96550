"""Ring-buffer index arithmetic shared by every sliding-window form: slot `p % W` holds position `p`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ring_slot_positions(seen: jax.Array, window: int) -> jax.Array:
    """i32[B, W] absolute position held by each slot of a ring (slot p % W holds p) after `seen[b]` writes; -1 empty."""
    j = jnp.arange(window)[None, :]
    last = seen[:, None] - 1
    pos = last - jnp.mod(last - j, window)
    return jnp.where(pos >= 0, pos, -1)


def ring_write_sources(seen: jax.Array, n_valid: jax.Array, window: int, T: int) -> tuple[jax.Array, jax.Array]:
    """Which of `T` incoming rows each ring slot takes when `n_valid[b]` of them are rolled in.

    Each slot takes the newest incoming position congruent to it mod W, so the update is a gather, deterministic
    even when T > W. Returns (src i32[B, W] row index clipped to [0, T), take bool[B, W] whether the slot changes).
    """
    newest = ring_slot_positions(seen + n_valid, window)  # newest position landing in each slot
    src = newest - seen[:, None]  # row of the incoming block, valid if 0 <= src < n_valid
    take = (src >= 0) & (src < n_valid[:, None])
    return jnp.clip(src, 0, T - 1), take
