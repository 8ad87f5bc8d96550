"""Prefix cache on the DeepSeek-V4 hybrid (sliding / CSA / HCA, indexer): hits equal a cold run around every block
and compression boundary, and all four stored forms are restored at the common boundary."""

import dataclasses

import numpy as np
import pytest
from builders import make_v4

import kvjax
from kvjax.prefix.layouts import deepseek_v4 as hybrid_layout
from kvjax.decode import steps
from kvjax.prefix import tiers
from kvjax.prefix.identity import make_namespace
from kvjax.families import forms_for
from kvjax.prefix.manager import PrefixCache
from kvjax.prefix.prefill import generate_with_prefix_cache, model_namespace, prefill_with_prefix_cache

P, CHUNK = 8, 16  # m = 4, m' = 8: P = lcm


@pytest.fixture(scope="module")
def v4():
    _, d = make_v4("hybrid")
    return kvjax.load(d)


def new_cache(model, **kw):
    return PrefixCache(forms_for(model.config, np.float32, P), device_bytes=1 << 22, host_bytes=1 << 22, **kw)


def test_forms_and_block_size(v4):
    forms = forms_for(v4.config, np.float32)
    assert forms.block_size % 8 == 0 and forms.block_size >= 64
    assert [s.name for s in forms.specs] == ["compressed", "indexer", "swa", "tail"]
    with pytest.raises(ValueError, match="lcm"):
        forms_for(v4.config, np.float32, 12)


def test_hit_equals_cold_around_block_and_compression_boundaries(v4):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 97, 48).astype(np.int32)
    pc = new_cache(v4)
    prefill_with_prefix_cache(v4, base, pc, capacity=256, chunk=CHUNK)
    fns = [hybrid_layout._restore, hybrid_layout._blocks, hybrid_layout._snapshot, steps.prefill_chunk,
           tiers._pool_gather, tiers._pool_put, tiers.take_one]
    before = None
    for i, shared in enumerate([3, 4, 5, 7, 8, 9, 12, 16, 17, 23, 24, 25, 31, 32, 33, 40, 47, 48]):
        if i == 8:  # warm: misses, a first hit restoring every form from the device
            before = [f._cache_size() for f in fns]
        tail = rng.integers(0, 97, max(1, 52 - shared))
        if shared < base.size:
            tail[0] = (base[shared] + 1) % 97
        prompt = np.concatenate([base[:shared], tail]).astype(np.int32)
        got, _, plan = prefill_with_prefix_cache(v4, prompt, pc, capacity=256, chunk=CHUNK)
        want = kvjax.logits(v4, prompt)[-1]
        np.testing.assert_allclose(np.asarray(got), want, atol=5e-5, rtol=0, err_msg=f"shared={shared}")
        assert plan.boundary % P == 0 and plan.boundary <= (shared // P) * P
        if plan.boundary:
            assert all(plan.forms[f].used for f in ("compressed", "indexer", "swa", "tail")), plan.summary()
    assert pc.stats()["hit_tokens"] > 0
    assert [f._cache_size() for f in fns] == before, "a hit of a new length compiled something"


def test_host_tier_hit_equals_cold(v4):
    rng = np.random.default_rng(1)
    system = rng.integers(0, 97, 40)
    pc = PrefixCache(forms_for(v4.config, np.float32, P), device_bytes=0, host_bytes=1 << 22)
    for q in range(2):
        prompt = np.concatenate([system, rng.integers(0, 97, 7 + 3 * q)]).astype(np.int32)
        got, _, plan = prefill_with_prefix_cache(v4, prompt, pc, capacity=256, chunk=CHUNK)
        np.testing.assert_allclose(np.asarray(got), kvjax.logits(v4, prompt)[-1], atol=5e-5, rtol=0)
        pc.flush()
    assert plan.boundary == 40 and plan.forms["compressed"].used == {"host": 5}
    assert plan.forms["tail"].used == {"host": 1} and plan.forms["indexer"].used == {"host": 5}


@pytest.mark.slow
def test_generate_parity(v4):
    """Greedy tokens through the prefix cache equal kvjax.generate (slow: compiles V4's decode loop)."""
    rng = np.random.default_rng(2)
    system = rng.integers(0, 97, 40)
    pc = new_cache(v4)
    for q in range(2):
        prompt = np.concatenate([system, rng.integers(0, 97, 7 + 3 * q)])
        got, plan = generate_with_prefix_cache(v4, prompt, 6, pc, return_plan=True)
        np.testing.assert_array_equal(got, kvjax.generate(v4, prompt, 6))
    assert plan.boundary == 40


def test_compression_rate_change_misses(v4):
    pc = new_cache(v4)
    prompt = np.arange(30, dtype=np.int32)
    prefill_with_prefix_cache(v4, prompt, pc, capacity=256, chunk=CHUNK)
    ns = model_namespace(v4, pc)
    other = dataclasses.replace(v4.config, hca_rate=16)
    ns2 = make_namespace(other, weights=ns.semantic["weights"], kv_dtype="float32",
                         formats=ns.representation["formats"], block_size=P)
    plan = pc.lookup(ns2, prompt)
    plan.lease.release()
    assert plan.boundary == 0 and "semantic.kv_fields" in plan.reasons()[0]
