"""A draft's two parts in one native call (`pallas_kernels.native.attend_stats_int8_ring`): its kept tokens as int8
codes with per-slot scales and its recent ring in f32 or bf16, their statistics merged inside the call.

Against the two parts attended apart and `combine`d (what the draft did before): equal up to f32 rounding, with
per-head positions, windows, an empty ring, bf16 rings and fully masked rows. With f32 scores and with the int8 codes
read as integers (`test_native_int8_qscores.py`): a row's bits do not depend on the other rows in the call, a row that
sees nothing stays empty, and (slow) the scalar build gives the vector build's bits. `attention_parts` takes the one
call for exactly these parts; bad inputs are refused with a reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import int8_ring_case, scalar_native_library

import pallas_kernels as pk
from kvjax.models import attention as attn
from pallas_kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernel does not build here")

TOL = dict(atol=2e-6, rtol=2e-5)


_case = int8_ring_case


def _fused(q, part, ring, q_pos, window=None, qscores=False):
    return jax.jit(lambda q, p, r, qp: native.attend_stats_int8_ring(q, p.k, p.v, p.k_scale, p.v_scale, qp, p.pos, *r,
                                                                     window=window, qscores=qscores))(q, part, ring,
                                                                                                      q_pos)


def _apart(q, part, ring, q_pos, window=None):
    def f(q, p, r, qp):
        a = native.attend_stats_int8(q, p.k, p.v, p.k_scale, p.v_scale, qp, p.pos, window=window)
        b = native.attend_stats(q, *r[:2], qp, r[2], window=window)
        return pk.combine(*(jnp.stack(s, axis=0) for s in zip(a, b)), axis=0)
    return jax.jit(f)(q, part, ring, q_pos)


@pytest.mark.parametrize("T,G,D,window,per_head,ring_dtype,fill", [
    (1, 3, 64, None, True, jnp.float32, 20),  # a SmolLM2 draft token: kept slots per head, an f32 ring
    (1, 2, 32, None, False, jnp.bfloat16, 40),  # a bf16 ring
    (5, 2, 32, 300, True, jnp.float32, 64),  # several rows, a window that starts inside the kept part, a full ring
    (1, 3, 64, None, True, jnp.float32, 0),  # an empty ring: the kept part's statistics alone
])
def test_one_call_equals_the_two_parts_combined(T, G, D, window, per_head, ring_dtype, fill):
    q, part, ring, q_pos = _case(T, G, D=D, per_head=per_head, ring_dtype=ring_dtype, fill=fill, seed=D + T + fill)
    got, want = _fused(q, part, ring, q_pos, window), _apart(q, part, ring, q_pos, window)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))  # the running max: exact either way
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
    np.testing.assert_allclose(np.asarray(pk.finalize(*got)), np.asarray(pk.finalize(*want)), **TOL)


@pytest.mark.parametrize("qscores", [False, True])  # f32 scores, or the int8 codes read as integers
def test_a_row_that_sees_nothing_stays_empty(qscores):
    q, part, ring, q_pos = _case(3, 3, seed=4)
    q_pos = q_pos.at[0, 0].set(-1)  # padding: no key is at a position <= -1
    o, m, l = (np.asarray(x) for x in _fused(q, part, ring, q_pos, qscores=qscores))
    assert np.all(o[0, 0] == 0) and np.all(l[0, 0] == 0) and np.all(m[0, 0] == np.finfo(np.float32).min)
    assert np.all(l[0, 1:] > 0)


@pytest.mark.parametrize("qscores", [False, True])
def test_a_rows_bits_do_not_depend_on_the_other_rows(qscores):
    q, part, ring, q_pos = _case(5, 3, fill=30, seed=6)
    full = _fused(q, part, ring, q_pos, qscores=qscores)
    for t in (0, 4):
        alone = _fused(q[:, t:t + 1], part, ring, q_pos[:, t:t + 1], qscores=qscores)
        for a, b in zip(alone, full):
            assert np.array_equal(np.asarray(a)[:, 0], np.asarray(b)[:, t]), t


def test_the_draft_attention_takes_one_call_for_a_kept_part_and_its_ring(monkeypatch):
    monkeypatch.setattr(attn, "INT8_QSCORES", False)  # f32 scores, as the two calls compute (integer ones: their test)
    q, part, ring, q_pos = _case(1, 3, seed=8)

    def lowered():
        f = jax.jit(lambda q, p, r, qp: attn.attention_parts(q, [p, r], qp, implementation="native"))
        return f.lower(q, part, ring, q_pos).as_text(), f(q, part, ring, q_pos)

    hlo, got = lowered()
    assert hlo.count(f"@{native.INT8_RING_TARGET}(") == 1 and f"@{native.INT8_TARGET}(" not in hlo
    monkeypatch.setattr(attn, "FUSE_INT8_RING", False)
    hlo_apart, want = lowered()
    assert f"@{native.INT8_RING_TARGET}(" not in hlo_apart and f"@{native.INT8_TARGET}(" in hlo_apart
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_bad_inputs_are_refused_with_reasons():
    q, part, (rk, rv, r_pos), q_pos = _case(1, 3)
    call = native.attend_stats_int8_ring
    with pytest.raises(ValueError, match="int8 codes"):
        call(q, part.k.astype(jnp.float32), part.v, part.k_scale, part.v_scale, q_pos, part.pos, rk, rv, r_pos)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        call(q, part.k, part.v, part.k_scale[..., :5], part.v_scale, q_pos, part.pos, rk, rv, r_pos)
    with pytest.raises(ValueError, match="ring_k and ring_v"):
        call(q, part.k, part.v, part.k_scale, part.v_scale, q_pos, part.pos, rk[..., :32], rv[..., :32], r_pos)
    with pytest.raises(ValueError, match="ring_k and ring_v"):
        call(q, part.k, part.v, part.k_scale, part.v_scale, q_pos, part.pos, rk, rv[:, :, :8], r_pos)


@pytest.mark.slow  # compiles the library a second time (~15 s; shared with the other scalar-build tests of the run)
@pytest.mark.parametrize("qscores", [0, 1])  # f32 scores, or int8 codes read as integers (VNNI at D = 32, 64, 96, 128)
def test_scalar_build_equals_the_vector_build(tmp_path, qscores):
    handle = scalar_native_library(tmp_path)
    jax.ffi.register_ffi_target("kvjax_attend_int8_ring_scalar", jax.ffi.pycapsule(handle.KvjaxAttendInt8Ring),
                                platform="cpu")
    for T, G, D, ring_dtype in [(1, 3, 64, jnp.float32), (5, 2, 24, jnp.bfloat16), (2, 3, 128, jnp.float32),
                                 (3, 2, 32, jnp.bfloat16), (1, 2, 96, jnp.float32)]:
        q, part, (rk, rv, r_pos), q_pos = _case(T, G, D=D, ring_dtype=ring_dtype, seed=D)
        shapes = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in (q.shape, q.shape[:3], q.shape[:3]))
        outs = [jax.ffi.ffi_call(target, shapes)(q, part.k, part.v, part.k_scale, part.v_scale, q_pos, part.pos, rk,
                                                 rv, r_pos, window=np.int64(0), scale=np.float32(D**-0.5),
                                                 block=np.int64(native.default_block(D)), qscores=np.int64(qscores))
                for target in (native.INT8_RING_TARGET, "kvjax_attend_int8_ring_scalar")]
        for a, b in zip(*outs):
            assert np.array_equal(np.asarray(a), np.asarray(b)), (T, G, D)
