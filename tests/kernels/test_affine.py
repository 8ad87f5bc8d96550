"""Block-affine codes (`pallas_kernels.affine`): GGUF-quantised f32 weights found as their codes and reproduced bit for
bit, anything else refused, and the native product on the codes giving the f32 matrix's bits for every row count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import native
from pallas_kernels.affine import PackedAffine, pack_affine, unpack_affine
from pallas_kernels.linear import pack_f32

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

from builders import gguf_weights  # noqa: E402


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype,lo,hi", [(Q.Q4_1, 0, 15), (Q.Q8_0, -127, 127), (Q.Q4_0, -8, 7), (Q.Q5_1, 0, 31),
                                         (Q.Q5_0, -16, 31)])
def test_gguf_codes_are_found_and_reproduce_every_weight(qtype, lo, hi):
    w = gguf_weights(576, 192, qtype)
    p = pack_affine(w)
    assert isinstance(p, PackedAffine) and p.shape == (576, 192)
    nibbles = qtype in (Q.Q4_1, Q.Q4_0)  # 4-bit codes, two per byte: Q4_1's unsigned 0..15, Q4_0's signed -8..7
    assert p.bits == (4 if nibbles else 8) and p.q.shape == (3, 576, 32 if nibbles else 64)
    assert p.q.dtype == (jnp.uint8 if qtype == Q.Q4_1 else jnp.int8)
    assert p.d.shape == p.m.shape == (3, 18, 64) and p.nbytes < w.nbytes / (5 if nibbles else 3)
    np.testing.assert_array_equal(_bits(unpack_affine(p)), _bits(w))
    q = np.asarray(p.q).astype(np.int32)
    if nibbles:  # the bytes' low nibbles then their high ones (int8 bytes: sign-extended, so signed nibbles)
        q = np.concatenate([(q << 28) >> 28 if qtype == Q.Q4_0 else q & 15, q >> 4], axis=2)
    assert lo <= q.min() and q.max() <= hi


def test_anything_but_exact_codes_is_refused():
    rng = np.random.default_rng(1)
    assert pack_affine(rng.standard_normal((64, 64)).astype(np.float32)) is None  # a trained model's weights
    w = gguf_weights(64, 64, Q.Q4_1)
    w[17, 3] = np.nextafter(w[17, 3], np.float32(1))  # one weight one ulp off its code
    assert pack_affine(w) is None
    w = gguf_weights(64, 64, Q.Q4_1)
    w[0, 0] = np.nan
    assert pack_affine(w) is None
    assert pack_affine(gguf_weights(64, 64, Q.Q4_1)[:, :32]) is None  # N not a multiple of 64
    assert pack_affine(gguf_weights(64, 64, Q.Q4_1)[:48]) is None  # K not a multiple of 32
    assert pack_affine(jnp.asarray(gguf_weights(64, 64, Q.Q4_1), jnp.bfloat16)) is None
    traced = jax.jit(lambda a: jnp.zeros(()) if pack_affine(a) is None else jnp.ones(()))
    assert float(traced(jnp.asarray(gguf_weights(64, 64, Q.Q4_1)))) == 0.0  # a tracer's values are unknown


def test_signed_zeros_survive():
    w = gguf_weights(64, 64, Q.Q8_0)
    w[:32, 0] = -0.0  # a whole block of -0 (d * q with d > 0, q = 0 gives +0; these stay -0 or refuse)
    p = pack_affine(w)
    if p is not None:
        np.testing.assert_array_equal(_bits(unpack_affine(p)), _bits(w))


@pytest.mark.skipif(not native.available(), reason="the native library did not build here")
@pytest.mark.parametrize("K,N,qtype", [(576, 960, Q.Q4_1), (1536, 576, Q.Q4_1), (576, 1024, Q.Q8_0),
                                       (64, 128, Q.Q4_0), (96, 192, Q.Q5_0)])
def test_the_codes_product_gives_the_f32_matrixs_bits_for_any_number_of_rows(K, N, qtype):
    """`linear` on a `PackedAffine` equals `linear` on the f32 matrix and the native product on its f32 panels, bit for
    bit, at every row count (the native tiles' 1-64 and XLA's dot beyond); a row's bits do not depend on the others."""
    from pallas_kernels.native.matmul import matmul_affine_packed, matmul_f32_packed

    w = gguf_weights(K, N, qtype, seed=K + N)
    p, f = pack_affine(w), pack_f32(jnp.asarray(w))
    x = jnp.asarray(np.random.default_rng(K).standard_normal((130, K)), jnp.float32)
    whole = np.asarray(matmul_affine_packed(x[:64], p.q, p.d, p.m))
    for M in (1, 2, 5, 9, 33, 64, 65, 130):
        got = np.asarray(pallas_kernels.linear(x[:M], p))
        assert np.array_equal(_bits(got), _bits(pallas_kernels.linear(x[:M], jnp.asarray(w)))), M
        if M <= 64:
            assert np.array_equal(_bits(got), _bits(matmul_f32_packed(x[:M], f.panels))), M
            assert np.array_equal(_bits(got), _bits(whole[:M])), M
    with pytest.raises(ValueError, match="d, m"):
        matmul_affine_packed(x[:1], p.q, p.d[:, :-1], p.m)


@pytest.mark.slow  # compiles the library a second time (~15 s)
@pytest.mark.skipif(not native.available(), reason="the native library did not build here")
def test_scalar_build_reads_the_codes_as_the_vector_build_does(tmp_path):
    """The portable build (scalar loop, std::fma) gives the vector build's bits on 8-bit and 4-bit codes."""
    from builders import vector_and_scalar

    both = vector_and_scalar(tmp_path, "KvjaxMatmulAffinePacked", native.MATMUL_AFFINE_PACKED_TARGET)
    for K, N, qtype in [(576, 192, Q.Q4_1), (96, 128, Q.Q8_0), (64, 128, Q.Q4_0)]:
        p = pack_affine(gguf_weights(K, N, qtype))
        for M in (1, 7, 33):
            x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.float32)
            a, b = both(jax.ShapeDtypeStruct((M, N), jnp.float32), x, p.q, p.d, p.m)
            assert np.array_equal(_bits(a), _bits(b)), (qtype, M)
