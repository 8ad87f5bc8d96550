"""The refresh step of a refreshing draft (`kvjax.compress.refresh`): after a verification, re-select the draft's
prompt part from what the verify forward handed out (its rows' queries), in a jitted call of its own so that the
verification's program is the same whether the draft refreshes or not."""

from __future__ import annotations

import functools

import jax

from kvjax.arrays import device_space


@functools.partial(jax.jit, static_argnames="family", donate_argnames="dcache")
def refresh_step(dcache, full, aux, *, family):
    """The draft (donated) with its prompt part re-selected against the committed full cache `full` (not donated)."""
    refresh = family.require("draft_refresh", "refreshing draft caches")
    # a committed cache handed back to a lent host copy is in host space (`kvjax.decode.offload.lends`)
    return refresh(dcache, device_space(full), aux, spec=dcache.refresh)
