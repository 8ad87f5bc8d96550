"""The decode loop that keeps the prompt's cache out of its carry (`kvjax.cache.chunked`) computes what the loop that
carries the whole cache computes, and leaves the same cache behind; capacity buckets stay tight."""

import dataclasses

import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.cache.capacity import CAPACITY_BUCKETS, pick_capacity
from kvjax.decode import steps


def _run(m, family, ids, n):
    last, cache = steps.prefill(m, m.family.init_cache(m.config, 1, 256, m.cache_dtype), ids)
    first = jnp.argmax(last).astype(jnp.int32)[None]
    return steps.decode(m.params, m.config, cache, first, jnp.zeros((1,), jnp.int32), num_steps=n, family=family,
                        impl=m.attention)


def test_chunked_decode_matches_the_carried_loop(hf_model_dir):
    m = kvjax.load(hf_model_dir("qwen2")[1])  # full + sliding layers: chunked and ring forms in one loop
    assert m.family.decode_split is not None
    carried = dataclasses.replace(m.family, decode_split=None)
    ids = np.arange(40) % m.config.vocab_size
    toks_a, cache_a = _run(m, m.family, ids, 12)
    toks_b, cache_b = _run(m, carried, ids, 12)
    assert (np.asarray(toks_a) == np.asarray(toks_b)).all()
    assert int(cache_a.length[0]) == int(cache_b.length[0]) == 40 + 12
    for la, lb in zip(cache_a.layers, cache_b.layers):
        assert type(la) is type(lb)
        rows = slice(0, 52) if la.k.shape[2] == 256 else slice(None)
        np.testing.assert_allclose(np.asarray(la.k[:, :, rows]), np.asarray(lb.k[:, :, rows]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(la.v[:, :, rows]), np.asarray(lb.v[:, :, rows]), rtol=1e-5, atol=1e-6)


def test_capacity_buckets_are_tight_and_block_aligned():
    assert list(CAPACITY_BUCKETS) == sorted(set(CAPACITY_BUCKETS))
    assert all(b % 1024 == 0 for b in CAPACITY_BUCKETS if b >= 4096)
    for n in (8193, 20000, 32768 + 300, 100000):
        assert pick_capacity(n) <= n * 1.125 + 1024
    assert pick_capacity(32768 + 256 + 34) == 36864  # a 32K prompt no longer gets 65,536 slots
