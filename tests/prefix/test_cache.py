"""Prefix-cache hits give the same output as a cold run (Llama family: full + sliding layers), compile once, and
plan exactly what they restore."""

import numpy as np
import pytest

from kvjax.api import generate
from kvjax.prefix.layouts import llama as layout
from kvjax.prefix import tiers
from kvjax.models.llama.cache import init_cache
from kvjax.families import forms_for
from kvjax.prefix.manager import PrefixCache
from kvjax.errors import StaleLease
from kvjax.prefix.prefill import generate_with_prefix_cache, model_namespace, prefill_with_prefix_cache
from builders import toy_config, toy_model
from kvjax.models.layer_types import FULL, SLIDING
from kvjax.decode import steps

P, CHUNK, CAP = 16, 32, 256


@pytest.fixture(scope="module", params=["mixed", "dense"])
def model(request):
    types = (FULL, SLIDING, FULL) if request.param == "mixed" else (FULL, FULL)
    return toy_model(toy_config(types, window=20))


def new_cache(model, **kw):
    return PrefixCache(forms_for(model.config, np.float32, P), device_bytes=kw.pop("device_bytes", 1 << 20),
                       host_bytes=kw.pop("host_bytes", 1 << 20), **kw)


def cold(model, prompt):
    cache = init_cache(model.config, 1, CAP)
    logits, _ = steps.prefill(model, cache, prompt, chunk=CHUNK)
    return np.asarray(logits)


def cached(model, pc, prompt):
    logits, _, plan = prefill_with_prefix_cache(model, prompt, pc, capacity=CAP, chunk=CHUNK)
    return np.asarray(logits), plan


def test_hit_equals_cold_sweep_around_block_boundaries(model):
    rng = np.random.default_rng(1)
    base = rng.integers(0, 97, 112).astype(np.int32)
    pc = new_cache(model)
    cached(model, pc, base)
    sliding = SLIDING in model.config.layer_types
    for shared in [15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 95, 96, 97, 111, 112]:
        tail = rng.integers(0, 97, max(1, 120 - shared))
        if shared < base.size:
            tail[0] = (base[shared] + 1) % 97  # the prompt diverges from the cached one exactly at `shared`
        prompt = np.concatenate([base[:shared], tail]).astype(np.int32)
        got, plan = cached(model, pc, prompt)
        want = cold(model, prompt)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5, err_msg=f"shared={shared}")
        assert int(np.argmax(got)) == int(np.argmax(want))
        full_blocks = (shared // P) * P
        if sliding:  # snapshots exist at chunk ends and at the last full block of every inserted prompt
            assert plan.boundary <= full_blocks and plan.boundary % P == 0
        else:
            assert plan.boundary == full_blocks
        if shared % P and shared < base.size:
            assert any(f"token divergence at index {shared}" in r for r in plan.reasons()), plan.reasons()


def test_generate_with_prefix_cache_equals_generate(model):
    rng = np.random.default_rng(2)
    pc = new_cache(model)
    system = rng.integers(0, 97, 70)
    for q in range(3):
        prompt = np.concatenate([system, rng.integers(0, 97, 9 + 5 * q)])
        want = generate(model, prompt, 12)
        got, plan = generate_with_prefix_cache(model, prompt, 12, pc, return_plan=True)
        np.testing.assert_array_equal(got, want)
        if q:
            assert plan.boundary >= 32, plan.summary()


def test_exact_whole_prompt_hit_recomputes_last_token(model):
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 97, 96).astype(np.int32)  # a whole number of blocks
    pc = new_cache(model)
    first, _ = cached(model, pc, prompt)
    again, plan = cached(model, pc, prompt)
    np.testing.assert_allclose(again, first, atol=2e-5, rtol=0)
    assert plan.matched == 96 and plan.boundary < 96
    assert any("last token" in r for r in plan.reasons())
    if SLIDING not in model.config.layer_types:
        assert plan.boundary == 95  # a 1-token recompute tail
    np.testing.assert_allclose(again, cold(model, prompt), atol=2e-5, rtol=0)


def test_prompt_logprobs_bypass(model):
    pc = new_cache(model)
    prompt = np.arange(60, dtype=np.int32) % 97
    cached(model, pc, prompt)
    plan = pc.lookup(model_namespace(model, pc), prompt, prompt_logprobs=True)
    plan.lease.release()
    assert plan.boundary == 0 and "bypass" in plan.reasons()[0]


def test_hits_of_any_length_compile_nothing_after_warmup(model):
    rng = np.random.default_rng(4)
    pc = new_cache(model)
    base = rng.integers(0, 97, 120).astype(np.int32)
    cached(model, pc, base)
    cached(model, pc, base[:70])  # warm: a hit + a partial chunk
    fns = [steps.prefill_chunk, layout._restore, layout._dense_blocks, layout._swa_snapshot, tiers._pool_put,
           tiers._pool_gather, tiers.take_one]
    before = [f._cache_size() for f in fns]
    for n in [17, 33, 48, 64, 81, 100, 119]:
        prompt = np.concatenate([base[:n], rng.integers(0, 97, 7)]).astype(np.int32)
        cached(model, pc, prompt)
    assert [f._cache_size() for f in fns] == before


def test_lease_is_checked_at_use(model):
    pc = new_cache(model)
    prompt = np.arange(80, dtype=np.int32) % 97
    cached(model, pc, prompt)
    ns = model_namespace(model, pc)
    plan = pc.lookup(ns, prompt)
    assert plan.boundary > 0
    plan.lease.release()
    with pytest.raises(StaleLease):
        pc.execute(plan, init_cache(model.config, 1, CAP))
    # pinned entries are never evicted
    plan = pc.lookup(ns, prompt)
    for spec in pc.forms.specs:
        pc.evict(spec.name, "device", 10_000)
    assert plan.lease.valid()
    got, plan2 = pc.execute(plan, init_cache(model.config, 1, CAP))
    plan.lease.release()
    assert plan2 is plan and int(got.length[0]) == plan.boundary
