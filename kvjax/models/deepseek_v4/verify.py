"""DeepSeek-V4's verify-shape forward and commit.

The verify forward is the plain forward (every V4 form is written by masked updates whose slots depend only on
positions, so one computation serves T = 1 and T = x + 1 alike at the row level). The hybrid forms cannot be rolled
back by a length update — the ring overwrote old slots, the tails absorbed rejected tokens — so `commit` re-runs the
block from the pre-verify state with `n_valid = accepted + 1`: pure functions make that free of copies, and rows
beyond `n_valid` never touch the state.
"""

from __future__ import annotations

import jax

from kvjax.cache.hybrid import HybridCache
from kvjax.models.deepseek_v4.config import DeepseekV4Config
from kvjax.models.deepseek_v4.model import forward


def verify_forward(params, config: DeepseekV4Config, cache: HybridCache, tokens, n_valid, *,
                   implementation: str | None = None):
    """(logits f32[B, T, V], cache advanced by n_valid, None) — the forward VeriCache and the reference decoder
    share (DeepSeek-V4 hands out nothing besides)."""
    return (*forward(params, config, cache, tokens, n_valid, implementation=implementation), None)


def commit(params, config: DeepseekV4Config, before: HybridCache, after: HybridCache, tokens, keep_len: jax.Array, *,
           implementation: str | None = None) -> HybridCache:
    """The state after the block's first `keep_len - before.length` rows: the block re-run from `before`."""
    del after
    return forward(params, config, before, tokens, keep_len - before.length, implementation=implementation)[1]
