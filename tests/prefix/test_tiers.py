"""Tiers: device -> host demotion, a TensorStore store that survives a restart, corrupt/truncated entries recomputed,
admission caps and capacity-miss reasons."""

import json
import os

import numpy as np
import pytest

from kvjax.models.llama.cache import init_cache
from kvjax.families import forms_for
from kvjax.prefix.manager import PrefixCache
from kvjax.prefix.prefill import model_namespace, prefill_with_prefix_cache
from kvjax.prefix.tiers import admission_caps
from builders import toy_config, toy_model
from kvjax.models.layer_types import FULL, SLIDING
from kvjax.decode import steps

P, CHUNK, CAP = 16, 32, 256


@pytest.fixture(scope="module")
def model():
    return toy_model(toy_config((FULL, SLIDING, FULL), window=20))


def cold(model, prompt):
    logits, _ = steps.prefill(model, init_cache(model.config, 1, CAP), prompt, chunk=CHUNK)
    return np.asarray(logits)


def run(model, pc, prompt):
    logits, _, plan = prefill_with_prefix_cache(model, prompt, pc, capacity=CAP, chunk=CHUNK)
    return np.asarray(logits), plan


PROMPT = (np.arange(100) * 13 % 97).astype(np.int32)


def test_host_tier_hit_equals_cold(model):
    pc = PrefixCache(forms_for(model.config, np.float32, P), device_bytes=1 << 20, host_bytes=1 << 20)
    run(model, pc, PROMPT)
    for spec in pc.forms.specs:
        assert pc.evict(spec.name, "device", 1000) > 0
    pc.flush()
    got, plan = run(model, pc, PROMPT)
    assert plan.boundary == 96 - 0 and plan.forms["dense"].used == {"host": 6}
    assert plan.forms["swa"].used == {"host": 1}
    np.testing.assert_allclose(got, cold(model, PROMPT), atol=2e-5, rtol=0)
    st = pc.stats()
    assert st["reused_tokens"]["dense"]["host"] == 96 and st["events"]["demoted"] >= 7
    # the hit promoted what it read back to the device
    got, plan = run(model, pc, PROMPT)
    assert plan.forms["dense"].used == {"device": 6} and plan.forms["swa"].used == {"device": 1}
    np.testing.assert_allclose(got, cold(model, PROMPT), atol=2e-5, rtol=0)


def test_evicted_is_a_capacity_miss_with_reason(model):
    pc = PrefixCache(forms_for(model.config, np.float32, P), device_bytes=1 << 20, host_bytes=0)
    run(model, pc, PROMPT)
    pc.evict("dense", "device", 1000)
    got, plan = run(model, pc, PROMPT)
    assert plan.boundary == 0
    assert any(s.kind == "capacity" and s.cause == "evicted" and s.form == "dense" for s in plan.shortfalls)
    assert pc.stats()["misses"]["capacity"]["evicted"] > 0
    np.testing.assert_allclose(got, cold(model, PROMPT), atol=2e-5, rtol=0)


def test_not_admitted_when_caps_are_zero(model):
    pc = PrefixCache(forms_for(model.config, np.float32, P), device_bytes=0, host_bytes=0)
    run(model, pc, PROMPT)
    _, plan = run(model, pc, PROMPT)
    assert plan.boundary == 0 and any(s.cause == "not admitted" for s in plan.shortfalls)


def test_allocation_is_all_or_nothing(model):
    forms = forms_for(model.config, np.float32, P)
    dense = [s for s in forms.specs if s.name == "dense"][0]
    # room for 4 dense blocks on the device: a 6-block prompt goes to the host as a whole
    pc = PrefixCache(forms, device_bytes=2 * 4 * dense.nbytes, host_bytes=2 * 64 * dense.nbytes)
    assert pc.caps["dense"]["device"] == 4
    run(model, pc, PROMPT)
    pc.flush()
    st = pc.stats()["entries"]["dense"]
    assert st["device"] == 0 and st["host"] == 6


def test_admission_caps_one_function():
    forms = forms_for(toy_config((FULL, SLIDING), window=16), np.float32, P)
    caps = admission_caps(forms.specs, {"device": 1 << 20, "host": 0})
    pc = PrefixCache(forms, device_bytes=1 << 20, host_bytes=0)
    assert pc.caps == caps and pc.pools["dense"].n == caps["dense"]["device"] and caps["swa"]["host"] == 0


