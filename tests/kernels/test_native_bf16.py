"""The native kernel reads bf16 keys and values directly: bit for bit what it gives for the same values stored as f32.

bf16 -> f32 is exact, and the kernel widens keys as it transposes them and values as it loads them for p.V, so
native(bf16 K/V) must equal native(f32 K/V rounded to bf16) exactly -- ragged lengths, empty slots, windows, GQA
groups, D = 24 / 32 / 64. (The portable scalar build reads bf16 as the AVX2 build does:
`tests/kernels/test_native.py::test_scalar_build_equals_the_vector_build[bfloat16]`.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import native_attention_case

import pallas_kernels as pk
from kvjax.models import attention as attn
from pallas_kernels import native
from pallas_kernels import reference as ref

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernel does not build here")


_case = functools.partial(native_attention_case, kv_dtype=jnp.bfloat16)


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
