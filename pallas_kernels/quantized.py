"""Kernel 6: decode/draft attention over the 2-/4-bit quantized draft cache, dequantizing inside the kernel.

Only the packed codes and the scales cross HBM (a 2-bit cache reads ~8x fewer bytes than bf16 for keys and values).
A packed byte holds `per = 8 // bits` consecutive channels, so rather than interleaving unpacked channels inside the
kernel (a lane shuffle Triton cannot express), the kernel works in *planes*: plane `j` holds channels `d` with
`d % per == j`, which is one shift-and-mask of the packed tile. Scores are sums over planes of
`q[:, j::per] . k_plane_j`; the wrapper splits q into planes once (it is tiny), the kernel reads the matching key
scale/zero channels with a strided ref read, and the output comes back per plane and is interleaved in the wrapper.
Keys are dequantized per channel with their token group's scale (one group per loop block: `block_k == group`),
values per token. Masking is kernel 0's: key `pos` visible iff 0 <= pos <= q_pos (and pos > q_pos - W).

Sinks and the recent full-precision tokens live in a separate dense part: call this with `return_stats=True`, run
`attend(..., return_stats=True)` on the dense part, and merge with `online_softmax.combine` / `finalize`.
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
from pallas_kernels.flash import visible
from pallas_kernels.layout import (auto_splits, next_pow2, positions_to_rows, queries_to_rows, row_count,
                                   rows_to_queries, sinks_to_rows)
from pallas_kernels.quant_format import dequantize


def _kernel(qpos_ref, q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, kpos_ref, o_ref, m_ref, l_ref, *,
            bits, group, n_blocks, window, scale):
    per = 8 // bits
    mask = jnp.uint8(2**bits - 1)
    qp = qpos_ref[...]  # i32[R]
    q_planes = [q_ref[j] for j in range(per)]  # per x [R, D / per]

    def compute(i, start, vis, state):
        kc = kc_ref[pl.ds(start, group), :]  # u8[bk, D / per]
        vc = vc_ref[pl.ds(start, group), :]
        vs = vs_ref[pl.ds(start, group)][:, None]  # [bk, 1]
        vz = vz_ref[pl.ds(start, group)][:, None]
        s = None
        v_planes = []
        for j in range(per):
            shift = jnp.uint8(j * bits)
            ks = ks_ref[pl.ds(i, 1), :, j]  # [1, D / per]: channels j, j + per, ... of this block's group
            kz = kz_ref[pl.ds(i, 1), :, j]
            k_j = ((kc >> shift) & mask).astype(jnp.float32) * ks + kz
            s_j = osm.dot(q_planes[j], k_j, contract_b=1)
            s = s_j if s is None else s + s_j
            v_planes.append(((vc >> shift) & mask).astype(jnp.float32) * vs + vz)
        return osm.update(state, s * scale, vis, lambda p: tuple(osm.dot(p, vj) for vj in v_planes))

    def body(i, state):  # i: the group index within this program's split
        start = pl.multiple_of(i * group, group)
        vis = visible(qp, kpos_ref[pl.ds(start, group)], window)
        any_vis = jnp.max(vis.astype(jnp.int32)) > 0
        return lax.cond(any_vis, functools.partial(compute, i, start, vis), lambda st: st, state)

    R, Dp = q_planes[0].shape
    o0, m0, l0 = osm.init_state(R, Dp)
    o, m, l = lax.fori_loop(0, n_blocks, body, (tuple(jnp.zeros_like(o0) for _ in range(per)), m0, l0))
    for j in range(per):
        o_ref[j] = o[j]
    m_ref[...] = m
    l_ref[...] = l


def quantized_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_pos, q_pos, *, bits, group=32,
                        window=None, scale=None, sinks=None, implementation=None, return_stats=False,
                        num_splits=None):
    """Attention over the quantized draft cache (format: `quant_format.py`).

    Args:
        q: [B, T, N, D] queries at positions q_pos i32[B, T].
        k_codes, v_codes: u8[B, K, S, D * bits // 8]; k_scale, k_zero: f32[B, K, S // group, D];
            v_scale, v_zero: f32[B, K, S, 1]; k_pos: i32[B, S] position per slot or i32[B, K, S] per head
            (tokens selected per head, e.g. drop + quantize); -1 empty.
        bits: 2 or 4; group: key group G (a power of two >= 16 for the Pallas path: one group per loop block).
        window, scale, sinks, implementation, return_stats: as `attention.attend`.
        num_splits: split-K factor (grid axis; at most S // group; None = `layout.auto_splits`), partials merged
            by `online_softmax.combine`.

    Returns:
        [B, T, N, D] in q's dtype, or the un-normalised `(o, m, l)` with `return_stats`.
    """
    impl = resolve(implementation)
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits}")
    if impl in ("xla", "native"):  # the native kernel reads f32 keys: dequantise, then attend as XLA does
        k, v = dequantize(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits=bits, group=group)
        return ref.attend_reference(q, k, v, q_pos, k_pos, window=window, scale=scale, sinks=sinks,
                                    return_stats=return_stats)
    B, T, N, D = q.shape
    K, S = k_codes.shape[1], k_codes.shape[2]
    G = N // K
    per = 8 // bits
    if group != next_pow2(group) or group < 16 or S % group:
        raise ValueError(f"the Pallas path needs a power-of-two group >= 16 dividing S={S}, got group={group}")
    if impl == "pallas" and D // per < 16:  # interpret mode runs it; Triton would reject the plane tiles
        raise ValueError(f"the compiled kernel needs D * bits / 8 >= 16 (tl.dot tiles), got D={D}, bits={bits}")
    R = row_count(T, G)
    scale = D**-0.5 if scale is None else scale
    rows = queries_to_rows(q.astype(jnp.float32), K, R)  # [B, K, R, D]
    q_planes = jnp.moveaxis(rows.reshape(B, K, R, D // per, per), -1, 2)  # [B, K, per, R, D / per]
    qpos_rows = positions_to_rows(q_pos, G, R)
    splits = max(1, min(auto_splits(num_splits, B, K, S, group), S // group))
    split_len = -(-S // (splits * group)) * group  # whole groups per split
    pad = split_len * splits - S

    def pad_slots(x, axis, value=0, unit=1):  # a copy only when S is not a multiple of splits * group
        if not pad:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad // unit)
        return jnp.pad(x, widths, constant_values=value)

    # free reshapes: channel d = c * per + j -> [..., c, j], so plane j is a strided read of the last axis
    ks = pad_slots(k_scale.reshape(B, K, S // group, D // per, per), 2, unit=group)
    kz = pad_slots(k_zero.reshape(B, K, S // group, D // per, per), 2, unit=group)
    kp = k_pos.astype(jnp.int32)
    kp = pad_slots(kp[:, None, :] if kp.ndim == 2 else kp, 2, -1)  # [B, K|1, S]
    per_head = kp.shape[1] > 1
    interpret = interpret_arg(impl)
    slots = pl.BlockSpec((None, None, split_len, D // per), lambda b, h, s: (b, h, s, 0))
    groups = pl.BlockSpec((None, None, split_len // group, D // per, per), lambda b, h, s: (b, h, s, 0, 0))
    per_token = pl.BlockSpec((None, None, split_len), lambda b, h, s: (b, h, s))
    kernel = functools.partial(_kernel, bits=bits, group=group, n_blocks=split_len // group, window=window,
                               scale=float(scale))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, splits),
        in_specs=[pl.BlockSpec((None, R), lambda b, h, s: (b, 0)),
                  pl.BlockSpec((None, None, per, R, D // per), lambda b, h, s: (b, h, 0, 0, 0)),
                  slots, groups, groups, slots, per_token, per_token,
                  pl.BlockSpec((None, None, split_len), lambda b, h, s: (b, h if per_head else 0, s))],
        out_specs=[pl.BlockSpec((None, None, None, per, R, D // per), lambda b, h, s: (b, h, s, 0, 0, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, K, splits, per, R, D // per), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, R), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, R), jnp.float32)],
        interpret=interpret,
        compiler_params=compiler_params(interpret),
        name=f"kvjax_quantized_{bits}bit",
    )(qpos_rows, q_planes, pad_slots(k_codes, 2), ks, kz, pad_slots(v_codes, 2), pad_slots(v_scale[..., 0], 2),
      pad_slots(v_zero[..., 0], 2), kp)
    # merge splits: combine wants o as [..., splits, R, D]; planes ride along in the last axes
    o = jnp.moveaxis(o, 3, -1).reshape(B, K, splits, R, D)  # interleave planes back: channel c * per + j
    o, m, l = osm.combine(o, m, l, axis=2)
    if return_stats:
        return (rows_to_queries(o, T, N), rows_to_queries(m[..., None], T, N)[..., 0],
                rows_to_queries(l[..., None], T, N)[..., 0])
    out = osm.finalize(o, m, l, sinks_to_rows(sinks, K, T, R))
    return rows_to_queries(out, T, N).astype(q.dtype)
