"""The native product with bf16 weights (`pallas_kernels/native/matmul.cc`) against its f32 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library did not build here")


def _case(M, K, N, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.bfloat16)
    return x, w


@pytest.mark.parametrize("M,K,N", [(1, 256, 512), (3, 100, 77), (9, 64, 1536), (17, 1, 8), (2, 576, 960)])
def test_matmul_bf16_equals_the_f32_product_of_the_bf16_weights(M, K, N):
    from pallas_kernels.native.matmul import matmul_bf16

    x, w = _case(M, K, N)
    got = np.asarray(jax.jit(matmul_bf16)(x, w))
    want = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Each output is one FMA chain over k in order: row r is the same bits in calls of 1, 5 and 19 rows (row groups
    of 8, panels and threads never change a row's arithmetic)."""
    from pallas_kernels.native.matmul import matmul_bf16

    x, w = _case(19, 300, 1000, seed=1)
    f = jax.jit(matmul_bf16)
    full = np.asarray(f(x, w))
    for r in (0, 4, 18):
        np.testing.assert_array_equal(np.asarray(f(x[r:r + 1], w)), full[r:r + 1])
    np.testing.assert_array_equal(np.asarray(f(x[:5], w)), full[:5])


def test_linear_dispatch():
    """`pallas_kernels.linear`: f32 weights are the plain product (same program as `x @ w`); bf16 weights with f32
    activations take the native kernel on the CPU; leading dimensions pass through."""
    x, w = _case(6, 32, 48, seed=2)
    w32 = w.astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(pallas_kernels.linear(x, w32)), np.asarray(x @ w32))
    x3 = x.reshape(2, 3, 32)
    got = np.asarray(jax.jit(pallas_kernels.linear)(x3, w))
    assert got.shape == (2, 3, 48)
    np.testing.assert_allclose(got.reshape(6, 48), np.asarray(x @ w32), rtol=1e-5, atol=1e-5)
    hlo = jax.jit(pallas_kernels.linear).lower(x, w).as_text()
    assert native.MATMUL_TARGET in hlo  # read as bf16 by the native kernel, no f32 copy of w
    with pytest.raises(ValueError, match="w \\[K, N\\]"):
        from pallas_kernels.native.matmul import matmul_bf16

        matmul_bf16(x, w[:5])


@pytest.mark.slow  # compiles the library a second time (~15 s)
def test_scalar_build_equals_the_vector_build(tmp_path):
    """The portable build (scalar loop, std::fma) gives the vector build's bits (16-column AVX-512 runs where the CPU
    has them, then 8-column AVX2 runs, then single columns): widths that leave every kind of remainder."""
    from builders import scalar_native_library

    handle = scalar_native_library(tmp_path)
    jax.ffi.register_ffi_target("kvjax_matmul_scalar_test", jax.ffi.pycapsule(handle.KvjaxMatmulBf16),
                                platform="cpu")
    jax.ffi.register_ffi_target("kvjax_matmul_f32_scalar_test", jax.ffi.pycapsule(handle.KvjaxMatmulF32),
                                platform="cpu")
    for M, K, N in [(1, 576, 960), (3, 100, 77), (9, 64, 1000), (2, 33, 24), (8, 17, 1543), (33, 70, 300)]:
        x, w = _case(M, K, N, seed=N)
        out = jax.ShapeDtypeStruct((M, N), jnp.float32)
        a, b = (np.asarray(jax.ffi.ffi_call(t, out)(x, w)) for t in (native.MATMUL_TARGET, "kvjax_matmul_scalar_test"))
        assert np.array_equal(a, b), (M, K, N)
        w32 = w.astype(jnp.float32) * 1.25  # f32 weights: bits a bf16 never has
        a, b = (np.asarray(jax.ffi.ffi_call(t, out)(x, w32))
                for t in (native.MATMUL_F32_TARGET, "kvjax_matmul_f32_scalar_test"))
        assert np.array_equal(a, b), ("f32", M, K, N)


@pytest.mark.parametrize("M", [1, 3, 9, 33])
def test_matmul_f32_matches_the_f64_product_and_a_rows_bits_do_not_depend_on_the_others(M):
    from pallas_kernels.native.matmul import matmul_f32

    rng = np.random.default_rng(M)
    K, N = 1536, 3072 + 40  # a ragged last column run
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.float32)
    got = np.asarray(jax.jit(matmul_f32)(x, w))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4)
    one = np.asarray(jax.jit(matmul_f32)(x[-1:], w))  # the last row alone: its own chain, the same bits
    np.testing.assert_array_equal(one[0], got[-1])


def test_matmul_f32_has_xlas_gradient():
    from pallas_kernels.native.matmul import matmul_f32

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
    gx, gw = jax.grad(lambda x, w: jnp.sum(jnp.sin(matmul_f32(x, w))), argnums=(0, 1))(x, w)
    rx, rw = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, rx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw, rw, rtol=1e-4, atol=1e-4)
