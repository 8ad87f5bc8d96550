"""Bug class 8: a tenant's plans and metrics say nothing about other tenants' entries: a prompt another tenant
cached looks exactly like a prompt nobody cached."""

import dataclasses

from kvjax.prefix.prefill import model_namespace


def _shape(plan):
    return [(s.kind, s.cause, s.form, s.tokens, s.detail) for s in plan.shortfalls]


def test_other_tenants_prompts_look_uncached(model, make_cache, run, prompt):
    pc = make_cache(model)
    mine, theirs, nobodys = prompt(80, seed=1), prompt(80, seed=2), prompt(80, seed=3)
    run(model, pc, theirs, namespace=model_namespace(model, pc, tenant_salt="tenant-a"))
    ns_b = model_namespace(model, pc, tenant_salt="tenant-b")
    plans = {}
    for name, p in (("theirs", theirs), ("nobodys", nobodys)):
        plans[name] = pc.lookup(ns_b, p)
        plans[name].lease.release()
    assert _shape(plans["theirs"]) == _shape(plans["nobodys"]) == [
        ("compatibility", "not cached", None, 80, "tokens [0, 80) not cached")]
    st = pc.stats(tenant="tenant-b")
    assert st["misses"] == {"compatibility": {"not cached": 160}, "capacity": {}, "boundary": {}}
    assert st["lookups"] == 2 and "entries" not in st
    assert "tenant_salt" not in repr(pc.stats())
    # the tenant's own entries are still diagnosed: a weights change names the field
    run(model, pc, mine, namespace=ns_b)
    other_weights = dataclasses.replace(ns_b, semantic={**ns_b.semantic, "weights": "0" * 64})
    plan = pc.lookup(other_weights, mine)
    plan.lease.release()
    assert plan.shortfalls[0].cause == "identity" and "semantic.weights" in plan.shortfalls[0].detail
    assert "tenant_salt" not in plan.shortfalls[0].detail
