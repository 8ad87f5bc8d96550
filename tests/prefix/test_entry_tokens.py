"""Bug class 2: every store entry carries its block's token ids and they are compared on restore, so colliding
block keys (simulated here with keys that ignore the tokens) can never restore another prompt's KV."""

import numpy as np

from kvjax.prefix import identity


def _depth_only_keys(monkeypatch):
    """Block keys that depend on the depth only: every prompt collides with every other one at each block."""
    monkeypatch.setattr(identity, "block_key", lambda ns, parent, tokens: identity.digest(identity.BLOCK_DOMAIN,
                                                                                            ns, parent))


def test_colliding_block_keys_never_restore_foreign_kv(model, make_cache, run, cold, prompt, tmp_path,
                                                       monkeypatch):
    _depth_only_keys(monkeypatch)
    url = str(tmp_path / "store")
    pc = make_cache(model, device_bytes=0, host_bytes=0, store_url=url)  # every hit is read from the store
    a, b = prompt(100, seed=1), prompt(100, seed=2)
    run(model, pc, a)
    pc.flush()
    run(model, pc, b)  # same keys: b's entries overwrite a's in the store
    pc.flush()
    got, plan = run(model, pc, a)
    np.testing.assert_allclose(got, cold(model, a), atol=2e-5, rtol=0)
    assert plan.boundary == 0
    assert pc.stats()["misses"]["capacity"].get("corrupt", 0) > 0  # found at restore, counted, recomputed
    # and after a restart, which rebuilds the tree from the (overwritten) store
    pc.flush()
    pc2 = make_cache(model, device_bytes=0, host_bytes=0, store_url=url)
    for p in (a, b):
        got, _ = run(model, pc2, p)
        np.testing.assert_allclose(got, cold(model, p), atol=2e-5, rtol=0)


def test_store_entry_header_carries_tokens(model, make_cache, run, prompt, tmp_path, store_files):
    import json

    url = str(tmp_path / "store")
    pc = make_cache(model, store_url=url)
    p = prompt(40)
    run(model, pc, p)
    pc.flush()
    seen = set()
    for path in store_files(url, "dense"):
        raw = open(path, "rb").read()
        hl = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + hl])
        i = header["index"]
        assert header["tokens"] == p[16 * i:16 * (i + 1)].tolist()
        seen.add(i)
    assert seen == {0, 1}


def test_memory_tier_entries_are_compared_with_the_prompt_on_restore(model, make_cache, run, cold, prompt, pins):
    pc = make_cache(model)
    p = prompt(100)
    run(model, pc, p)
    (_, tree), = pc.trees.values()
    blk = sorted(tree.iter_blocks(), key=lambda b: b.index)[3]
    assert blk.path["dense"].tokens.tolist() == p[48:64].tolist()
    blk.path["dense"].tokens = prompt(16, seed=7)  # as if the entry had been attached to another block
    got, plan = run(model, pc, p)
    np.testing.assert_allclose(got, cold(model, p), atol=2e-5, rtol=0)
    assert plan.boundary <= 48 and pins(pc) == 0
    assert pc.stats()["events"]["replan:corrupt"] == 1
