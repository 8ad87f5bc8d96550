"""Jit-compiled pieces of the many-request schedulers (`kvjax.scheduling.vericache_scheduler`, `.full_scheduler`), for
every model family.

- `draft_slots`: batched drafting over static slots. Every slot drafts until its own `count` reaches its own `limit`;
  slots already there (empty, waiting for verification, or finished) are masked with `n_valid = 0`, which leaves their
  state untouched (masked writes drop the row, the length does not move). Compiled once per (slot count, x, steps).
  The family's `draft_split` separates the loop-invariant part of a draft cache (Llama: the compressed prompt parts)
  from what drafting changes, so the invariant part is not carried through the loop.
- `verify_row`: one request's (B = 1) verification with its changing draft state taken out of the slot batch and
  written back in the same program. The invariant part never moves: the row verified carries none of it
  (`draft_join(None, ...)`), which the family's `draft_commit` never reads. The row's drafted tokens are padded
  with -1 beyond `count`: a -1 never equals a full-cache token, so a partial round (fewer than x drafts) verifies
  exactly through the same x-row verify shape (rows after the first mismatch are rolled back, and row j's logits do
  not depend on later rows — the premise of the exactness contract).
- `put_slot_row` / `empty_slots` / `pad_row`: admission of a freshly compressed draft cache into a slot.
- `full_batch_step`, `put_layer_row`: the full-cache baseline (plain one-token forward over a batch of slots).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.decode import offload as offl
from kvjax.decode import sampling
from kvjax.decode import verify as verify_mod

# leaves named like this hold positions: empty is -1, not 0
_POSITION_FIELDS = ("pos",)


def put_slot(a: jax.Array, r: jax.Array, slot: jax.Array) -> jax.Array:
    """(Traced) `r` [1, ...] written at row `slot` of `a` (donated by the caller: updated in place). 16-bit floats
    are written as their bits: XLA:CPU copies a whole bf16 operand around a dynamic_update_slice instead of updating
    it in place (measured, 8 slots of 8 x [4, 2048, 32] bf16: 4.8 ms against 0.96 ms through uint16; f32 is updated
    in place) -- the scheduler's re-selected and admitted draft rows are bf16 by default."""
    r = r.astype(a.dtype)
    if a.dtype.itemsize == 2 and jnp.issubdtype(a.dtype, jnp.floating):
        bits = jax.lax.bitcast_convert_type
        return bits(jax.lax.dynamic_update_slice_in_dim(bits(a, jnp.uint16), bits(r, jnp.uint16), slot, 0), a.dtype)
    return jax.lax.dynamic_update_slice_in_dim(a, r, slot, 0)


@functools.partial(jax.jit, static_argnames=("steps", "temperature", "family", "impl"),
                   donate_argnames=("dbatch", "drafts"))
