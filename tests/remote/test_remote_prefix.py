"""Remote prefix caching: draft-first and fetch-full serving are exact (equal to the reference decoder), identity
mismatches are misses, corrupt entries are detected and never produce a token, the link cap is respected."""

from __future__ import annotations

import dataclasses
import glob
import os
import threading
import time

import numpy as np
import pytest

from kvjax import load
from kvjax.decode import vericache as vc
from kvjax.remote import CorruptEntry, Link, RemoteStore
from kvjax.remote import draft_first as df
from builders import GatedLink
from kvjax.remote import prefix_entry as pe

P, M, X, RING = 300, 24, 4, 48
DRAFT = dict(compressor="streaming", compressor_kw={"ratio": 4.0}, recent_slots=RING, draft_len=X)


@pytest.fixture(scope="module")
def setup(hf_model_dir, tmp_path_factory):
    model = load(hf_model_dir("llama")[1])
    prompt = np.random.default_rng(0).integers(0, 97, P).astype(np.int32)
    root = str(tmp_path_factory.mktemp("remote"))
    store = RemoteStore(root, chunk_bytes=16 << 10)
    info = df.store_prefix(model, store, prompt, drafts=(("streaming", {"ratio": 4.0}),), recent_slots=RING,
                           max_new_tokens=M, max_draft=X)
    ref = vc.reference_decode(model, prompt, M, draft_len=X)
    return model, prompt, root, store, info, ref


def test_draft_first_exact_with_run_ahead(setup):
    model, prompt, root, _, _, ref = setup
    link = GatedLink()
    store = RemoteStore(root, link=link, chunk_bytes=16 << 10)
    threading.Timer(1.0, link.gate.set).start()
    toks, st = df.serve_draft_first(model, store, prompt, M, max_ahead=16, **DRAFT)
    assert st["source"] == "draft-first" and st["full_source"] == "store", st["reasons"]
    assert st["drafted_ahead"] >= X  # the gate was closed when drafting started
    assert st["ttft_s"] < st["full_arrival_s"]
    np.testing.assert_array_equal(toks, ref)


def test_full_fetch_exact(setup):
    model, prompt, _, store, _, ref = setup
    toks, st = df.serve_full_fetch(model, store, prompt, M, draft_len=X, decoder="reference")
    assert st["source"] == "full-fetch"
    np.testing.assert_array_equal(toks, ref)
    np.testing.assert_array_equal(df.reference_from_store(model, store, prompt, M, draft_len=X), ref)


def test_identity_mismatch_is_a_miss(setup):
    model, prompt, _, store, _, ref = setup
    other_tenant = pe.prefix_namespace(model, tenant_salt="tenant-b")
    toks, st = df.serve_full_fetch(model, store, prompt, M, namespace=other_tenant, fallback=False)
    assert toks is None and st["source"] == "miss" and "no full entry" in st["reasons"][0]
    shifted = prompt.copy()
    shifted[-1] = (shifted[-1] + 1) % 97
    assert df.serve_full_fetch(model, store, shifted, M, fallback=False)[0] is None
    # a draft with other settings is a draft miss: served by fetch-full, still exact
    toks, st = df.serve_draft_first(model, store, prompt, M, **dict(DRAFT, compressor_kw={"ratio": 8.0}))
    assert st["source"] == "full-fetch" and "draft miss" in st["reasons"][0]
    np.testing.assert_array_equal(toks, ref)


def test_refreshing_drafter_stored_and_served_exact(setup, tmp_path):
    """The refreshing drafter's draft cache carries a static `RefreshSpec`: it must survive the manifest's JSON and
    come back equal, and draft-first serving from it must be exact."""
    from kvjax.remote import cache_codec as codec

    model, prompt, _, _, _, ref = setup
    store = RemoteStore(str(tmp_path / "r"), chunk_bytes=16 << 10)
    df.store_prefix(model, store, prompt, drafts=(("refresh", {}),), recent_slots=RING, max_new_tokens=M,
                    max_draft=X)
    toks, st = df.serve_draft_first(model, store, prompt, M, compressor="refresh", compressor_kw={},
                                    recent_slots=RING, draft_len=X)
    assert st["source"] == "draft-first", st["reasons"]
    np.testing.assert_array_equal(toks, ref)
    spec = codec.static_value(codec.static_json(codec.static_value(
        {"static_type": "kvjax.compress.refresh:RefreshSpec", "values": dict(block=16, budget_blocks=4, sink_blocks=1,
                                                                          recent_blocks=1, period=1)})))
    assert spec.budget == 64 and hash(spec) == hash(dataclasses.replace(spec))
    for bad in ({"static_type": "kvjax.compress.refresh:RefreshSpec", "values": {"block": 16}},  # fields missing
                {"static_type": "os:system", "values": {}}, {"static_tuple": 3}, [1, 2]):
        with pytest.raises(CorruptEntry):  # a corrupt entry, never a crash or a foreign type
            codec.static_value(bad)


