"""Jit-compiled pieces of the many-request scheduler (`kvjax.serve.vericache_scheduler`).

- `draft_slots`: batched drafting over static slots. Every slot drafts until its own `count` reaches its own `limit`;
  slots already there (empty, waiting for verification, or finished) are masked with `n_valid = 0`, which leaves their
  draft ring and length untouched (`RecentKV.write` drops the row, the length does not move). Compiled once per
  (slot count, x, steps).
- `take_row` / `put_row`: one request's draft ring and length out of / back into the slot batch around its own
  (B = 1) verification. The compressed prompt parts never move: verification only touches the ring and the length, so
  the row handed to the verify step has `parts=()` (verify_core would fail loudly if it read them).
- `verify_drafts`: the row's drafted tokens padded with -1 beyond `count`: a -1 never equals a full-cache token, so a
  partial round (fewer than x drafts) verifies exactly through the same x-row verify shape (rows after the first
  mismatch are rolled back, and row j's logits do not depend on later rows — the premise of the exactness contract).
- `put_slot_row` / `empty_slots` / `pad_row`: admission of a freshly compressed draft cache into a slot.
- `full_batch_step`, `put_layer_row`: the full-cache baseline (plain one-token forward over a batch of slots).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.draft import DraftCache, DraftLayer
from kvjax.models.llama.config import ModelConfig
from kvjax.decode import sampling
from kvjax.models.llama.draft import draft_forward
from kvjax.models import llama


@functools.partial(jax.jit, static_argnames=("steps", "temperature"), donate_argnames=("dbatch", "drafts"))
def draft_slots(params, config: ModelConfig, dbatch: DraftCache, last: jax.Array, drafts: jax.Array,
                count: jax.Array, limit: jax.Array, seed: jax.Array, *, steps: int, temperature: float = 0.0):
    """Draft up to `steps` tokens in every slot whose count[b] < limit[b], one batched forward per token.

    Args:
        dbatch: DraftCache with B = slots (donated).
        last: i32[B] last emitted token of each slot (the first draft input of a round).
        drafts: i32[B, x] tokens drafted so far this round (donated).
        count: i32[B] drafts made so far this round; limit: i32[B] drafts wanted this round (<= x).
        seed: i32[B] sampling seeds (unused when greedy).

    Returns:
        (dbatch, drafts i32[B, x], count i32[B]).
    """
    B, x = drafts.shape
    rows = jnp.arange(B)
    # The compressed prompt parts are loop invariants: kept out of the loop carry, they are not copied in and out
    # of the loop on every call (with steps = 1 that copy of every slot's draft cache cost as much as the step).
    parts = tuple(l.parts for l in dbatch.layers)
    windows = tuple(l.window for l in dbatch.layers)

    def cache(rings, length):
        return DraftCache(layers=tuple(DraftLayer(parts=p, recent=r, window=w)
                                       for p, r, w in zip(parts, rings, windows)), length=length)

    def body(_, carry):
        rings, length, drafts, count = carry
        act = count < limit
        prev = jnp.take_along_axis(drafts, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
        tok = jnp.where(count == 0, last, prev)
        logits, dc = draft_forward(params, config, cache(rings, length), tok[:, None], act.astype(jnp.int32))
        nxt = sampling.select_tokens(logits, dc.length[:, None], seed, temperature)[:, 0]
        drafts = drafts.at[rows, jnp.where(act, count, x)].set(nxt, mode="drop")  # x -> dropped
        return tuple(l.recent for l in dc.layers), dc.length, drafts, count + act.astype(jnp.int32)

    carry = (tuple(l.recent for l in dbatch.layers), dbatch.length, drafts, count.astype(jnp.int32))
    if steps == 1:
        carry = body(0, carry)
    else:
        carry = jax.lax.fori_loop(0, steps, body, carry)
    rings, length, drafts, count = carry
    return cache(rings, length), drafts, count


def _ring_row(dbatch: DraftCache, slot):
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, 0)  # noqa: E731
    layers = tuple(DraftLayer(parts=(), recent=jax.tree.map(take, l.recent), window=l.window) for l in dbatch.layers)
    return DraftCache(layers=layers, length=take(dbatch.length))


@jax.jit
def take_row(dbatch: DraftCache, drafts: jax.Array, count: jax.Array, slot: jax.Array):
    """Slot `slot`'s ring + length as a B = 1 DraftCache (parts=()), and its drafts i32[1, x] (-1 beyond count)."""
    row = _ring_row(dbatch, slot)
    d = jax.lax.dynamic_slice_in_dim(drafts, slot, 1, 0)
    c = jax.lax.dynamic_slice_in_dim(count, slot, 1, 0)
    d = jnp.where(jnp.arange(d.shape[1])[None, :] < c[:, None], d, -1)
    return row, d


