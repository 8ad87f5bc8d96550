"""The split-K flash-attention kernel over a contiguous cache, shared by kernels 0-4.

Grid `(B, K, splits)`: program `(b, k, s)` owns KV head `k` of sequence `b`, the `[R, D]` tile of query rows that read
it, and the `s`-th contiguous slice of `S / splits` cache slots. It loops over that slice in blocks of `block_k` slots
with the online softmax of `online_softmax.py` and writes a partial `(o, m, l)`; the wrapper merges the splits with
`combine` and normalises with `finalize` (adding sinks there, outside the kernel).

Where a key's position comes from (static `pos_mode`):
- "array":  an explicit i32 array per slot (-1 empty) -- kernel 0, any cache form (rings, draft caches, concatenations).
            Blocks with no visible key are skipped after reading only their positions.
- "affine": implied by the slot index, `pos = slot * ratio + ratio - 1` -- dense caches (ratio 1: slot == position)
            and compressed CSA/HCA entries (entry `w` summarises tokens `w*m .. w*m+m-1`, so `pos <= t` is exactly
            `w < (t + 1) // m`). The loop runs only over blocks that can be visible: it ends at the last visible slot
            and, with a window, starts at the window's first slot instead of slot 0.
- "ring":   implied by a ring of capacity C and the count `seen` of tokens written: slot `c` holds the newest position
            `p < seen` with `p % C == c`. Only the C ring slots are read, never positions 0..t.

Key `pos` is visible to a query at `t >= 0` iff `0 <= pos <= t` (and `pos > t - W` with a window W).

The body uses only ref slicing with `pl.ds`, `jnp` arithmetic, `lax.dot_general`, `lax.fori_loop` and `lax.cond`, so
it is backend-neutral Pallas; it is lowered with the Triton backend (see README.md for why).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import online_softmax as osm
from pallas_kernels.layout import auto_splits, block_size, next_pow2
from pallas_kernels.backend import compiler_params

_BIG = 2**30


def visible(qp: jax.Array, kp: jax.Array, window: int | None) -> jax.Array:
    """bool[R, bk] from row positions i32[R] and key positions i32[bk]."""
    q = qp[:, None]
    k = kp[None, :]
    ok = (k >= 0) & (k <= q)
    if window is not None:
        ok &= k > q - window
    return ok


def _kernel(*refs, pos_mode, ratio, window, n_slots, block_k, split_len, kv_shared, scale):
    it = iter(refs)
    qpos_ref, q_ref, k_ref = next(it), next(it), next(it)
    v_ref = k_ref if kv_shared else next(it)
    aux_ref = next(it) if pos_mode in ("array", "ring") else None  # k_pos block or `seen` scalar
    o_ref, m_ref, l_ref = next(it), next(it), next(it)

    q = q_ref[...]  # [R, D]
    qp = qpos_ref[...]  # i32[R]
    base = pl.program_id(2) * split_len  # first slot of this split
    n_blocks = split_len // block_k

    if pos_mode == "affine":
        q_max = jnp.max(qp)
        hi_slot = jnp.clip((q_max + 1) // ratio - base, 0, split_len)
        hi = (hi_slot + block_k - 1) // block_k
        if window is not None:
            q_min = jnp.min(jnp.where(qp >= 0, qp, _BIG))
            lo = jnp.clip(q_min - window + 1 - base, 0, split_len) // block_k
        else:
            lo = 0
        lo = jnp.minimum(lo, hi)
    else:
        lo, hi = 0, n_blocks
    if pos_mode == "ring":
        last = aux_ref[()] - 1

    def positions(start):
        slot = base + start + jnp.arange(block_k, dtype=jnp.int32)
        if pos_mode == "array":
            pos = aux_ref[pl.ds(start, block_k)]
        elif pos_mode == "affine":
            pos = slot * ratio + (ratio - 1)
        else:  # ring of capacity n_slots; last - slot + C >= 0 because last >= -1 and slot < C
            pos = last - lax.rem(last - slot + n_slots, n_slots)
        return jnp.where(slot < n_slots, pos, -1)  # slots padded past the cache never show

    def compute(start, vis, state):
        kb = k_ref[pl.ds(start, block_k), :]  # [bk, D]
        s = osm.dot(q, kb, contract_b=1) * scale
        vb = kb if kv_shared else v_ref[pl.ds(start, block_k), :]
        return osm.update(state, s, vis, lambda p: osm.dot(p.astype(vb.dtype), vb))

    def body(i, state):
        start = pl.multiple_of(i * block_k, block_k)
        vis = visible(qp, positions(start), window)
        if pos_mode == "affine":  # the loop bounds already exclude invisible blocks
            return compute(start, vis, state)
        # skip the K/V read of a block nobody can see (reading positions is 4 bytes a slot, K/V 2*D*itemsize)
        any_vis = jnp.max(vis.astype(jnp.int32)) > 0
        return lax.cond(any_vis, functools.partial(compute, start, vis), lambda st: st, state)

    o, m, l = lax.fori_loop(lo, hi, body, osm.init_state(q.shape[0], q.shape[1]))
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def flash_partials(q_rows, qpos_rows, k, v, *, pos_mode, k_pos=None, seen=None, ratio=1, window=None, scale,
                   block_k=64, num_splits=None, interpret=False):
    """Run the kernel; return split-merged `(o f32[B, K, R, D], m f32[B, K, R], l f32[B, K, R])`.

    Args:
        q_rows: [B, K, R, D] query tile (see layout.py); qpos_rows: i32[B, R].
        k, v: [B, K, S, D] cache (v None: keys are the values, read once).
        pos_mode: "array" | "affine" | "ring" (module docstring).
        k_pos: i32[B, S] or [B, K, S] for "array"; seen: i32[B] for "ring".
        ratio: compression ratio m for "affine"; window: W or None; scale: softmax scale.
        block_k: slots per loop step (a power of two in [16, padded cache]).
        num_splits: split-K factor (grid axis; None = `layout.auto_splits`); partials merged by
            `online_softmax.combine`.
        interpret: False, True, or a `pltpu.InterpretParams` (the out-of-bounds-checking debug run).
    """
    B, K, R, D = q_rows.shape
    S = k.shape[2]
    kv_shared = v is None
    block_k = block_size(block_k, S)
    num_splits = auto_splits(num_splits, B, K, S, block_k)
    split_len = -(-S // (num_splits * block_k)) * block_k
    S_pad = split_len * num_splits
    D_pad = max(16, next_pow2(D))

    def pad_cache(x):  # a copy: only for shapes that are not powers of two (bucketed caches never pay it)
        if S_pad == S and D_pad == D:
            return x
        return jnp.pad(x, ((0, 0), (0, 0), (0, S_pad - S), (0, D_pad - D)))

    if D_pad != D:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, 0), (0, D_pad - D)))
    cache_spec = pl.BlockSpec((None, None, split_len, D_pad), lambda b, h, s: (b, h, s, 0))
    args = [qpos_rows.astype(jnp.int32), q_rows, pad_cache(k)]
    in_specs = [pl.BlockSpec((None, R), lambda b, h, s: (b, 0)),
                pl.BlockSpec((None, None, R, D_pad), lambda b, h, s: (b, h, 0, 0)),
                cache_spec]
    if not kv_shared:
        args.append(pad_cache(v))
        in_specs.append(cache_spec)
    if pos_mode == "array":
        kp = k_pos.astype(jnp.int32)
        kp = kp[:, None, :] if kp.ndim == 2 else kp
        kp = jnp.pad(kp, ((0, 0), (0, 0), (0, S_pad - S)), constant_values=-1)
        per_head = kp.shape[1] > 1
        args.append(kp)
        in_specs.append(pl.BlockSpec((None, None, split_len), lambda b, h, s: (b, h if per_head else 0, s)))
    elif pos_mode == "ring":
        args.append(seen.astype(jnp.int32))
        in_specs.append(pl.BlockSpec((None,), lambda b, h, s: (b,)))

    kernel = functools.partial(_kernel, pos_mode=pos_mode, ratio=ratio, window=window, n_slots=S,
                               block_k=block_k, split_len=split_len, kv_shared=kv_shared, scale=float(scale))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, num_splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, R, D_pad), lambda b, h, s: (b, h, s, 0, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, K, num_splits, R, D_pad), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, num_splits, R), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, num_splits, R), jnp.float32)],
        interpret=interpret,
        compiler_params=compiler_params(interpret),
        name=f"kvjax_flash_{pos_mode}",
    )(*args)
    o, m, l = osm.combine(o, m, l, axis=2)
    return o[..., :D], m, l