def test_draft_identity_names_compressor_and_settings():
    from kvjax.compress import make_compressor

    names = {pe.draft_name(pe.draft_identity(make_compressor(c, **kw), r))
             for c, kw, r in [("streaming", {"ratio": 4.0}, 48), ("streaming", {"ratio": 8.0}, 48),
                              ("streaming", {"ratio": 4.0, "sinks": 8}, 48), ("streaming", {"ratio": 4.0}, 64),
                              ("snapkv", {"ratio": 4.0}, 48), ("kivi4", {}, 48), ("kivi2", {}, 48)]}
    assert len(names) == 7


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_entries_detected_never_produce_a_token(setup, tmp_path):
    model, prompt, _, _, _, ref = setup
    store = RemoteStore(str(tmp_path), chunk_bytes=16 << 10)
    info = df.store_prefix(model, store, prompt, drafts=(("streaming", {"ratio": 4.0}),), recent_slots=RING,
                           max_new_tokens=M, max_draft=X)
    ns = pe.prefix_namespace(model)
    base = os.path.join(str(tmp_path), ns.hex, info["prefix"])
    # a full-cache chunk met by the background fetch: recomputed, drafts still verified
    _flip(sorted(glob.glob(os.path.join(base, "full-layer-001", "0*")))[1])
    toks, st = df.serve_draft_first(model, store, prompt, M, **DRAFT)
    assert st["full_source"] == "recompute" and "CorruptEntry" in st["reasons"][0] and "checksum" in st["reasons"][0]
    np.testing.assert_array_equal(toks, ref)
    body = store.get_manifest(ns.hex, info["prefix"], pe.FULL)
    with pytest.raises(CorruptEntry, match="checksum"):
        store.get_bundle(ns.hex, info["prefix"], body["bundles"]["layer-001"])
    # a truncated draft chunk: falls back to fetch-full (whose corrupt layer falls back to recompute)
    chunk = sorted(glob.glob(os.path.join(base, info["drafts"][0], "0*")))[0]
    with open(chunk, "r+b") as f:
        f.truncate(os.path.getsize(chunk) - 100)
    toks, st = df.serve_draft_first(model, store, prompt, M, **DRAFT)
    assert st["source"] == "recompute" and "truncated" in st["reasons"][0], st["reasons"]
    np.testing.assert_array_equal(toks, ref)


def test_bandwidth_cap_respected(tmp_path):
    cap = 0.004  # GB/s = 4 MB/s
    link = Link(gbytes_per_s=cap)
    store = RemoteStore(str(tmp_path), link=link, chunk_bytes=256 << 10)
    data = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    rec = store.put_bundle("ns", "pfx", "b", {"x": data})
    t = time.perf_counter()
    got = store.get_bundle("ns", "pfx", rec)
    elapsed = time.perf_counter() - t
    np.testing.assert_array_equal(got["x"], data)
    assert link.bytes >= data.nbytes
    assert link.bytes / elapsed <= cap * 1e9 * 1.5
    assert Link().rate is None
    with pytest.raises(ValueError):
        Link(gbytes_per_s=0)


def test_sliding_window_model_draft_first_exact(hf_model_dir, tmp_path):
    """Sliding layers store their ring (not the prompt rows); the served cache is the prefilled one."""
    model = load(hf_model_dir("mistral")[1])
    prompt = np.random.default_rng(1).integers(0, 97, 100).astype(np.int32)
    store = RemoteStore(str(tmp_path), chunk_bytes=16 << 10)
    df.store_prefix(model, store, prompt, drafts=(("streaming", {"ratio": 4.0}),), recent_slots=RING,
                    max_new_tokens=12, max_draft=X)
    toks, st = df.serve_draft_first(model, store, prompt, 12, max_ahead=8, **DRAFT)
    assert st["source"] == "draft-first" and st["full_source"] == "store", st["reasons"]
    np.testing.assert_array_equal(toks, vc.reference_decode(model, prompt, 12, draft_len=X))
