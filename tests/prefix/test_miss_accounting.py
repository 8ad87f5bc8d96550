"""Bug class 7: misses are counted by form and cause exactly as docs/cache_identity.md defines them, once per request
(a re-plan replaces its request's counts), and store caps hold from start-up."""

import numpy as np

from kvjax.prefix.prefill import model_namespace


def _counted(pc) -> int:
    st = pc.stats()
    return st["hit_tokens"] + sum(sum(c.values()) for c in st["misses"].values())


def _plan(pc, model, tokens):
    plan = pc.lookup(model_namespace(model, pc), tokens)
    plan.lease.release()
    assert sum(s.tokens for s in plan.shortfalls) == plan.prompt_tokens - plan.boundary, plan.reasons()
    return plan


def test_evicted_snapshot_is_a_capacity_miss(model, make_cache, run, prompt):
    pc = make_cache(model, host_bytes=0)
    p = prompt(100)
    run(model, pc, p)
    pc.evict("swa", "device", 1000)
    plan = _plan(pc, model, p)
    assert plan.boundary == 0
    by_cause = {(s.kind, s.cause, s.form): s.tokens for s in plan.shortfalls if s.tokens}
    assert by_cause == {("capacity", "evicted", "swa"): 96, ("compatibility", "not cached", None): 4}, by_cause
    assert pc.stats()["misses"]["capacity"]["evicted"] == 96
    assert "no snapshot" not in pc.stats()["misses"]["boundary"]


def test_never_admitted_snapshot_is_a_capacity_miss(model, make_cache, run, prompt):
    pc = make_cache(model, shares={"dense": 1.0, "swa": 0.0})  # the sliding-window form gets no budget anywhere
    p = prompt(100)
    run(model, pc, p)
    plan = _plan(pc, model, p)
    assert plan.boundary == 0
    by_cause = {(s.kind, s.cause, s.form): s.tokens for s in plan.shortfalls if s.tokens}
    assert by_cause == {("capacity", "not admitted", "swa"): 96, ("compatibility", "not cached", None): 4}, by_cause


def test_a_boundary_with_no_snapshot_taken_is_a_boundary_miss(model, make_cache, run, prompt):
    pc = make_cache(model)
    p = prompt(100)
    run(model, pc, p)  # snapshots at 32, 64 and 96 only
    q = np.concatenate([p[:88], prompt(12, seed=3)])
    q[88] = (p[88] + 1) % 97
    plan = _plan(pc, model, q)
    assert plan.boundary == 64
    got = {(s.kind, s.cause): s.tokens for s in plan.shortfalls if s.tokens}
    assert got == {("boundary", "no snapshot"): 16, ("compatibility", "token divergence"): 20}, got


def test_a_replanned_request_is_counted_once(model, stored, run, cold, store_files):
    url, p, reopen = stored
    victim = store_files(url, "dense")[0]
    raw = bytearray(open(victim, "rb").read())
    raw[-2] ^= 0xFF
    open(victim, "wb").write(bytes(raw))
    pc2 = reopen()
    got, plan = run(model, pc2, p)
    np.testing.assert_allclose(got, cold(model, p), atol=2e-5, rtol=0)
    st = pc2.stats()
    assert (st["lookups"], st["prompt_tokens"], st["hit_tokens"]) == (1, 100, plan.boundary), st
    assert _counted(pc2) == 100, st["misses"]
    assert st["events"]["replan:corrupt"] == 1


def test_every_prompt_token_is_counted_once(model, make_cache, run, prompt):
    pc = make_cache(model)
    base = prompt(96)
    total = 0
    for q in [base, base, base[:50], np.concatenate([base[:40], prompt(30, seed=4)]), prompt(7), base[:16],
              base[:17], np.concatenate([base, prompt(33, seed=8)])]:
        _, plan = run(model, pc, q)
        assert sum(s.tokens for s in plan.shortfalls) == q.size - plan.boundary, plan.reasons()
        total += q.size
        assert pc.stats()["prompt_tokens"] == total and _counted(pc) == total, pc.stats()["misses"]
    pc.evict("dense", "device", 3)
    pc.evict("swa", "host", 3)
    _, plan = run(model, pc, base)
    assert _counted(pc) == total + 96 == pc.stats()["prompt_tokens"]


def test_identity_miss_is_counted_once(model, make_cache, run, prompt):
    import dataclasses

    pc = make_cache(model)
    p = prompt(64)
    run(model, pc, p)
    ns = model_namespace(model, pc)
    other = dataclasses.replace(ns, representation={**ns.representation, "kernel_abi": "k2", "mesh": "tp=2"})
    plan = pc.lookup(other, p)
    plan.lease.release()
    assert plan.boundary == 0 and "representation.kernel_abi" in plan.reasons()[0]
    assert pc.stats()["misses"]["compatibility"] == {"not cached": 64, "identity": 64}  # the first run, this one
    assert pc.stats()["events"]["identity:representation.kernel_abi"] == 1
    assert _counted(pc) == pc.stats()["prompt_tokens"] == 128


def test_store_caps_hold_at_start_up(model, make_cache, run, prompt, tmp_path, store_files):
    url = str(tmp_path / "store")
    pc = make_cache(model, store_url=url, store_bytes=1 << 20)
    for seed in range(3):
        run(model, pc, prompt(64, seed=seed))
    pc.flush()
    assert len(store_files(url, "dense")) == 12
    dense = pc.specs["dense"]
    small = 2 * 5 * dense.nbytes  # room for 5 dense entries (half of the budget goes to the swa form)
    pc2 = make_cache(model, store_url=url, store_bytes=small)
    assert pc2.caps["dense"]["store"] == 5
    assert len(pc2.members["dense"]["store"]) <= 5 and len(pc2.members["swa"]["store"]) <= pc2.caps["swa"]["store"]
    pc2.flush()
    assert len(store_files(url, "dense")) <= 5
