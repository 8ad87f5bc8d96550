"""`kvjax.decode.offload.fetch`: a fetch into reused buffers gives the host arrays' values in those buffers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.decode import offload as offl


def _tree(seed: int):
    rng = np.random.default_rng(seed)
    return ((jnp.asarray(rng.standard_normal((1, 2, 64, 8), np.float32)),
             jnp.asarray(rng.standard_normal((1, 2, 64, 8), np.float32))), None,
            (jnp.asarray(rng.standard_normal((1, 2, 64, 8), np.float32)).astype(jnp.bfloat16),
             jnp.asarray(rng.standard_normal((1, 2, 64, 8), np.float32))))


def _equal(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_fetch_into_reuses_the_buffers_on_cpu():
    host = offl.to_host(_tree(0))
    into = offl.fetch(offl.to_host(_tree(1)))  # a previous fetch's buffers, other values
    if jax.devices()[0].platform != "cpu":
        pytest.skip("buffer reuse is the CPU path; elsewhere `into` is dropped")
    ptrs = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(into)]
    got = offl.fetch(host, into=into)
    assert _equal(got, _tree(0))
    assert [a.unsafe_buffer_pointer() for a in jax.tree.leaves(got)] == ptrs  # written in place, nothing allocated
    assert all(a.is_deleted() for a in jax.tree.leaves(into))  # donated: the caller may not use them again


def test_fetch_into_mismatched_buffers_falls_back():
    host = offl.to_host(_tree(0))
    other = jax.tree.map(lambda a: jnp.zeros(a.shape[:2] + (a.shape[2] + 1,) + a.shape[3:], a.dtype), _tree(1))
    assert _equal(offl.fetch(host, into=other), _tree(0))
    assert _equal(offl.fetch(host, into=offl.fetch(host)[:1]), _tree(0))  # another tree
    assert _equal(offl.fetch(host), _tree(0))
