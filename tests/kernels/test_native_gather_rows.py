"""`pallas_kernels.native.gather_rows`: a cache's rows gathered as f32 or bf16 in one native pass, the bits of
`gather_tokens(x, pos).astype(dtype)` (XLA's round-to-nearest-even conversion included: ties, infinities, NaNs,
values that round up to infinity), and the path `sparse_part` takes for an f32 cache on the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache.draft import SparseKV
from kvjax.compress.base import gather_blocks, gather_tokens, sparse_part
from pallas_kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels do not build here")


def _cache(seed=0, B=2, K=3, S=300, D=40):
    x = np.random.default_rng(seed).standard_normal((B, K, S, D)).astype(np.float32)
    bits = x.view(np.uint32)
    bits[0, 0, 5, :8] = (bits[0, 0, 5, :8] & 0xFFFF0000) | 0x8000  # exactly halfway: ties to even
    x[0, 0, 6, :6] = [np.inf, -np.inf, np.nan, -np.nan, 3.3961e38, -0.0]  # 3.3961e38 rounds up to inf in bf16
    bits[0, 0, 6, 6] = 0x7F800001  # a signalling NaN: quiet in bf16
    x[1, 2, 17] = 0.0
    return jnp.asarray(x)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gathered_rows_are_the_jnp_gathers_bits(per_head, dtype):
    x = _cache()
    rng = np.random.default_rng(1)
    shape = (2, 3, 96) if per_head else (2, 96)
    pos = np.where(rng.random(shape) < 0.8, rng.integers(0, 300, shape), -1)
    pos[(0, 0, 0) if per_head else (0, 0)] = 5
    pos[(0, 0, 1) if per_head else (0, 1)] = 6
    pos = jnp.asarray(pos, jnp.int32)
    got = np.asarray(jax.jit(lambda x, p: native.gather_rows(x, p, dtype))(x, pos))
    want = np.asarray(jax.jit(lambda x, p: gather_tokens(x, p).astype(dtype))(x, pos))
    assert got.dtype == want.dtype and got.shape == want.shape == (2, 3, 96, 40)
    u = np.uint16 if dtype == jnp.bfloat16 else np.uint32
    nan = np.isnan(want.astype(np.float32))
    assert nan.sum() >= 2 and np.array_equal(np.isnan(got.astype(np.float32)), nan)
    assert np.array_equal(got.view(u)[~nan], want.view(u)[~nan])  # every other value bit for bit, -0.0 included
    if dtype == jnp.bfloat16:  # NaNs come out quiet, with their sign, as XLA's conversion makes them
        assert np.array_equal(got.view(u)[nan], want.view(u)[nan])
    empty = np.broadcast_to((np.asarray(pos) < 0)[..., None] if per_head else (np.asarray(pos) < 0)[:, None, :, None],
                            got.shape)
    assert (got.astype(np.float32)[empty] == 0).all()


def test_sparse_part_takes_the_native_gather_with_the_blocks_bits():
    x = _cache(seed=2, S=256, D=32)
    form = type("Form", (), dict(k=x, v=-x))()
    blocks = np.asarray([[0, 3, 7, 15], [1, 2, 9, -1], [4, 5, 6, 8]])  # per head; -1: an unused run
    pos = np.where(blocks[..., None] >= 0, blocks[..., None] * 16 + np.arange(16), -1).reshape(1, 3, 64)
    pos = jnp.asarray(np.concatenate([pos, pos[:, :, ::-1]], axis=0), jnp.int32)  # B = 2
    for dtype in ("float32", "bfloat16"):
        part = jax.jit(lambda p, dtype=dtype: sparse_part(form, p, dtype))(pos)
        assert isinstance(part, SparseKV) and part.k.dtype == jnp.dtype(dtype)
        ref = jax.jit(lambda p, dtype=dtype: gather_tokens(x, p).astype(dtype))(pos)
        assert np.array_equal(np.asarray(part.k, np.float32), np.asarray(ref, np.float32), equal_nan=True)
        blocks_part = jax.jit(lambda p, dtype=dtype: sparse_part(form, p, dtype,
                                                                 gather=lambda a, q: gather_blocks(a, q, 16)))
        assert native.GATHER_ROWS_TARGET in blocks_part.lower(pos).as_text()


def test_bad_gathers_are_refused_with_one_line():
    x = _cache(S=20, D=8)
    with pytest.raises(ValueError, match="pos must be"):
        native.gather_rows(x, jnp.zeros((3, 4), jnp.int32), jnp.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native.gather_rows(x, jnp.zeros((2, 4), jnp.int32), jnp.int8)
    with pytest.raises(ValueError, match="x must be f32"):
        native.gather_rows(x.astype(jnp.bfloat16), jnp.zeros((2, 4), jnp.int32), jnp.float32)