def draft_slots(params, config, dbatch, last: jax.Array, drafts: jax.Array, count: jax.Array, limit: jax.Array,
                seed: jax.Array, *, steps: int, temperature: float = 0.0, family, impl: str):
    """Draft up to `steps` tokens in every slot whose count[b] < limit[b], one batched forward per token.

    Args:
        dbatch: the family's draft cache with B = slots (donated).
        last: i32[B] last emitted token of each slot (the first draft input of a round).
        drafts: i32[B, x] tokens drafted so far this round (donated).
        count: i32[B] drafts made so far this round; limit: i32[B] drafts wanted this round (<= x).
        seed: i32[B] sampling seeds (unused when greedy).

    Returns:
        (dbatch, drafts i32[B, x], count i32[B]).
    """
    B, x = drafts.shape
    rows = jnp.arange(B)
    # The invariant part stays out of the loop carry: it is not copied in and out of the loop on every call (with
    # steps = 1 that copy of every slot's draft cache cost as much as the step).
    frozen, live = family.draft_split(dbatch)
    if steps > 1 and family.loop_params is not None:
        params = family.loop_params(params)

    def body(_, carry):
        live, drafts, count = carry
        act = count < limit
        prev = jnp.take_along_axis(drafts, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
        tok = jnp.where(count == 0, last, prev)
        logits, dc = family.draft_forward(params, config, family.draft_join(frozen, live), tok[:, None],
                                          act.astype(jnp.int32), implementation=impl)
        nxt = sampling.select_tokens(logits, dc.length[:, None], seed, temperature)[:, 0]
        drafts = drafts.at[rows, jnp.where(act, count, x)].set(nxt, mode="drop")  # x -> dropped
        return family.draft_split(dc)[1], drafts, count + act.astype(jnp.int32)

    carry = (live, drafts, count.astype(jnp.int32))
    if steps == 1:
        carry = body(0, carry)
    else:
        carry = jax.lax.fori_loop(0, steps, body, carry)
    live, drafts, count = carry
    return family.draft_join(frozen, live), drafts, count


def verify_row(params, config, host_part, device_part, length, prompt_len, dbatch, drafts: jax.Array,
               count: jax.Array, slot: jax.Array, last, qlog, seed, *, temperature: float = 0.0, family, impl: str):
    """Slot `slot`'s B = 1 offloaded verification (`decode.verify.verify_offloaded`, the same arguments but for the
    draft state) with its row hand-offs in the same program: the slot's changing draft state taken out of the batch,
    its drafts i32[1, x] (-1 beyond count), the verification, and the committed row's changing state written back
    into the slot (the batch's changing part donated: updated in place). One call per verification instead of three
    (take, verify, put; measured, the bundled model's 8 x 16K lock-step run, 8 alternated runs each in one process:
    wall 0.991x, verification phase 0.990x). Only the changing part enters the call: a call pays per array it is
    handed, and the invariant part (the compressed prompt parts, which `draft_commit` never reads) is most of a
    batch's arrays.

    Returns:
        (emitted, n, device_part, dbatch, row, aux, scratch): `verify_offloaded`'s outputs with the updated batch in
        place of the row's logits, and the committed B = 1 row (no invariant part), which a refreshing drafter
        re-selects from `scratch` (`put_parts` writes its new prompt parts).
    """
    frozen, live = family.draft_split(dbatch)
    args = (params, config, host_part, device_part, length, prompt_len, live, drafts, count, slot, last, qlog, seed)
    if offl.lends(host_part):
        program = verify_mod.lent_verifier(offl.device_of(host_part), temperature, False, family, impl,
                                           body=_verify_row, n_args=len(args))
        out = program(*args)
    else:
        out = _verify_row_fetched(*args, temperature=temperature, rejection=False, family=family, impl=impl)
    emitted, n, device_part, live, row, aux, scratch = out
    return emitted, n, device_part, family.draft_join(frozen, live), row, aux, scratch


def _verify_row(params, config, host_part, device_part, length, prompt_len, live, drafts, count, slot, last, qlog,
                seed, *, temperature: float, rejection: bool, family, impl: str):
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, 0)  # noqa: E731
    row = family.draft_join(None, jax.tree.map(take, live))
    d, c = take(drafts), take(count)
    d = jnp.where(jnp.arange(d.shape[1])[None, :] < c[:, None], d, -1)
    emitted, n, device_part, row, _, aux, scratch = verify_mod._verify_offloaded(
        params, config, host_part, device_part, length, prompt_len, row, last, d, qlog, seed,
        temperature=temperature, rejection=rejection, family=family, impl=impl)
    live = jax.tree.map(lambda a, r: put_slot(a, r, slot), live, family.draft_split(row)[1])
    return emitted, n, device_part, live, row, aux, scratch


_verify_row_fetched = jax.jit(_verify_row, static_argnames=("temperature", "rejection", "family", "impl"),
                              donate_argnames=("host_part", "device_part", "live"))


def _verify_row_compiles() -> int:
    """Compiles of `verify_row`'s programs, fetched and lent (`kvjax.decode.metrics.jit_cache_sizes`)."""
    lent = sum(f._cache_size() for key, f in verify_mod._LENT.items() if key[0] is _verify_row)
    return _verify_row_fetched._cache_size() + lent


