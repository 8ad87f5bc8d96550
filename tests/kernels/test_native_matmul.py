"""The native products (`pallas_kernels/native/matmul.cc`) with bf16 weights, int8 codes and f32 weights against their
f64 references, and the int8 weight format (`pallas_kernels.linear.quantize_int8`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import native
from pallas_kernels.linear import (F32_NATIVE_ROWS, Int8Weight, PackedF32, PackedInt8, dequantize_int8, pack_f32,
                                   pack_int8, quantize_int8, unpack_f32, unpack_int8)

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
    """Each output is FMA chains over k in order, in chunks of k fixed by the shape (here 2: 300 rows of 2,000 bytes):
    row r is the same bits in calls of 1, 5 and 19 rows (row groups, panels and threads never change a row's
    arithmetic)."""
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
    jax.ffi.register_ffi_target("kvjax_matmul_int8_scalar_test", jax.ffi.pycapsule(handle.KvjaxMatmulI8),
                                platform="cpu")
    jax.ffi.register_ffi_target("kvjax_matmul_packed_scalar_test", jax.ffi.pycapsule(handle.KvjaxMatmulF32Packed),
                                platform="cpu")
    jax.ffi.register_ffi_target("kvjax_matmul_int8_packed_scalar_test", jax.ffi.pycapsule(handle.KvjaxMatmulI8Packed),
                                platform="cpu")
    for M, K, N in [(1, 576, 960), (3, 100, 77), (9, 64, 1000), (2, 33, 24), (8, 17, 1543), (33, 70, 300), (7, 40, 192),
                    (1, 300, 128)]:
        x, w = _case(M, K, N, seed=N)
        out = jax.ShapeDtypeStruct((M, N), jnp.float32)
        a, b = (np.asarray(jax.ffi.ffi_call(t, out)(x, w)) for t in (native.MATMUL_TARGET, "kvjax_matmul_scalar_test"))
        assert np.array_equal(a, b), (M, K, N)
        w32 = w.astype(jnp.float32) * 1.25  # f32 weights: bits a bf16 never has
        a, b = (np.asarray(jax.ffi.ffi_call(t, out)(x, w32))
                for t in (native.MATMUL_F32_TARGET, "kvjax_matmul_f32_scalar_test"))
        assert np.array_equal(a, b), ("f32", M, K, N)
        q = quantize_int8(w.astype(jnp.float32))
        a, b = (np.asarray(jax.ffi.ffi_call(t, out)(x, q.codes, q.scale))
                for t in (native.MATMUL_I8_TARGET, "kvjax_matmul_int8_scalar_test"))
        assert np.array_equal(a, b), ("int8", M, K, N)
        if N % 64 == 0:
            p = pack_f32(w32).panels
            a, b = (np.asarray(jax.ffi.ffi_call(t, out)(x, p))
                    for t in (native.MATMUL_F32_PACKED_TARGET, "kvjax_matmul_packed_scalar_test"))
            assert np.array_equal(a, b), ("packed", M, K, N)
            p = pack_f32(w.astype(jnp.float32)).panels  # exactly bf16 values: bf16 panels
            assert p.dtype == jnp.bfloat16
            a, b = (np.asarray(jax.ffi.ffi_call(t, out)(x, p))
                    for t in (native.MATMUL_F32_PACKED_TARGET, "kvjax_matmul_packed_scalar_test"))
            assert np.array_equal(a, b), ("bf16 panels", M, K, N)
            p = pack_int8(q)
            a, b = (np.asarray(jax.ffi.ffi_call(t, out)(x, p.panels, p.scale))
                    for t in (native.MATMUL_I8_PACKED_TARGET, "kvjax_matmul_int8_packed_scalar_test"))
            assert np.array_equal(a, b), ("int8 packed", M, K, N)


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


def test_quantize_int8_is_symmetric_per_output_column():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((40, 12)).astype(np.float32) * np.linspace(0.01, 3.0, 12, dtype=np.float32)
    w[:, 3] = 0.0  # an all-zero column: scale 1, codes 0
    q = quantize_int8(jnp.asarray(w))
    codes, scale = np.asarray(q.codes), np.asarray(q.scale)
    assert codes.dtype == np.int8 and scale.shape == (12,) and q.shape == (40, 12)
    assert q.nbytes == 40 * 12 + 12 * 4
    assert np.all(np.abs(codes) <= 127)
    live = np.arange(12) != 3
    assert np.all(np.abs(codes[:, live]).max(axis=0) == 127)  # each column's largest weight is a full-range code
    assert scale[3] == 1.0 and not codes[:, 3].any()
    np.testing.assert_allclose(scale[live], np.abs(w[:, live]).max(axis=0) / 127, rtol=1e-6)
    err = np.abs(np.asarray(dequantize_int8(q)) - w)
    assert np.all(err <= scale / 2 * (1 + 1e-5))  # round to nearest: at most half a step
    with pytest.raises(ValueError, match="\\[K, N\\] weight"):
        quantize_int8(jnp.zeros((2, 3, 4)))


@pytest.mark.parametrize("M", [1, 4, 9, 33, 70])
def test_matmul_int8_matches_the_f64_product_and_a_rows_bits_do_not_depend_on_the_others(M):
    from pallas_kernels.native.matmul import matmul_int8

    rng = np.random.default_rng(M)
    K, N = 576, 1536 + 40  # a ragged last column run; 70 rows: two row groups
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    q = quantize_int8(jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.float32))
    got = np.asarray(jax.jit(matmul_int8)(x, q.codes, q.scale))
    want = (np.asarray(x, np.float64) @ np.asarray(q.codes, np.float64)) * np.asarray(q.scale, np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    one = np.asarray(jax.jit(matmul_int8)(x[-1:], q.codes, q.scale))
    np.testing.assert_array_equal(one[0], got[-1])
    with pytest.raises(ValueError, match="scale \\[N\\]"):
        matmul_int8(x, q.codes, q.scale[:-1])


def test_linear_reads_int8_weights_natively_and_elsewhere_as_a_bf16_dot():
    """An `Int8Weight` with f32 activations takes the native int8 kernel (no dequantised copy in the program); other
    activations take the portable form (the codes as bf16, exact, times the scales), the one GPUs and TPUs run."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    q = quantize_int8(jnp.asarray(rng.standard_normal((64, 96)), jnp.float32))
    assert isinstance(q, Int8Weight)
    want = np.asarray(x, np.float64) @ np.asarray(dequantize_int8(q), np.float64)
    got = np.asarray(jax.jit(pallas_kernels.linear)(x, q))
    assert got.shape == (2, 3, 96)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert native.MATMUL_I8_TARGET in jax.jit(pallas_kernels.linear).lower(x, q).as_text()
    xb = x.astype(jnp.bfloat16)
    portable = np.asarray(pallas_kernels.linear(xb, q))
    np.testing.assert_allclose(portable, np.asarray(xb, np.float64) @ np.asarray(dequantize_int8(q), np.float64),
                               rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_pack_f32_round_trips_and_refuses_what_it_cannot_pack():
    w = jnp.asarray(np.random.default_rng(3).standard_normal((5, 128)), jnp.float32)
    p = pack_f32(w)
    assert p.panels.shape == (2, 5, 64) and p.shape == (5, 128) and p.nbytes == w.nbytes
    np.testing.assert_array_equal(np.asarray(p.panels[1, 2]), np.asarray(w[2, 64:]))  # panel 1: columns 64..127
    np.testing.assert_array_equal(np.asarray(unpack_f32(p)), np.asarray(w))
    for bad in (w[:, :100], w.astype(jnp.bfloat16), w[0]):
        with pytest.raises(ValueError, match="multiple of 64"):
            pack_f32(bad)


@pytest.mark.parametrize("K,N", [(576, 3072), (1536, 576), (70, 192)])
def test_packed_weights_give_the_plain_matrixs_bits_for_any_number_of_rows(K, N):
    """`linear` on a `PackedF32` equals `linear` on its plain matrix bit for bit -- the native tiles' rows
    (`F32_NATIVE_ROWS`) and the rows XLA's dot takes alike -- and the packed product itself is the plain product's chain
    for every row count, one row and more than a group of 64 included; a row's bits do not depend on the other rows."""
    from pallas_kernels.native.matmul import matmul_f32, matmul_f32_packed

    rng = np.random.default_rng(K + N)
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
    p = pack_f32(w)
    x = jnp.asarray(rng.standard_normal((130, K)), jnp.float32)
    for M in (1, 2, 5, 9, 33, 64, 65, 130):
        a, b = np.asarray(pallas_kernels.linear(x[:M], p)), np.asarray(pallas_kernels.linear(x[:M], w))
        assert np.array_equal(a, b), M
        direct = np.asarray(matmul_f32_packed(x[:M], p.panels))
        assert np.array_equal(direct, np.asarray(matmul_f32(x[:M], w))), M
        assert np.array_equal(direct, np.asarray(matmul_f32_packed(x, p.panels))[:M]), M
    assert F32_NATIVE_ROWS[0] <= 9 <= F32_NATIVE_ROWS[1]
    with pytest.raises(ValueError, match="panels"):
        matmul_f32_packed(x[:, :K - 1], p.panels)
    assert isinstance(p, PackedF32)


@pytest.mark.parametrize("K,N", [(576, 3072), (256, 768), (70, 192)])
def test_bf16_exact_weights_pack_as_bf16_panels_with_the_f32_products_bits(K, N):
    """A matrix whose f32 weights are every one exactly a bf16 value (a bf16 checkpoint loaded as f32) packs as bf16
    panels -- half the bytes -- and `linear` and the packed product give exactly the f32 panels' and the plain matrix's
    bits for every row count; one weight that is not a bf16 value keeps the f32 panels."""
    from pallas_kernels.linear import bf16_exact
    from pallas_kernels.native.matmul import matmul_f32, matmul_f32_packed

    rng = np.random.default_rng(K + 7 * N)
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    p = pack_f32(w)
    assert bf16_exact(w) and p.panels.dtype == jnp.bfloat16 and p.dtype == jnp.float32
    assert p.nbytes * 2 == w.nbytes and p.shape == (K, N)
    np.testing.assert_array_equal(np.asarray(unpack_f32(p)), np.asarray(w))
    f32_panels = p.panels.astype(jnp.float32)
    x = jnp.asarray(rng.standard_normal((70, K)), jnp.float32)
    for M in (1, 2, 5, 9, 33, 64, 65):
        direct = np.asarray(matmul_f32_packed(x[:M], p.panels))
        assert np.array_equal(direct.view(np.uint32), np.asarray(matmul_f32_packed(x[:M], f32_panels)).view(np.uint32))
        assert np.array_equal(direct.view(np.uint32), np.asarray(matmul_f32(x[:M], w)).view(np.uint32)), M
        assert np.array_equal(np.asarray(pallas_kernels.linear(x[:M], p)), np.asarray(pallas_kernels.linear(x[:M], w)))
    off = w.at[K // 2, N // 3].add(w[K // 2, N // 3] * 2.0 ** -12)  # a bit below bf16's precision
    assert not bf16_exact(off) and pack_f32(off).panels.dtype == jnp.float32
    assert jax.jit(lambda a: pack_f32(a).panels)(w).dtype == jnp.float32  # traced: values unknown, f32 panels


@pytest.mark.parametrize("K,N", [(576, 960), (576, 3072), (1536, 576), (300, 128)])
def test_packed_int8_codes_give_the_int8_weights_bits_for_any_number_of_rows(K, N):
    """`linear` on a `PackedInt8` equals `linear` on its `Int8Weight` bit for bit (the same chains: one over all of k),
    one row included; a row's bits do not depend on the other rows."""
    rng = np.random.default_rng(K * N)
    q = quantize_int8(jnp.asarray(rng.standard_normal((K, N)), jnp.float32))
    p = pack_int8(q)
    assert isinstance(p, PackedInt8) and p.shape == (K, N) and p.nbytes == q.nbytes
    np.testing.assert_array_equal(np.asarray(unpack_int8(p).codes), np.asarray(q.codes))
    x = jnp.asarray(rng.standard_normal((70, K)), jnp.float32)
    whole = np.asarray(pallas_kernels.linear(x, p))
    for M in (1, 2, 9, 33, 70):
        a = np.asarray(pallas_kernels.linear(x[:M], p))
        assert np.array_equal(a, np.asarray(pallas_kernels.linear(x[:M], q))), M
        assert np.array_equal(a, whole[:M]), M
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_int8(quantize_int8(jnp.ones((4, 100), jnp.float32)))
