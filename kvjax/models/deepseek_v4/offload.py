"""Host offload of a DeepSeek-V4 full cache: the prompt's growing forms live in host memory between verifications.

Of the hybrid state (`kvjax.cache.hybrid`) only two forms grow with the context: the compressed entries of every
CSA/HCA layer and the lightning indexer's compressed keys. `offload_split` hands their full-capacity buffers (the
prompt's entries, zeros after them) to the host and keeps on the device everything small — the sliding rings, the
compressor and indexer tails, the counts — plus an entry window for the entries completed after the prompt:
slot `j` of a layer's device window holds entry `prompt_len // rate + j` (the first entry the prompt did not
complete). `offload_join` scatters those windows into the fetched buffers (donated, so in place) and gives a cache
bitwise equal to the resident one: a resident cache holds zeros beyond its count too, and the window holds exactly
the full cache's entries there. `offload_update` refreshes the device part from the committed full cache after a
verify.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvjax.cache.hybrid import CompressedKV, HybridCache, LayerState


def _forms(st: LayerState) -> tuple:
    """The growing forms of one layer: (compressed entries, indexer keys), None where the layer has none."""
    return (st.compressed, None if st.indexer is None else st.indexer.keys)


def _replace_forms(st: LayerState, comp, keys) -> LayerState:
    if st.indexer is not None:
        st = dataclasses.replace(st, indexer=dataclasses.replace(st.indexer, keys=keys))
    return dataclasses.replace(st, compressed=comp) if st.compressed is not None else st


def _window(form: CompressedKV, first: jax.Array, slots: int) -> jax.Array:
    """Entries first[b] .. first[b] + slots - 1 of a full-capacity form, [B, slots, d] (zeros past the capacity)."""
    C = form.entries.shape[1]
    idx = first[:, None] + jnp.arange(slots)[None, :]
    got = jnp.take_along_axis(form.entries, jnp.minimum(idx, C - 1)[:, :, None], axis=1)
    return jnp.where((idx < C)[:, :, None], got, 0).astype(form.entries.dtype)


def offload_split(full: HybridCache, tail_capacity: int):
    """(host part, device part) of a prefilled cache.

    Args:
        full: the full cache holding the prompt (its length is the prompt length).
        tail_capacity: tokens the device part must take after the prompt.

    Returns:
        host part: per layer (entries [B, C, D] | None, indexer keys [B, C, c] | None), or None for sliding layers;
        device part: per layer a `LayerState` whose compressed forms are entry windows of
        `ceil(tail_capacity / rate) + 1` slots starting at entry `prompt_len // rate` (see the module docstring).
    """
    host, device = [], []
    for st in full.layers:
        forms = _forms(st)
        if all(f is None for f in forms):
            host.append(None)
            device.append(st)
            continue
        host.append(tuple(None if f is None else f.entries for f in forms))
        # entry w exists once its window [w*m, (w+1)*m) is complete, so every entry from length // m on is still
        # zero: the windows start as zeros, and nothing here computes on `full` (it may live in host memory)
        windows = [None if f is None else dataclasses.replace(
            f, entries=jnp.zeros((f.entries.shape[0], math.ceil(tail_capacity / f.rate) + 1, f.entries.shape[2]),
                                 f.entries.dtype)) for f in forms]
        device.append(_replace_forms(st, *windows))
    return tuple(host), tuple(device)


def offload_join(host_part, device_part, length: jax.Array, prompt_len: jax.Array) -> HybridCache:
    """The full cache from the fetched host buffers and the device part (bitwise equal to the resident cache)."""
    layers = []
    for buffers, st in zip(host_part, device_part):
        if buffers is None:
            layers.append(st)
            continue
        joined = []
        for buf, form in zip(buffers, _forms(st)):
            if form is None:
                joined.append(None)
                continue
            B, J = form.entries.shape[:2]
            b = jnp.arange(B)[:, None]
            idx = (prompt_len // form.rate)[:, None] + jnp.arange(J)[None, :]  # beyond the capacity -> dropped
            joined.append(dataclasses.replace(form, entries=buf.at[b, idx].set(form.entries, mode="drop")))
        layers.append(_replace_forms(st, *joined))
    return HybridCache(layers=tuple(layers), length=length)


def offload_update(device_part, full: HybridCache, start: jax.Array, keep: jax.Array, prompt_len: jax.Array, *,
                   block: int):
    """The device part after a verify: rings, tails and counts from the committed `full`, and its entry windows
    re-read from it (a few entries per layer, exact)."""
    del start, keep, block  # the windows are re-read whole: they are small, and the rule has no special cases
    new = []
    for dev, st in zip(device_part, full.layers):
        forms = _forms(st)
        if all(f is None for f in forms):
            new.append(st)
            continue
        windows = [None if f is None else dataclasses.replace(
            f, entries=_window(f, prompt_len // f.rate, d.entries.shape[1]))
            for f, d in zip(forms, _forms(dev))]
        new.append(_replace_forms(st, *windows))
    return tuple(new)