verify_row._cache_size = _verify_row_compiles


@functools.partial(jax.jit, static_argnames="family", donate_argnames="dbatch")
def put_parts(dbatch, row, slot: jax.Array, *, family):
    """Write a B = 1 row's invariant part — the prompt parts a refreshing draft re-selected — into slot `slot`, for
    the layers where the row has one (the others keep the batch's)."""
    put = lambda a, r: put_slot(a, r, slot)  # noqa: E731
    frozen, live = family.draft_split(dbatch)
    new = tuple(f if not rf else jax.tree.map(put, f, rf) for f, rf in zip(frozen, family.draft_split(row)[0]))
    return family.draft_join(new, live)


@functools.partial(jax.jit, donate_argnames="dbatch")
def put_slot_row(dbatch, row, slot: jax.Array):
    """Admission: write a whole B = 1 draft cache (shapes as `dbatch`'s rows) into slot `slot`."""
    return jax.tree.map(lambda a, r: put_slot(a, r, slot), dbatch, row)


def _is_position(path) -> bool:
    last = path[-1] if path else None
    return getattr(last, "name", None) in _POSITION_FIELDS


def empty_slots(row, slots: int):
    """A draft cache of `slots` empty rows shaped like `row` (B = 1): zeros, positions -1."""
    return jax.tree_util.tree_map_with_path(
        lambda p, a: jnp.full((slots,) + a.shape[1:], -1 if _is_position(p) else 0, a.dtype), row)


def pad_row(row, like):
    """Pad a B = 1 draft cache's arrays up to the slot shapes of `like` (positions -1, everything else 0).

    A shorter prompt keeps fewer tokens; padded slots are empty, so drafting from them is unchanged up to float
    reduction order — and drafts never decide a token.

    Raises:
        ValueError: `row` is larger than a slot, or structured differently (one compressor per scheduler).
    """
    if jax.tree.structure(row) != jax.tree.structure(like):
        raise ValueError("draft cache differs in structure from the slots' (one compressor per scheduler)")

    def fit(path, a, ref):
        if a.shape[1:] == ref.shape[1:]:
            return a
        name = jax.tree_util.keystr(path)
        if len(a.shape) != len(ref.shape) or any(s > r for s, r in zip(a.shape[1:], ref.shape[1:])):
            raise ValueError(f"draft cache field {name} of shape {a.shape[1:]} exceeds the slot shape "
                             f"{ref.shape[1:]}: admit the longest prompt first or size the slots for it")
        pad = [(0, 0)] + [(0, r - s) for s, r in zip(a.shape[1:], ref.shape[1:])]
        return jnp.pad(a, pad, constant_values=-1 if _is_position(path) else 0)

    return jax.tree_util.tree_map_with_path(fit, row, like)


# ---------------------------------------------------------------- full-cache baseline

@functools.partial(jax.jit, static_argnames=("temperature", "family", "impl"), donate_argnames="cache")
def full_batch_step(params, config, cache, tok: jax.Array, active: jax.Array, seed: jax.Array, *,
                    temperature: float = 0.0, family, impl: str):
    """One plain full-cache decode step over all slots; inactive slots (active[b] = 0) are left unchanged.

    Args:
        cache: the family's full cache with B = slots (donated); tok: i32[B] tokens to feed; active: i32[B] 1 =
            decode; seed: i32[B] sampling seeds.

    Returns:
        (next tokens i32[B], cache).
    """
    logits, cache = family.forward(params, config, cache, tok[:, None], active, implementation=impl)
    return sampling.select_tokens(logits, cache.length[:, None], seed, temperature)[:, 0], cache


@functools.partial(jax.jit, donate_argnames="batch")
def put_layer_row(batch, row, slot: jax.Array):
    """Write one layer's B = 1 arrays (any pytree matching `batch`) into slot `slot` of the batch (donated)."""
    return jax.tree.map(lambda a, r: put_slot(a, r, slot), batch, row)
