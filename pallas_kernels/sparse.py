"""Kernel 5: sparse attention over indexer-selected entries (DeepSeek-V4 CSA: the lightning indexer's top-k).

Each query `t` attends only to the entries `indices[b, t, :]` of a `[B, K, E, D]` cache; -1 marks an unused pick.
Grid `(B, K, T)`: one program per query and KV head, holding that query's `G` head rows (padded to 16). It loops over
the picks in blocks of `block_k`, gathers the picked rows straight from the cache ref (`k_ref[idx]`, a gather load on
GPU; no gathered copy in HBM), and skips blocks whose picks are all -1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import online_softmax as osm
from pallas_kernels import reference as ref
from pallas_kernels.backend import compiler_params, interpret_arg, resolve
from pallas_kernels.layout import block_size, next_pow2, row_count


def _gather(ref, idx, checked):
    """Rows `ref[idx]` of a [E, D] ref. `checked`: one dynamic-slice read per row instead of a gather, because the
    bounds-checking interpreter (`InterpretParams`) rejects gathers ("advanced indexers") but checks slices."""
    if not checked:
        return ref[idx, :]
    return jnp.concatenate([ref[pl.ds(idx[i], 1), :] for i in range(idx.shape[0])], axis=0)


def _kernel(*refs, block_k, n_picks, kv_shared, scale, checked):
    it = iter(refs)
    idx_ref, q_ref, k_ref = next(it), next(it), next(it)
    v_ref = k_ref if kv_shared else next(it)
    o_ref, m_ref, l_ref = next(it), next(it), next(it)
    q = q_ref[...]  # [R, D]

    def compute(idx, ok, state):
        safe = jnp.maximum(idx, 0)  # -1 picks read row 0 and are masked: never an out-of-bounds gather
        kb = _gather(k_ref, safe, checked)  # [bk, D]
        s = osm.dot(q, kb, contract_b=1) * scale
        vb = kb if kv_shared else _gather(v_ref, safe, checked)
        vis = jnp.broadcast_to(ok[None, :], s.shape)
        return osm.update(state, s, vis, lambda p: osm.dot(p.astype(vb.dtype), vb))

    def body(i, state):
        idx = idx_ref[pl.ds(pl.multiple_of(i * block_k, block_k), block_k)]
        ok = idx >= 0
        any_ok = jnp.max(ok.astype(jnp.int32)) > 0
        return lax.cond(any_ok, functools.partial(compute, idx, ok), lambda st: st, state)

    o, m, l = lax.fori_loop(0, n_picks // block_k, body, osm.init_state(q.shape[0], q.shape[1]))
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def sparse_attention(q, k, v, indices, *, scale=None, sinks=None, implementation=None, block_k=32,
                     return_stats=False):
    """Attention of each query over its own top-k entries.

    Args:
        q: [B, T, N, D] queries.
        k, v: [B, K, E, D] entries (v None: keys are the values, DeepSeek-V4's shared K=V).
        indices: i32[B, T, top_k] picked entry per query (shared by all heads), -1 = invalid. Indices must be < E
            (the "pallas_debug" implementation raises on a larger one; compiled kernels would read out of bounds).
        scale: default D ** -0.5; sinks: f32[N] or None.
        implementation: None (auto), "xla", "pallas", "pallas_interpret", "pallas_debug".
        block_k: picks per loop step (static).
        return_stats: return un-normalised `(o f32[B, T, N, D], m f32[B, T, N], l f32[B, T, N])` for
            `online_softmax.combine` with other parts of the cache (sinks are then the caller's to add).

    Returns:
        [B, T, N, D] in q's dtype; a query with no valid pick (and no sink) gets zeros.
    """
    impl = resolve(implementation)
    if impl in ("xla", "native"):  # per-query gathers: no native form (the gather dominates)
        return ref.sparse_reference(q, k, v, indices, scale=scale, sinks=sinks, return_stats=return_stats)
    B, T, N, D = q.shape
    K, E = k.shape[1], k.shape[2]
    G = N // K
    R = row_count(1, G)
    scale = D**-0.5 if scale is None else scale
    n_picks = indices.shape[2]
    block_k = block_size(block_k, n_picks)
    P_pad = -(-n_picks // block_k) * block_k
    D_pad = max(16, next_pow2(D))
    E_pad = next_pow2(E)
    idx = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, P_pad - n_picks)), constant_values=-1)
    # [B, T, N, D] -> [B, K, T, R, D]: each program's G head rows of one query, padded to R
    qr = jnp.transpose(q.reshape(B, T, K, G, D), (0, 2, 1, 3, 4))
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, 0), (0, R - G), (0, D_pad - D)))

    def pad_cache(x):  # power-of-two tiles for Triton; bucketed caches skip the copy
        return x if (E_pad, D_pad) == (E, D) else jnp.pad(x, ((0, 0), (0, 0), (0, E_pad - E), (0, D_pad - D)))

    cache_spec = pl.BlockSpec((None, None, E_pad, D_pad), lambda b, h, t: (b, h, 0, 0))
    args = [idx, qr, pad_cache(k)]
    in_specs = [pl.BlockSpec((None, None, P_pad), lambda b, h, t: (b, t, 0)),
                pl.BlockSpec((None, None, None, R, D_pad), lambda b, h, t: (b, h, t, 0, 0)), cache_spec]
    if v is not None:
        args.append(pad_cache(v))
        in_specs.append(cache_spec)
    interpret = interpret_arg(impl)
    kernel = functools.partial(_kernel, block_k=block_k, n_picks=P_pad, kv_shared=v is None, scale=float(scale),
                               checked=impl == "pallas_debug")
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, T),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, R, D_pad), lambda b, h, t: (b, h, t, 0, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, t: (b, h, t, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, t: (b, h, t, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, K, T, R, D_pad), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, T, R), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, T, R), jnp.float32)],
        interpret=interpret,
        compiler_params=compiler_params(interpret),
        name="kvjax_sparse",
    )(*args)
    if return_stats:  # [B, K, T, R, ...] -> the public [B, T, N, ...] layout, padding rows and channels dropped
        o_q = jnp.transpose(o[:, :, :, :G, :D], (0, 2, 1, 3, 4)).reshape(B, T, N, D)
        to_q = lambda a: jnp.transpose(a[:, :, :, :G], (0, 2, 1, 3)).reshape(B, T, N)  # noqa: E731
        return o_q, to_q(m), to_q(l)
    sink_rows = None
    if sinks is not None:
        sink_rows = jnp.pad(sinks.astype(jnp.float32).reshape(K, 1, G), ((0, 0), (0, 0), (0, R - G)),
                            constant_values=osm.MASK_VALUE)
    out = osm.finalize(o, m, l, sink_rows)[:, :, :, :G, :D]  # [B, K, T, G, D]
    return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(B, T, N, D).astype(q.dtype)
