"""The native argmax (`pallas_kernels.argmax`, `native/argmax.cc`) gives jnp.argmax's indices -- each row's first
maximum, or its first NaN -- for every row shape the sampler hands it, and greedy selection takes it on the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import scalar_native_library

from kvjax.decode import sampling
from pallas_kernels import native
from pallas_kernels.argmax import argmax

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernel does not build here")


def _rows():
    """Rows where a wrong index would show: random ones (a vocabulary's width and ragged ones), ties (first one wins),
    all equal, all -inf, NaNs first / inside / last, +0 against -0."""
    rng = np.random.default_rng(0)
    out = [rng.standard_normal((9, 49152)), rng.standard_normal((3, 17)), rng.standard_normal((2, 5, 33)),
           rng.integers(0, 3, (6, 1000)), np.zeros((2, 40)), np.full((1, 33), -np.inf), rng.standard_normal((1, 1))]
    nan = rng.standard_normal((5, 100))
    nan[0, 50] = np.nan
    nan[1, 0] = np.nan
    nan[2, 99] = np.nan
    nan[3, [3, 70]] = 9.0  # a tie at the maximum
    nan[4, [20, 21]] = np.nan
    out.append(nan)
    zeros = np.full((1, 20), -1.0)
    zeros[0, 7], zeros[0, 3] = 0.0, -0.0
    out.append(zeros)
    return [jnp.asarray(x, jnp.float32) for x in out]


@pytest.mark.parametrize("i", range(9))
def test_native_argmax_equals_jnp_argmax(i):
    x = _rows()[i]
    got = jax.jit(argmax)(x)
    assert got.dtype == jnp.int32 and got.shape == x.shape[:-1]
    assert np.array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))


def test_under_vmap_and_in_greedy_selection():
    """vmapped rows give the same indices; greedy `select_tokens` compiles to the native call on the CPU."""
    x = _rows()[0].reshape(3, 3, 49152)
    assert np.array_equal(np.asarray(jax.jit(jax.vmap(argmax))(x)), np.asarray(jnp.argmax(x, axis=-1)))
    pos = jnp.zeros((3, 3), jnp.int32)
    seed = jnp.zeros((3,), jnp.int32)
    hlo = jax.jit(lambda lg: sampling.select_tokens(lg, pos, seed, 0.0)).lower(x).as_text()
    assert native.ARGMAX_TARGET in hlo
    assert np.array_equal(np.asarray(sampling.select_tokens(x, pos, seed, 0.0)), np.asarray(jnp.argmax(x, axis=-1)))


@pytest.mark.slow  # compiles the library a second time (~15 s; shared with the other scalar-build tests of the run)
def test_scalar_build_equals_the_vector_build(tmp_path):
    handle = scalar_native_library(tmp_path)
    jax.ffi.register_ffi_target("kvjax_argmax_scalar", jax.ffi.pycapsule(handle.KvjaxArgmax), platform="cpu")
    for x in _rows():
        out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32)
        assert np.array_equal(np.asarray(jax.ffi.ffi_call("kvjax_argmax_scalar", out)(x)), np.asarray(argmax(x)))
