"""Bug class 6: eviction never takes blocks of a chain the current request is reading or extending, so extending a
cached prompt keeps what both prompts can hit, and no slot holds a block that cannot be reached."""

import numpy as np

from kvjax.prefix.layouts.llama import PATH
from kvjax.prefix.prefill import model_namespace


def _unreachable(pc):
    """Path entries held in some tier whose parent block has no available entry of the same form."""
    out = []
    for _, tree in pc.trees.values():
        by_key = {blk.key: blk for blk in tree.iter_blocks()}
        for blk in by_key.values():
            for form, e in blk.path.items():
                parent = by_key.get(blk.parent_key)
                if e.tier() and blk.index and (parent is None or parent.path.get(form) is None
                                                or parent.path[form].tier() is None):
                    out.append((form, blk.index))
    return out


def _six_dense_blocks(model, make_cache):
    """A cache whose device tier holds exactly 6 blocks of the dense (path) form, and no host tier."""
    dense = make_cache(model, host_bytes=0).specs["dense"]
    assert dense.kind == PATH
    pc = make_cache(model, device_bytes=2 * 6 * dense.nbytes, host_bytes=0)
    assert pc.caps["dense"]["device"] == 6
    return pc


def _dense_reusable(model, pc, **prompts):
    """{name: dense tokens a lookup of that prompt would reuse} (each lookup's lease released at once)."""
    ns = model_namespace(model, pc)
    reuse = {}
    for name, t in prompts.items():
        plan = pc.lookup(ns, t)
        plan.lease.release()
        reuse[name] = plan.forms["dense"].reusable
    return reuse


def test_extending_a_prompt_never_evicts_its_own_chain(model, make_cache, run, cold, prompt):
    pc = _six_dense_blocks(model, make_cache)
    a = prompt(64)
    b = np.concatenate([a, prompt(48, seed=5)])  # a's 4 blocks + 3 more: only 2 slots are free
    run(model, pc, a)
    got, _ = run(model, pc, b)
    np.testing.assert_allclose(got, cold(model, b), atol=2e-5, rtol=0)
    reuse = _dense_reusable(model, pc, a=a, b=b)
    assert reuse == {"a": 64, "b": 64}, reuse
    assert _unreachable(pc) == []


def test_a_request_does_not_evict_what_it_reads_even_at_low_priority(model, make_cache, run, cold, prompt):
    pc = _six_dense_blocks(model, make_cache)
    a = prompt(64)
    run(model, pc, a)  # 4 blocks, priority 0
    run(model, pc, prompt(32, seed=9), priority=1)  # 2 blocks that outrank a's: the pool is full
    b = np.concatenate([a, prompt(20, seed=6)])  # reads all of a, adds 1 block
    got, plan = run(model, pc, b)
    assert plan.boundary == 64
    np.testing.assert_allclose(got, cold(model, b), atol=2e-5, rtol=0)
    reuse = _dense_reusable(model, pc, a=a, b=b)
    assert reuse == {"a": 64, "b": 80}, reuse
    assert _unreachable(pc) == []
