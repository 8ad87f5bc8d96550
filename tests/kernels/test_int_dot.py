"""The integer-dot draft product (`pallas_kernels.int_dot`): GGUF 4-bit codes rearranged without loss, the native
kernel equal to the jnp definition up to f32 rounding for any row count, both within the rows' int16 quantisation of the
exact product, and bad shapes refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import native
from pallas_kernels.affine import pack_affine, unpack_affine
from pallas_kernels.int_dot import IntDotCodes, int_dot_codes, int_dot_reference, requantize_4bit, unpack_codes

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

from builders import check_int_dot_product, gguf_weights  # noqa: E402


def _weights(w: IntDotCodes) -> np.ndarray:
    """The f32 matrix an `IntDotCodes` stands for: code * d + m per block."""
    K, N = w.shape

    def per_k(a):  # [P, K / 32, 64] per block -> [K, N] per weight
        return np.repeat(np.asarray(a, np.float32).transpose(1, 0, 2).reshape(K // 32, N), 32, axis=0)

    return np.asarray(unpack_codes(w), np.float32) * per_k(w.d) + per_k(w.m)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0])
def test_four_bit_codes_are_rearranged_without_loss(qtype):
    w = gguf_weights(576, 192, qtype)
    p = pack_affine(w)
    c = int_dot_codes(p)
    assert isinstance(c, IntDotCodes) and c.shape == (576, 192)
    assert c.q.shape == (3, 288, 64) and c.q.dtype == jnp.uint8 and c.d.dtype == c.m.dtype == jnp.float16
    codes = np.asarray(unpack_codes(c))
    assert codes.min() >= 0 and codes.max() <= 15 and codes.max() > 7  # unsigned nibbles (Q4_0's shifted by 8)
    # GGUF's d and m are f16 values, so the rearranged codes stand for the same weights (Q4_0's m - 8d exact too)
    np.testing.assert_allclose(_weights(c), w, rtol=0, atol=1e-7)
    if qtype == Q.Q4_1:
        np.testing.assert_array_equal(_weights(c), np.asarray(unpack_affine(p)))


def test_only_four_bit_codes_are_taken():
    assert int_dot_codes(pack_affine(gguf_weights(64, 64, Q.Q8_0))) is None  # one byte per code
    assert int_dot_codes(jnp.ones((64, 64), jnp.float32)) is None
    assert int_dot_codes(None) is None


def test_reference_is_the_exact_product_within_the_rows_quantisation():
    w = gguf_weights(576, 128, Q.Q4_1, seed=3)
    c = int_dot_codes(pack_affine(w))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 576)), jnp.float32)
    exact = np.asarray(x) @ w
    got = np.asarray(int_dot_reference(x, c))
    assert np.abs(got - exact).max() < 1e-4 * np.abs(exact).max()  # int16 rows: ~1e-5 of the block's largest
    assert np.abs(got - exact).max() > 0  # and not the exact product: it is a draft's
    zero = jnp.zeros((1, 576), jnp.float32)  # an all-zero row (scale 0) gives exactly 0
    np.testing.assert_array_equal(np.asarray(int_dot_reference(zero, c)), 0)


@pytest.mark.skipif(not native.available(), reason="the native library did not build here")
# N = 2560: 40 panels, several consecutive ones per unit of work on a machine of few threads (8 each on two)
@pytest.mark.parametrize("K,N,qtype", [(576, 960, Q.Q4_1), (1536, 576, Q.Q4_1), (64, 2560, Q.Q4_0)])
def test_native_kernel_matches_its_definition_for_any_number_of_rows(K, N, qtype):
    from pallas_kernels.native.matmul import matmul_int_dot

    c = int_dot_codes(pack_affine(gguf_weights(K, N, qtype, seed=K)))
    check_int_dot_product(c, lambda x: matmul_int_dot(x, c.q, c.d, c.m), lambda x: int_dot_reference(x, c), seed=N)


@pytest.mark.skipif(not native.available(), reason="the native library did not build here")
def test_bad_shapes_are_refused_with_a_reason():
    from pallas_kernels.native.matmul import matmul_int_dot

    c = int_dot_codes(pack_affine(gguf_weights(64, 64, Q.Q4_1)))
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"q uint8 \[P, K / 2, 64\]"):
        matmul_int_dot(jnp.ones((1, 32), jnp.float32), c.q, c.d, c.m)
    with pytest.raises(ValueError, match="d, m"):
        matmul_int_dot(x, c.q, c.d[:, :1, :32], c.m)
    with pytest.raises(ValueError, match="uint8"):
        matmul_int_dot(x, c.q.astype(jnp.int8), c.d, c.m)


@pytest.mark.slow  # compiles the library a second time (~15 s)
@pytest.mark.skipif(not native.available(), reason="the native library did not build here")
def test_scalar_build_gives_the_vector_builds_bits(tmp_path):
    """The portable build (integer sums one product at a time, the same f32 epilogue) agrees bit for bit."""
    from builders import vector_and_scalar

    both = vector_and_scalar(tmp_path, "KvjaxMatmulIntDot", native.MATMUL_INT_DOT_TARGET)
    for K, N, qtype in [(576, 192, Q.Q4_1), (64, 128, Q.Q4_0)]:
        c = int_dot_codes(pack_affine(gguf_weights(K, N, qtype)))
        for M in (1, 5):
            x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.float32)
            np.testing.assert_array_equal(*both(jax.ShapeDtypeStruct((M, N), jnp.float32), x, c.q, c.d, c.m))


def test_int_dot_codes_are_a_pytree_of_their_arrays():
    p = pack_affine(gguf_weights(64, 64, Q.Q4_1))
    c = int_dot_codes(p)
    leaves = jax.tree_util.tree_leaves(c)
    assert len(leaves) == 3 and c.nbytes == sum(a.nbytes for a in leaves)
    assert c.nbytes < p.nbytes  # f16 scales and offsets: fewer bytes than the exact codes' f32 ones


def test_requantised_codes_are_within_half_a_step():
    """`requantize_4bit`: an f32 matrix as 4-bit codes with per-block f16 scales and offsets, each weight within half
    a step (plus the f16 rounding of the offset) of the original; a constant block is exact."""
    w = np.random.default_rng(3).normal(size=(64, 128)).astype(np.float32)
    w[:32, :64] = 0.25  # a constant block: d = 0, codes 0, m exact
    c = requantize_4bit(w)
    assert c.shape == (64, 128) and c.nbytes * 5 < w.nbytes
    got = np.asarray(unpack_codes(c), np.float32).reshape(2, 32, 128)
    d = np.asarray(c.d, np.float32).transpose(1, 0, 2).reshape(2, 128)
    m = np.asarray(c.m, np.float32).transpose(1, 0, 2).reshape(2, 128)
    back = (got * d[:, None] + m[:, None]).reshape(64, 128)
    step = np.repeat(d, 32, axis=0)
    assert np.all(np.abs(back - w) <= step / 2 + np.abs(w) * 2e-3 + 1e-6)
    np.testing.assert_array_equal(back[:32, :64], w[:32, :64])


def test_a_coarse_head_rescores_its_best_blocks_exactly():
    """`coarse_head_logits`: the blocks with the largest coarse logits carry the exact head's logits (the rows'
    products), the rest the coarse product's; with the exact argmax among them, the argmax is the exact head's."""
    from kvjax.models.llama.layers import COARSE_BLOCK, COARSE_BLOCKS, coarse_head_logits

    rng = np.random.default_rng(4)
    rows = jnp.asarray(rng.normal(size=(1024, 64)) * 0.1, jnp.float32)  # [V, H]
    h = jnp.asarray(rng.normal(size=(2, 3, 64)), jnp.float32)
    coarse = requantize_4bit(np.asarray(rows).T)
    got = np.asarray(jax.jit(coarse_head_logits)(h, coarse, rows))
    exact = np.asarray(h @ rows.T)
    approx = np.asarray(int_dot_reference(h, coarse)) if not native.available() else np.asarray(
        pallas_kernels.linear(h, coarse))
    hit = np.isclose(got, exact, rtol=1e-5, atol=1e-5)
    blocks = hit.reshape(6, -1, COARSE_BLOCK).all(-1).sum(-1)
    assert np.all(blocks >= COARSE_BLOCKS)  # the re-scored blocks (others may agree by chance, not whole blocks)
    np.testing.assert_allclose(got[~hit], approx[~hit], rtol=1e-6, atol=1e-6)
    assert np.array_equal(got.argmax(-1), exact.argmax(-1))