@functools.partial(jax.jit, donate_argnames="dbatch")
def put_row(dbatch: DraftCache, row: DraftCache, slot: jax.Array) -> DraftCache:
    """Write a B = 1 row's ring + length (from `take_row`, after verification) back into slot `slot`."""
    put = lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, 0)  # noqa: E731
    layers = tuple(dataclasses.replace(l, recent=jax.tree.map(put, l.recent, r.recent))
                   for l, r in zip(dbatch.layers, row.layers))
    return DraftCache(layers=layers, length=put(dbatch.length, row.length))


@functools.partial(jax.jit, donate_argnames="dbatch")
def put_slot_row(dbatch: DraftCache, row: DraftCache, slot: jax.Array) -> DraftCache:
    """Admission: write a whole B = 1 draft cache (parts, ring, length; shapes as `dbatch`'s rows) into `slot`."""
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, 0), dbatch, row)


def _fill(form, fn):
    """Rebuild a draft-form dataclass with fn(name, array) applied to every array field."""
    kw = {f.name: fn(f.name, getattr(form, f.name)) for f in dataclasses.fields(form)
          if isinstance(getattr(form, f.name), (jax.Array, np.ndarray))}
    return dataclasses.replace(form, **kw)


def empty_slots(row: DraftCache, slots: int) -> DraftCache:
    """A DraftCache of `slots` empty rows shaped like `row` (B = 1): zeros, positions -1, lengths 0."""
    def make(name, a):
        return jnp.full((slots,) + a.shape[1:], -1 if name == "pos" else 0, a.dtype)

    layers = tuple(DraftLayer(parts=tuple(_fill(p, make) for p in l.parts), recent=_fill(l.recent, make),
                              window=l.window) for l in row.layers)
    return DraftCache(layers=layers, length=jnp.zeros((slots,), jnp.int32))


def pad_row(row: DraftCache, like: DraftCache) -> DraftCache:
    """Pad a B = 1 draft cache's arrays up to the slot shapes of `like` (positions -1, values 0).

    A shorter prompt keeps fewer tokens; padded slots are empty (position -1), so drafting from them is unchanged up
    to float reduction order — and drafts never decide a token. Raises ValueError if `row` is larger than a slot.
    """
    def fit(a, ref, name):
        if a.shape[1:] == ref.shape[1:]:
            return a
        if any(s > r for s, r in zip(a.shape[1:], ref.shape[1:])):
            raise ValueError(f"draft cache field {name!r} of shape {a.shape[1:]} exceeds the slot shape "
                             f"{ref.shape[1:]}: admit the longest prompt first or size the slots for it")
        pad = [(0, 0)] + [(0, r - s) for s, r in zip(a.shape[1:], ref.shape[1:])]
        return jnp.pad(a, pad, constant_values=-1 if name == "pos" else 0)

    def fit_form(f, ref):
        return _fill(f, lambda name, a: fit(a, getattr(ref, name), name))

    if len(row.layers) != len(like.layers):
        raise ValueError(f"draft cache has {len(row.layers)} layers, slots have {len(like.layers)}")
    layers = []
    for l, r in zip(row.layers, like.layers):
        if len(l.parts) != len(r.parts) or any(type(a) is not type(b) for a, b in zip(l.parts, r.parts)):
            raise ValueError("draft cache parts differ in kind from the slots' (one compressor per scheduler)")
        layers.append(DraftLayer(parts=tuple(fit_form(a, b) for a, b in zip(l.parts, r.parts)),
                                 recent=fit_form(l.recent, r.recent), window=l.window))
    return DraftCache(layers=tuple(layers), length=row.length)


# ---------------------------------------------------------------- full-cache baseline

@functools.partial(jax.jit, donate_argnames="cache")
def full_batch_step(params, config: ModelConfig, cache, tok: jax.Array, active: jax.Array):
    """One plain full-cache decode step over all slots; inactive slots (active[b] = 0) are left unchanged.

    Args:
        cache: ModelCache with B = slots (donated); tok: i32[B] tokens to feed; active: i32[B] 1 = decode.

    Returns:
        (next tokens i32[B], cache).
    """
    logits, cache = llama.forward(params, config, cache, tok[:, None], active)
    return jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32), cache


@functools.partial(jax.jit, donate_argnames="batch")
def put_layer_row(batch, row, slot: jax.Array):
    """Write one layer's B = 1 arrays (any pytree matching `batch`) into slot `slot` of the batch (donated)."""
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, 0), batch, row)
