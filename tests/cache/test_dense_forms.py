"""Cache forms: masked writes, ring semantics, padding never corrupts state."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from kvjax.cache.dense import DenseKV, WindowKV


def _kv(B, T, K=2, D=4, base=0):
    x = (base + jnp.arange(B * T, dtype=jnp.float32)).reshape(B, T, 1, 1)
    return jnp.broadcast_to(x, (B, T, K, D))


# jitted, and the checks read numpy copies: each example compiles its shapes, and op by op every op (and every
# distinct index read) compiled a program of its own (CI time)
_write = jax.jit(lambda ring, k, v, n: ring.write(k, v, n))
_slot_positions = jax.jit(lambda ring: ring.slot_positions())


@settings(max_examples=20, deadline=None)  # each example compiles its shapes: CI time
@given(W=st.integers(1, 9), chunks=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12)), min_size=1,
                                            max_size=6))
def test_ring_holds_exactly_the_last_window(W, chunks):
    zeros = jnp.asarray(np.zeros((1, 2, W, 4), np.float32))
    ring = WindowKV(k=zeros, v=zeros, seen=jnp.asarray(np.zeros((1,), np.int32)), window=W)
    written = []
    for T, n in chunks:
        n = min(n, T)
        vals = np.broadcast_to((np.float32(len(written) * 1000.0 + 7) + np.arange(T, dtype=np.float32))
                               .reshape(1, T, 1, 1), (1, T, 2, 4))  # `_kv(1, T, base=...)`, made in numpy
        ring = _write(ring, jnp.asarray(vals), jnp.asarray(vals), jnp.asarray([n], jnp.int32))
        written += [float(vals[0, t, 0, 0]) for t in range(n)]
    assert int(ring.seen[0]) == len(written)
    pos = np.asarray(_slot_positions(ring)[0])
    k = np.asarray(ring.k)
    for j in range(W):
        if pos[j] < 0:
            assert len(written) <= j or len(written) < W
            continue
        assert pos[j] % W == j and len(written) - W <= pos[j] < len(written)
        assert float(k[0, 0, j, 0]) == written[pos[j]]


def test_dense_write_drops_padding_and_respects_lengths():
    z = jnp.zeros((2, 2, 8, 4))
    c = DenseKV(k=z, v=z, length=jnp.asarray([0, 5], jnp.int32))
    new = _kv(2, 4, base=1)
    c2 = c.write(new, new, jnp.asarray([4, 2], jnp.int32))
    assert list(np.asarray(c2.length)) == [4, 7]
    np.testing.assert_array_equal(np.asarray(c2.k[0, 0, :4, 0]), [1, 2, 3, 4])
    np.testing.assert_array_equal(np.asarray(c2.k[1, 0, 5:7, 0]), [5, 6])
    assert float(c2.k[1, 0, 7, 0]) == 0.0  # padding row 2 of batch 1 dropped
    # writes past capacity are dropped, never clamped onto valid slots
    c3 = DenseKV(k=z, v=z, length=jnp.asarray([7, 7], jnp.int32)).write(new, new, jnp.asarray([4, 4], jnp.int32))
    np.testing.assert_array_equal(np.asarray(c3.k[0, 0, :7, 0]), np.zeros(7))
    assert list(np.asarray(c2.key_positions()[1])) == [0, 1, 2, 3, 4, 5, 6, -1]
