"""Bug class 4: any number of bad entries in one request means recompute, never an exception, and every lease and
pin of a failed or abandoned plan is released."""

import gc

import numpy as np
import pytest

from kvjax.prefix.identity import block_keys
from kvjax.prefix.prefill import model_namespace


def _flip_all(paths):
    for p in paths:
        raw = bytearray(open(p, "rb").read())
        raw[-5] ^= 0xFF
        open(p, "wb").write(bytes(raw))


def test_more_corrupt_entries_than_replans_still_recompute(model, make_cache, run, cold, prompt, pins, tmp_path,
                                                           store_files):
    url = str(tmp_path / "store")
    p = prompt(170)  # sliding-window snapshots at 32, 64, 96, 128 and 160
    pc = make_cache(model, device_bytes=0, host_bytes=0, store_url=url)
    run(model, pc, p)
    pc.flush()
    _flip_all(store_files(url, "swa"))  # every snapshot damaged: each one found makes the plan fall back further
    pc2 = make_cache(model, device_bytes=0, host_bytes=0, store_url=url)
    got, plan = run(model, pc2, p)
    np.testing.assert_allclose(got, cold(model, p), atol=2e-5, rtol=0)
    assert plan.boundary == 0 and pins(pc2) == 0
    assert pc2.stats()["events"]["corrupt"] == 5


def test_every_damaged_entry_of_a_plan_is_dropped_at_once(model, make_cache, run, cold, prompt, pins, tmp_path,
                                                         store_files):
    url = str(tmp_path / "store")
    p = prompt(100)
    pc = make_cache(model, device_bytes=0, host_bytes=0, store_url=url)
    run(model, pc, p)
    pc.flush()
    _flip_all(store_files(url))  # 6 dense blocks and 3 snapshots
    pc2 = make_cache(model, device_bytes=0, host_bytes=0, store_url=url)
    got, plan = run(model, pc2, p)
    np.testing.assert_allclose(got, cold(model, p), atol=2e-5, rtol=0)
    assert plan.boundary == 0 and pins(pc2) == 0
    assert pc2.stats()["events"]["replan:corrupt"] == 1  # one re-plan for all of them


def test_abandoned_plan_releases_its_pins(model, make_cache, run, prompt, pins):
    pc = make_cache(model)
    p = prompt(100)
    run(model, pc, p)
    plan = pc.lookup(model_namespace(model, pc), p)
    assert plan.boundary > 0 and pins(pc) > 0
    del plan  # never executed, never released
    gc.collect()
    assert pins(pc) == 0


def test_error_after_a_replan_releases_the_replanned_lease(model, stored, run, pins, store_files, monkeypatch):
    url, p, reopen = stored
    last = block_keys(model_namespace(model, reopen()).digest, p, 16)[-1].hex()
    _flip_all([f for f in store_files(url, "dense") if f.endswith(last)])  # the plan is re-made below block 5
    pc2 = reopen()

    def broken_restore(*a, **k):
        raise KeyboardInterrupt  # anything at all, after the re-plan
    monkeypatch.setattr(pc2.forms, "restore", broken_restore)
    with pytest.raises(KeyboardInterrupt):
        run(model, pc2, p)
    assert pins(pc2) == 0
