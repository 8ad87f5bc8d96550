"""The integer-dot draft product with int8 codes (`pallas_kernels.int_dot.IntDot8`): a float model's int8 draft codes
rearranged without loss, the native kernel equal to the jnp definition up to f32 rounding for any row count, both
within the rows' int16 quantisation of the int8 codes' exact product, and bad shapes refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native
from pallas_kernels.int_dot import IntDot8, int_dot8_codes, int_dot8_reference, unpack_int_dot8
from pallas_kernels.linear import dequantize_int8, quantize_int8
from builders import check_int_dot_product


def _codes(K, N, seed=0):
    w = np.random.default_rng(seed).standard_normal((K, N)).astype(np.float32) * 0.05
    q = quantize_int8(jnp.asarray(w))
    return q, int_dot8_codes(q.codes, q.scale)


def test_int8_codes_are_rearranged_without_loss():
    q, c = _codes(96, 192)
    assert isinstance(c, IntDot8) and c.shape == (96, 192) and c.q.shape == (3, 48, 128) and c.q.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(unpack_int_dot8(c)), np.asarray(q.codes))
    np.testing.assert_array_equal(np.asarray(c.scale), np.asarray(q.scale))
    # byte 32s + 2i + j of pair g of panel p is column 64p + 16s + i at k = 2g + j
    codes = np.asarray(q.codes)
    assert np.asarray(c.q)[1, 5, 32 * 2 + 2 * 3 + 1] == codes[2 * 5 + 1, 64 + 16 * 2 + 3]
    leaves = jax.tree_util.tree_leaves(c)  # a pytree of its two arrays
    assert len(leaves) == 2 and c.nbytes == sum(a.nbytes for a in leaves)


def test_only_shapes_of_whole_blocks_and_panels_are_taken():
    q, _ = _codes(48, 64)  # K not a multiple of 32
    assert int_dot8_codes(q.codes, q.scale) is None
    q, _ = _codes(64, 96)  # N not a multiple of 64
    assert int_dot8_codes(q.codes, q.scale) is None
    assert int_dot8_codes(np.ones((64, 64), np.float32), np.ones(64, np.float32)) is None  # not int8 codes


def test_reference_is_the_codes_product_within_the_rows_quantisation():
    q, c = _codes(256, 128, seed=3)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 256)), jnp.float32)
    exact = np.asarray(x) @ np.asarray(dequantize_int8(q))
    got = np.asarray(int_dot8_reference(x, c))
    assert np.abs(got - exact).max() < 1e-4 * np.abs(exact).max()  # int16 rows: ~1e-5 of the block's largest
    assert np.abs(got - exact).max() > 0  # and not the exact product: it is a draft's
    np.testing.assert_array_equal(np.asarray(int_dot8_reference(jnp.zeros((1, 256), jnp.float32), c)), 0)


@pytest.mark.skipif(not native.available(), reason="the native library did not build here")
# N = 2560: 40 panels, several consecutive ones per unit of work on a machine of few threads
@pytest.mark.parametrize("K,N", [(256, 512), (768, 256), (64, 2560)])
def test_native_kernel_matches_its_definition_for_any_number_of_rows(K, N):
    from pallas_kernels.native.matmul import matmul_int_dot8

    _, c = _codes(K, N, seed=K)
    check_int_dot_product(c, lambda x: matmul_int_dot8(x, c.q, c.scale), lambda x: int_dot8_reference(x, c), seed=N)


@pytest.mark.skipif(not native.available(), reason="the native library did not build here")
def test_bad_shapes_are_refused_with_a_reason():
    from pallas_kernels.native.matmul import matmul_int_dot8

    _, c = _codes(64, 64)
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"q int8 \[P, K / 2, 128\]"):
        matmul_int_dot8(jnp.ones((1, 32), jnp.float32), c.q, c.scale)
    with pytest.raises(ValueError, match=r"scale \[64\]"):
        matmul_int_dot8(x, c.q, c.scale[:32])
    with pytest.raises(ValueError, match="int8"):
        matmul_int_dot8(x, c.q.astype(jnp.uint8), c.scale)


@pytest.mark.slow  # compiles the library a second time (~15 s)
@pytest.mark.skipif(not native.available(), reason="the native library did not build here")
def test_scalar_build_gives_the_vector_builds_bits(tmp_path):
    """The portable build (integer sums one product at a time, the same f32 epilogue) agrees bit for bit."""
    from builders import vector_and_scalar

    both = vector_and_scalar(tmp_path, "KvjaxMatmulIntDot8", native.MATMUL_INT_DOT8_TARGET)
    for K, N in [(256, 192), (64, 128)]:
        _, c = _codes(K, N)
        for M in (1, 5):
            x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.float32)
            np.testing.assert_array_equal(*both(jax.ShapeDtypeStruct((M, N), jnp.float32), x, c.q, c.scale))