def test_store_survives_restart(model, tmp_path):
    url = "file://" + str(tmp_path / "store")
    pc = PrefixCache(forms_for(model.config, np.float32, P), device_bytes=1 << 20, host_bytes=0, store_url=url)
    run(model, pc, PROMPT)
    pc.flush()
    del pc
    pc2 = PrefixCache(forms_for(model.config, np.float32, P), device_bytes=1 << 20, host_bytes=0, store_url=url)
    got, plan = run(model, pc2, PROMPT)
    assert plan.boundary == 96 and plan.forms["dense"].used == {"store": 6}
    np.testing.assert_allclose(got, cold(model, PROMPT), atol=2e-5, rtol=0)
    # different weights -> the restarted cache names the field
    other = toy_model(model.config, seed=1)
    plan = pc2.lookup(model_namespace(other, pc2), PROMPT)
    plan.lease.release()
    assert plan.boundary == 0 and "semantic.weights" in plan.reasons()[0]


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_corrupt_store_entries_are_detected_and_recomputed(model, tmp_path, damage):
    url = str(tmp_path / "store")
    pc = PrefixCache(forms_for(model.config, np.float32, P), device_bytes=1 << 20, host_bytes=0, store_url=url)
    run(model, pc, PROMPT)
    pc.flush()
    ns = model_namespace(model, pc).hex
    root = os.path.join(url, ns, "dense")
    victim = sorted(os.listdir(root))[0]
    path = os.path.join(root, victim)
    raw = open(path, "rb").read()
    if damage == "flip":
        raw = raw[:-5] + bytes([raw[-5] ^ 0xFF]) + raw[-4:]
    elif damage == "truncate":
        raw = raw[: len(raw) - 100]
    else:  # a well-formed header that says the entry is incomplete
        hl = int.from_bytes(raw[:8], "little")
        h = json.dumps({**json.loads(raw[8:8 + hl]), "complete": False}).encode()
        raw = len(h).to_bytes(8, "little") + h + raw[8 + hl:]
    open(path, "wb").write(raw)
    pc2 = PrefixCache(forms_for(model.config, np.float32, P), device_bytes=1 << 20, host_bytes=0, store_url=url)
    got, plan = run(model, pc2, PROMPT)
    np.testing.assert_allclose(got, cold(model, PROMPT), atol=2e-5, rtol=0)
    assert pc2.stats()["events"].get("corrupt") == 1
    assert plan.boundary < 96  # the plan was re-made below the corrupt block


def test_store_timeout_is_a_capacity_miss_and_recomputes(model, tmp_path):
    url = str(tmp_path / "store")
    pc = PrefixCache(forms_for(model.config, np.float32, P), device_bytes=1 << 20, host_bytes=0, store_url=url)
    run(model, pc, PROMPT)
    pc.flush()
    pc2 = PrefixCache(forms_for(model.config, np.float32, P), device_bytes=1 << 20, host_bytes=0, store_url=url,
                      store_timeout_s=0.01)

    class Slow:
        def result(self, timeout=None):
            raise TimeoutError("store did not answer")

    pc2.store.read_entry_async = lambda *a: Slow()
    got, plan = run(model, pc2, PROMPT)
    assert plan.boundary == 0 and "store" not in plan.tiers
    assert pc2.stats()["misses"]["capacity"]["tier timeout"] > 0
    np.testing.assert_allclose(got, cold(model, PROMPT), atol=2e-5, rtol=0)


def test_eviction_is_lru_with_priority(model):
    forms = forms_for(model.config, np.float32, P)
    pc = PrefixCache(forms, device_bytes=1 << 20, host_bytes=0)
    ns = model_namespace(model, pc)
    a = (np.arange(40) * 3 % 97).astype(np.int32)
    b = (np.arange(40) * 5 % 97 + 1).astype(np.int32)
    c = (np.arange(40) * 7 % 97 + 2).astype(np.int32)
    prefill_with_prefix_cache(model, a, pc, capacity=CAP, chunk=CHUNK, priority=1)  # oldest but high priority
    prefill_with_prefix_cache(model, b, pc, capacity=CAP, chunk=CHUNK)
    prefill_with_prefix_cache(model, c, pc, capacity=CAP, chunk=CHUNK)
    pc.evict("dense", "device", 2)  # b's two blocks: lowest priority, least recent
    reuse = {}
    for name, t in (("a", a), ("b", b), ("c", c)):
        plan = pc.lookup(ns, t)
        plan.lease.release()
        reuse[name] = plan.forms["dense"].reusable
    assert reuse == {"a": 32, "b": 0, "c": 32}


def test_interrupted_store_write_leaves_nothing_visible(model, tmp_path):
    """TensorStore's file driver writes `key.__lock` and renames it: a crash mid-write leaves only that file."""
    url = str(tmp_path / "store")
    pc = PrefixCache(forms_for(model.config, np.float32, P), device_bytes=1 << 20, host_bytes=0, store_url=url)
    run(model, pc, PROMPT)
    pc.flush()
    root = os.path.join(url, model_namespace(model, pc).hex, "dense")
    name = sorted(os.listdir(root))[0]
    os.rename(os.path.join(root, name), os.path.join(root, name + ".__lock"))  # as if the write never finished
    with open(os.path.join(root, name + ".__lock"), "r+b") as f:
        f.truncate(50)
    pc2 = PrefixCache(forms_for(model.config, np.float32, P), device_bytes=1 << 20, host_bytes=0, store_url=url)
    got, plan = run(model, pc2, PROMPT)
    np.testing.assert_allclose(got, cold(model, PROMPT), atol=2e-5, rtol=0)
    assert plan.boundary < 96 and pc2.stats()["events"].get("corrupt") is None  # missing, never read as data
