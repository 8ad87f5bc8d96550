"""The native kernel over caches longer than one key segment (half the capacity, 1,024-8,192 keys): each segment's
statistics are computed apart and merged in segment order. Against the f32 reference (ragged lengths that leave whole
segments empty, windows that start inside a later segment, per-head positions, fully masked rows), a row's bits
independent of the other rows in the call, bf16 keys read as their f32 values, and (slow) the scalar build's bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import jitted_reference, native_attention_case as _case, scalar_native_library

import pallas_kernels as pk
from pallas_kernels import native
from pallas_kernels import reference as ref

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library did not build here")

TOL = dict(atol=2e-5, rtol=2e-5)
S = 5000  # D = 32: blocks of 256 keys, segments of 9 blocks (2,500 keys rounded down) -> 3, the last partial
SEGMENT = 2304


def _native(q, k, v, q_pos, k_pos, window=None):
    return np.asarray(jitted_reference(pk.attend, q, k, v, q_pos, k_pos, window=window, implementation="native"))


def _reference(q, k, v, q_pos, k_pos, window=None):
    return np.asarray(jitted_reference(ref.attend_reference, q, k, v, q_pos, k_pos, window=window))


@pytest.mark.parametrize("T,G,window,per_head", [(1, 4, None, False), (9, 2, 3000, True), (33, 1, 300, False)])
def test_matches_reference_across_segments(T, G, window, per_head):
    # sequence 1 fills only the first segment: its other segments are empty and must add exactly nothing
    q, k, v, q_pos, k_pos = _case(T, G, S=S, lengths=(4990, 1500), per_head=per_head, seed=T)
    np.testing.assert_allclose(_native(q, k, v, q_pos, k_pos, window), _reference(q, k, v, q_pos, k_pos, window),
                               **TOL)


@pytest.mark.parametrize("S_small,D", [(1536, 64), (1280, 32), (1100, 64)])
def test_a_draft_sized_cache_in_two_segments_matches_the_reference(S_small, D):
    # a draft's kept part: segments of 1,024 keys, so a short second one (1,536 slots at D = 64: 1,024 + 512; 1,280
    # at D = 32: 1,024 + 256; 1,100 at D = 64: 1,024 + 76, its last block partial): against the reference, and a
    # row's bits still its own
    q, k, v, q_pos, k_pos = _case(5, 3, K=3, D=D, S=S_small, lengths=(S_small - 10, S_small // 3), per_head=True,
                                  seed=S_small)
    full = _native(q, k, v, q_pos, k_pos)
    np.testing.assert_allclose(full, _reference(q, k, v, q_pos, k_pos), **TOL)
    alone = _native(q[:, 2:3], k, v, q_pos[:, 2:3], k_pos)
    assert np.array_equal(alone[:, 0], full[:, 2])


def test_fully_masked_rows_stay_zero_across_segments():
    q, k, v, _, k_pos = _case(3, 2, S=S, lengths=(4990, 4990))
    q_pos = jnp.asarray([[-1, 0, 4700], [2500, 2600, 4900]], jnp.int32)  # padding; slot 0 only; one per segment
    k_pos = k_pos.at[1, :SEGMENT].set(-1)  # sequence 1: the first segment empty
    got = _native(q, k, v, q_pos, k_pos)
    np.testing.assert_allclose(got, _reference(q, k, v, q_pos, k_pos), **TOL)
    assert np.all(got[0, 0] == 0)


def test_a_rows_bits_do_not_depend_on_the_other_rows():
    q, k, v, q_pos, k_pos = _case(17, 3, K=3, D=64, S=6000, lengths=(5990,), seed=5)
    full = _native(q, k, v, q_pos, k_pos, 2500)
    for t in (0, 8, 16):
        alone = _native(q[:, t:t + 1], k, v, q_pos[:, t:t + 1], k_pos, 2500)
        assert np.array_equal(alone[:, 0], full[:, t]), t


def test_bf16_keys_and_values_give_the_bits_of_their_f32_values():
    q, k, v, q_pos, k_pos = _case(5, 2, S=S, lengths=(4990, 3000), kv_dtype=jnp.bfloat16, seed=7)
    a = _native(q, k, v, q_pos, k_pos)
    b = _native(q, k.astype(jnp.float32), v.astype(jnp.float32), q_pos, k_pos)
    assert np.array_equal(a, b)


@pytest.mark.slow  # compiles the library a second time (~15 s)
def test_scalar_build_equals_the_vector_build_across_segments(tmp_path):
    handle = scalar_native_library(tmp_path)
    jax.ffi.register_ffi_target("kvjax_attend_scalar_segments", jax.ffi.pycapsule(handle.KvjaxAttend), platform="cpu")
    for T, G, D, window in [(1, 3, 64, None), (9, 2, 32, 2500)]:
        q, k, v, q_pos, k_pos = _case(T, G, K=2, D=D, S=S, lengths=(4990, 2100), per_head=True, seed=D)
        shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32),
                  jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
        outs = [jax.ffi.ffi_call(target, shapes)(q, k, v, q_pos, k_pos, window=np.int64(window or 0),
                                                 scale=np.float32(D**-0.5), block=np.int64(native.default_block(D)))
                for target in (native.TARGET, "kvjax_attend_scalar_segments")]
        for a, b in zip(*outs):
            assert np.array_equal(np.asarray(a), np.asarray(b)), (T, G, D, window)
