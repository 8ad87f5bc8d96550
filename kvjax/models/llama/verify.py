"""The Llama family's verify-shape forward and its commit (rollback to the accepted tokens).

Bit-identity (DESIGN.md exactness contract). VeriCache's verification runs `forward` with T = x+1 rows over the full
cache; the reference decoder runs the SAME computation with T = x+1 rows, feeding [token, pad...] and reading row 0.
Row j of the verify block then equals the reference's row 0 at position L+j bit for bit because (a) XLA's CPU GEMMs
compute each output row with the same reduction order whatever the other rows hold, (b) every key sits in the same
slot in both computations and masked slots contribute exact zeros, and (c) the shapes are identical. (b) fails for the
sliding layers, which attend over concat(ring, new block): `canonical_attention` moves those keys to slot
`position % (W + T)` first. Tests assert token AND logit identity.

Rollback is never a reshape: DenseKV layers roll back by a length update; WindowKV rings (which the verify block
overwrote) are merged with the pre-verify ring slot by slot (slots now holding a rejected position take the old value
back), which requires x + 1 <= W (`check_draft_len`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache.dense import DenseKV, ModelCache, WindowKV
from kvjax.errors import InputError
from kvjax.models.layer_types import FULL
from kvjax.models.llama.config import ModelConfig


def verify_forward(params, config: ModelConfig, cache: ModelCache, tokens, n_valid, *,
                   implementation: str | None = None):
    """The verify-shape forward shared by VeriCache and its reference decoder: (logits f32[B, T, V], new cache, aux)
    — aux: two verify rows' queries per layer, what a refreshing draft scores the cache with
    (`refresh.verify_with_queries`)."""
    from kvjax.models.llama.refresh import verify_with_queries  # noqa: PLC0415 - it imports this module's neighbours

    return verify_with_queries(params, config, cache, tokens, n_valid, implementation=implementation)


def _rollback(old, new, keep_len: jax.Array):
    if isinstance(new, WindowKV):
        take_new = (new.slot_positions() < keep_len[:, None])[:, None, :, None]
        return dataclasses.replace(new, k=jnp.where(take_new, new.k, old.k), v=jnp.where(take_new, new.v, old.v),
                                   seen=keep_len)
    return DenseKV(k=new.k, v=new.v, length=keep_len)


def commit(params, config: ModelConfig, before: ModelCache, after: ModelCache, tokens, keep_len: jax.Array, *,
           implementation: str | None = None) -> ModelCache:
    """The cache after a verify block, rolled back to `keep_len[b]` tokens (masked; `params`/`tokens` unused)."""
    del params, config, tokens, implementation
    layers = tuple(_rollback(o, n, keep_len) for o, n in zip(before.layers, after.layers))
    return ModelCache(layers=layers, length=keep_len)


def check_draft_len(config: ModelConfig, x: int) -> None:
    """Raise InputError if x + 1 verify rows cannot be rolled back in a sliding ring."""
    if config.sliding_window is not None and any(t != FULL for t in config.layer_types):
        if x + 1 > config.sliding_window:
            raise InputError(f"draft_len={x}: x + 1 verify rows must fit the sliding window "
                             f"{config.sliding_window} to be rolled back exactly")
