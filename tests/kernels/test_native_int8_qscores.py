"""int8 codes read as integers (`native.attend_stats_int8(..., qscores=True)` and the ring call's): a draft's kept keys
scored by exact integer dot products with each query row's int8 codes, and each value's scale multiplied into its
probability.

Against `pallas_kernels.reference.int8_qscores_reference` (its definition) within f32 rounding: SmolLM2's shape and
the bundled model's (the AVX-512 VNNI tiles where the CPU has them: head sizes that are multiples of 32) and head
sizes that take the plain integer loop, per-head positions, windows, rings in f32 and bf16, empty rings and rows that
see nothing; the draft's fused attention takes it (`attention.INT8_QSCORES`) and stays close to the f32 scores. Row
independence, empty rows and the scalar build's bits (slow) are `test_native_int8_ring.py`'s tests, run both ways.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import int8_ring_case

import pallas_kernels as pk
from kvjax.models import attention as attn
from pallas_kernels import native
from pallas_kernels.reference import int8_qscores_reference, quantize_query_rows

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernel does not build here")

TOL = dict(atol=3e-6, rtol=3e-5)


def _case(T, G, **kw):
    q, part, ring, q_pos = int8_ring_case(T, G, q_scale=3.0, **kw)  # a peaked softmax: the scores' rounding shows
    return q, part, ring, q_pos


def _kernel(q, part, ring, q_pos, window=None):
    if ring is None:
        return jax.jit(lambda q, p, qp: native.attend_stats_int8(q, p.k, p.v, p.k_scale, p.v_scale, qp, p.pos,
                                                                 window=window, qscores=True))(q, part, q_pos)
    return jax.jit(lambda q, p, r, qp: native.attend_stats_int8_ring(
        q, p.k, p.v, p.k_scale, p.v_scale, qp, p.pos, *r, window=window, qscores=True))(q, part, ring, q_pos)


def _want(q, part, ring, q_pos, window=None):
    return int8_qscores_reference(q, part.k, part.v, part.k_scale, part.v_scale, q_pos, part.pos, window=window,
                                  ring=ring, return_stats=True)


def _assert_close(got, want):
    """Rows that see a key: the running max, the sum and the output within f32 rounding; the others empty."""
    (go, gm, gl), (wo, wm, wl) = ([np.asarray(x) for x in s] for s in (got, want))
    seen = wl > 0
    assert seen.any()
    np.testing.assert_allclose(gm[seen], wm[seen], **TOL)
    np.testing.assert_allclose(gl[seen], wl[seen], **TOL)
    np.testing.assert_allclose(np.asarray(pk.finalize(*got)), np.asarray(pk.finalize(*want)), **TOL)
    assert np.all(gl[~seen] == 0) and np.all(gm[~seen] == np.finfo(np.float32).min) and np.all(go[~seen] == 0)


@pytest.mark.parametrize("T,G,D,window,per_head,ring_dtype,fill", [
    (1, 3, 64, None, True, jnp.float32, 20),  # a SmolLM2 draft token: 16-key integer tiles where the CPU has VNNI
    (1, 3, 128, None, False, jnp.bfloat16, 40),  # two 64-dim chunks per key, a bf16 ring
    (5, 2, 64, 300, True, jnp.float32, 64),  # several rows, a window that starts inside the kept part, a full ring
    (1, 2, 32, None, True, jnp.float32, 0),  # the bundled model's head size: half a 64-dim chunk, an empty ring
    (2, 2, 96, None, False, jnp.float32, 5),  # a 64-dim chunk and a 32-dim one per key
    (3, 4, 24, 100, False, jnp.bfloat16, 10),  # neither 16- nor 64-aligned, a short window
])
def test_the_ring_call_matches_its_definition(T, G, D, window, per_head, ring_dtype, fill):
    q, part, ring, q_pos = _case(T, G, D=D, per_head=per_head, ring_dtype=ring_dtype, fill=fill, seed=D + T + fill)
    _assert_close(_kernel(q, part, ring, q_pos, window), _want(q, part, ring, q_pos, window))


@pytest.mark.parametrize("T,G,D,window", [(1, 3, 64, None), (4, 2, 32, 200)])
def test_the_int8_call_matches_its_definition(T, G, D, window):
    q, part, _, q_pos = _case(T, G, D=D, seed=3 * D + T)
    _assert_close(_kernel(q, part, None, q_pos, window), _want(q, part, None, q_pos, window))


def test_query_codes_round_to_nearest_even_and_zero_rows_stay_zero():
    q = jnp.asarray([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
    codes, s = quantize_query_rows(q)
    assert codes.tolist() == [[64, -127, 32, 0], [0, 0, 0, 0]]  # 63.5 -> 64 (even), 31.75 -> 32
    assert np.allclose(np.asarray(s)[:, 0], [1 / 127, 0])


def test_the_draft_attention_takes_integer_scores_and_stays_close_to_f32_scores(monkeypatch):
    q, part, ring, q_pos = _case(1, 3, seed=8)
    f = jax.jit(lambda q, p, r, qp: attn.attention_parts(q, [p, r], qp, implementation="native"))
    hlo = f.lower(q, part, ring, q_pos).as_text()
    assert "qscores = 1" in hlo
    got = f(q, part, ring, q_pos)
    want = pk.finalize(*_want(q, part, ring, q_pos))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
    monkeypatch.setattr(attn, "INT8_QSCORES", False)
    f32 = jax.jit(lambda q, p, r, qp: attn.attention_parts(q, [p, r], qp, implementation="native"))(q, part, ring,
                                                                                                   q_pos)
    # the query's codes move the output by about their own rounding, never by a wrong key or mask
    err = np.abs(np.asarray(got) - np.asarray(f32)).max() / np.abs(np.asarray(f32)).max()
    assert 0 < err < 0.02, err
