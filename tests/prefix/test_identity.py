"""Identity: every change to what the model computes or how bytes are stored misses, with the field named."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.prefix.identity import ROOT_KEY, block_key, block_keys, make_namespace, weights_fingerprint
from kvjax.families import forms_for
from kvjax.prefix.layouts.llama import check_block_size
from kvjax.prefix.manager import PrefixCache
from kvjax.prefix.prefill import model_namespace, prefill_with_prefix_cache
from builders import toy_config, toy_model
from kvjax.models.layer_types import FULL, SLIDING
from kvjax.models.rope import RopeConfig

P = 16


@pytest.fixture(scope="module")
def setup():
    model = toy_model(toy_config((FULL, SLIDING), window=16))
    pc = PrefixCache(forms_for(model.config, np.float32, P), device_bytes=1 << 20, host_bytes=0)
    prompt = (np.arange(70) * 7 % 97).astype(np.int32)
    prefill_with_prefix_cache(model, prompt, pc, capacity=256, chunk=32)
    return model, pc, prompt


def miss_fields(pc, ns, prompt):
    plan = pc.lookup(ns, prompt)
    plan.lease.release()
    assert plan.boundary == 0
    return [s for s in plan.shortfalls if s.cause == "identity"][0].detail


def test_same_identity_hits(setup):
    model, pc, prompt = setup
    plan = pc.lookup(model_namespace(model, pc), prompt)
    plan.lease.release()
    assert plan.boundary == 64


def _lora(scale=1.0):
    return {"a": jnp.full((4, 2), scale), "b": jnp.ones((2, 4))}


@pytest.mark.parametrize("change,field", [
    (dict(adapters=[(_lora(), 1.0)]), "semantic.adapters"),
    (dict(adapters=[(_lora(), 1.0), (_lora(2.0), 0.5)]), "semantic.adapters"),
])
def test_request_identity_changes_miss(setup, change, field):
    model, pc, prompt = setup
    assert field in miss_fields(pc, model_namespace(model, pc, **change), prompt)


@pytest.mark.parametrize("field,value", [("tokenizer_rev", "tok-2"), ("template_rev", "tpl-2")])
def test_tokenizer_revision_changes_miss(setup, field, value):
    model, pc, prompt = setup
    ns = model_namespace(model, pc)
    other = dataclasses.replace(ns, semantic={**ns.semantic, field: value})
    assert f"semantic.{field}" in miss_fields(pc, other, prompt)


def test_another_tenant_is_not_an_identity_miss(setup):
    """Tenants are isolated: another tenant's entries are neither hit nor named (tests/prefix/test_tenant_...)."""
    model, pc, prompt = setup
    plan = pc.lookup(model_namespace(model, pc, tenant_salt="tenant-b"), prompt)
    plan.lease.release()
    assert plan.boundary == 0 and [s.cause for s in plan.shortfalls] == ["not cached"]


def test_weights_change_misses_and_rename_does_not(setup):
    model, pc, prompt = setup
    params = jax.tree.map(lambda x: x, model.params)
    params["layers"][0]["wk"] = params["layers"][0]["wk"].at[0, 0].add(1e-3)
    other = dataclasses.replace(model, params=params)
    assert "semantic.weights" in miss_fields(pc, model_namespace(other, pc), prompt)
    renamed = dataclasses.replace(model, path="/elsewhere/same-weights")
    plan = pc.lookup(model_namespace(renamed, pc), prompt)
    plan.lease.release()
    assert plan.boundary > 0
    assert weights_fingerprint(model.params) != weights_fingerprint(params)


@pytest.mark.parametrize("cfg_change", [dict(rope=RopeConfig(theta=500000.0)), dict(sliding_window=32),
                                        dict(layer_types=(FULL, FULL))])
def test_kv_field_changes_miss(setup, cfg_change):
    model, pc, prompt = setup
    other = dataclasses.replace(model, config=dataclasses.replace(model.config, **cfg_change))
    ns = model_namespace(model, pc)
    ns2 = make_namespace(other.config, weights=ns.semantic["weights"], kv_dtype="float32",
                         formats=ns.representation["formats"], block_size=P)
    assert "semantic.kv_fields" in miss_fields(pc, ns2, prompt)


@pytest.mark.parametrize("rep,field", [
    (dict(kv_dtype="bfloat16"), "representation.kv_dtype"),
    (dict(formats={"dense": "x", "swa": "y"}), "representation.formats"),
    (dict(kernel_abi="pallas-9"), "representation.kernel_abi"),
    (dict(mesh="tp=2"), "representation.mesh"),
])
def test_representation_changes_miss(setup, rep, field):
    model, pc, prompt = setup
    ns = model_namespace(model, pc)
    ns2 = dataclasses.replace(ns, representation={**ns.representation, **rep})
    assert field in miss_fields(pc, ns2, prompt)


def test_dtype_changes_form_fingerprint():
    cfg = toy_config((FULL, SLIDING), window=16)
    a = {s.name: s.fingerprint for s in forms_for(cfg, np.float32, P).specs}
    b = {s.name: s.fingerprint for s in forms_for(cfg, "bfloat16", P).specs}
    c = {s.name: s.fingerprint for s in forms_for(cfg, np.float32, 32).specs}
    assert a["dense"] != b["dense"] and a["swa"] != b["swa"] and a["dense"] != c["dense"]


def test_insert_with_foreign_formats_is_refused(setup):
    model, pc, prompt = setup
    ns = model_namespace(model, pc)
    bad = dataclasses.replace(ns, representation={**ns.representation, "block_size": 32})
    with pytest.raises(ValueError, match="block size"):
        pc.insert(bad, prompt, None)


def test_typed_fields_do_not_alias():
    cfg = toy_config()
    kw = dict(weights="w", kv_dtype="float32", formats={}, block_size=P)
    a = make_namespace(cfg, adapters=[("x", 1.0)], tenant_salt="", **kw)
    b = make_namespace(cfg, adapters=[], tenant_salt="x", **kw)
    c = make_namespace(cfg, adapters=[("x", 1)], **kw)
    d = make_namespace(cfg, adapters=[("x", 1.0)], **kw)
    e = make_namespace(cfg, template_rev="x", **kw)
    assert a.hex != b.hex and b.hex != e.hex
    assert c.hex == d.hex  # scale is normalised to float


def test_block_keys_chain_and_differ_by_namespace():
    toks = np.arange(48, dtype=np.int32)
    k1 = block_keys(b"a" * 32, toks, P)
    k2 = block_keys(b"b" * 32, toks, P)
    assert len(k1) == 3 and len(set(k1)) == 3 and not set(k1) & set(k2)
    assert k1[1] == block_key(b"a" * 32, k1[0], toks[16:32])
    assert k1[0] == block_key(b"a" * 32, ROOT_KEY, toks[:16])
    toks2 = toks.copy()
    toks2[3] += 1  # a change in block 0 changes every later key
    assert all(x != y for x, y in zip(k1, block_keys(b"a" * 32, toks2, P)))


def test_block_size_must_align_with_rates_and_capacities():
    check_block_size(64, (4, 128 // 4), (256, 1024))
    with pytest.raises(ValueError, match="lcm"):
        check_block_size(64, (4, 128))
    with pytest.raises(ValueError, match="capacity"):
        check_block_size(48, (), (256,))
