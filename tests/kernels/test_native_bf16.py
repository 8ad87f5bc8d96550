"""The native kernel reads bf16 keys and values directly: bit for bit what it gives for the same values stored as f32.

bf16 -> f32 is exact, and the kernel widens keys as it transposes them and values as it loads them for p.V, so
native(bf16 K/V) must equal native(f32 K/V rounded to bf16) exactly -- ragged lengths, empty slots, windows, GQA
groups, D = 24 / 32 / 64 -- in the AVX2 build and in the portable scalar one.
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from kvjax.models import attention as attn
from pallas_kernels import native
from pallas_kernels import reference as ref

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernel does not build here")


def _case(T, G, *, K=2, D=32, S=700, lengths=(650, 300), per_head=False, seed=0):
    """f32 queries; bf16 keys/values over several native blocks (S = 700: the last block partial); ragged lengths."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    q = jnp.asarray(rng.normal(size=(B, T, K * G, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, K, S, D)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(B, K, S, D)), jnp.bfloat16)
    L = np.asarray(lengths)
    q_pos = jnp.asarray(L[:, None] - T + np.arange(T)[None], jnp.int32)
    k_pos = np.where(np.arange(S)[None] < L[:, None], np.arange(S)[None], -1).astype(np.int32)
    if per_head:  # per-head holes, as a sparse draft cache has
        k_pos = np.repeat(k_pos[:, None], K, axis=1)
        k_pos[rng.random(k_pos.shape) < 0.3] = -1
    return q, k, v, q_pos, jnp.asarray(k_pos)


def _stats(q, k, v, q_pos, k_pos, window=None):
    return jax.jit(lambda *a: native.attend_stats(*a, window=window))(q, k, v, q_pos, k_pos)


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("T,G,D,window,per_head", [
    (1, 2, 32, None, False),  # a decode step of the tiny model's shape
    (33, 2, 32, None, True),  # an x = 32 verify block over a per-head sparse part
    (5, 8, 32, 100, False),  # GQA group of 8, a window inside the cache
    (9, 3, 64, 300, True),  # SmolLM2's head dim and group
    (3, 1, 24, None, False),  # D not a multiple of 8: the scalar column tail
])
def test_bf16_kv_equals_f32_kv_of_the_rounded_values(T, G, D, window, per_head):
    q, k, v, q_pos, k_pos = _case(T, G, D=D, per_head=per_head, seed=D + T)
    f32 = jnp.float32
    _assert_same(_stats(q, k, v, q_pos, k_pos, window), _stats(q, k.astype(f32), v.astype(f32), q_pos, k_pos, window))


def test_keys_as_values_and_the_reference():
    """v None (keys are the values) reads the bf16 keys twice; the result matches the f32 reference of the rounded
    values within f32 rounding, the normalised output included."""
    q, k, _, q_pos, k_pos = _case(17, 4, seed=5)
    kf = k.astype(jnp.float32)
    _assert_same(_stats(q, k, None, q_pos, k_pos), _stats(q, kf, None, q_pos, k_pos))
    got = jax.jit(lambda *a: pk.attend(*a, implementation="native"))(q, k, k, q_pos, k_pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref.attend_reference(q, kf, kf, q_pos, k_pos)),
                               atol=2e-5, rtol=2e-5)


def test_the_compiled_call_takes_bf16_without_an_f32_copy():
    """The custom call's operands are the bf16 arrays themselves: no convert to f32 anywhere in the program."""
    q, k, v, q_pos, k_pos = _case(1, 2)
    hlo = jax.jit(lambda *a: native.attend_stats(*a)).lower(q, k, v, q_pos, k_pos).as_text()
    call = next(line for line in hlo.splitlines() if "custom_call" in line)
    assert call.count("tensor<2x2x700x32xbf16>") >= 2 and "stablehlo.convert" not in hlo


def test_mixed_dtypes_read_as_f32():
    """bf16 keys with f32 values (or the reverse) are both read as f32: the same as all-f32."""
    q, k, v, q_pos, k_pos = _case(5, 2, seed=2)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    _assert_same(_stats(q, k, vf, q_pos, k_pos), _stats(q, kf, vf, q_pos, k_pos))


def test_dispatcher_sends_bf16_parts_to_native(monkeypatch):
    """`part_stats` (the draft's attention over its parts) takes the native kernel for bf16 keys, with their bits
    unchanged, and the XLA path upcasts them: both agree with the f32 statistics of the rounded values."""
    q, k, v, q_pos, k_pos = _case(9, 2, per_head=True, seed=7)
    assert attn.native_wins(q, k)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    got = jax.jit(lambda *a: attn.part_stats(*a, implementation="native"))(q, k, v, q_pos, k_pos)
    _assert_same(got, _stats(q, kf, vf, q_pos, k_pos))
    xla = jax.jit(lambda *a: attn.part_stats(*a, implementation="xla"))(q, k, v, q_pos, k_pos)
    want = attn.attend_stats(q, kf, vf, q_pos, k_pos)
    for a, b in zip(xla, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6)


@pytest.mark.slow  # compiles the library a second time (~15 s)
def test_scalar_build_reads_bf16_as_the_vector_build(tmp_path):
    if native.status().get("vector_width") != 8:
        pytest.skip("this machine's build is the scalar one already")
    lib = tmp_path / "scalar.so"
    err = native._compile(native._compiler(), list(native.FLAG_SETS[-1]), lib)
    assert err is None, err
    handle = ctypes.cdll.LoadLibrary(str(lib))
    jax.ffi.register_ffi_target("kvjax_attend_bf16_scalar_test", jax.ffi.pycapsule(handle.KvjaxAttend),
                                platform="cpu")
    for T, G, D, window in [(17, 2, 32, None), (5, 3, 64, 300), (3, 2, 24, None)]:
        q, k, v, q_pos, k_pos = _case(T, G, D=D, S=701, lengths=(698, 350), per_head=True, seed=D)
        outs = []
        for target in (native.TARGET, "kvjax_attend_bf16_scalar_test"):
            shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32),
                      jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
            outs.append(jax.ffi.ffi_call(target, shapes)(q, k, v, q_pos, k_pos, window=np.int64(window or 0),
                                                         scale=np.float32(D**-0.5),
                                                         block=np.int64(native.default_block(D))))
        _assert_same(*outs)
