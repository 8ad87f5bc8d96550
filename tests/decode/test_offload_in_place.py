"""A verify lent the host copy of the full cache (`kvjax.decode.offload.lends`, the CPU) reads it where it lies: no
copy, the same buffers handed back, the same tokens and logits as the fetching path and the reference decoder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import generate_vericache, load, reference_decode
from kvjax.decode import offload as offl
from kvjax.decode import verify as verify_mod
from kvjax.scheduling import vericache_scheduler as sch
from kvjax.scheduling.requests import Request, prefill_request

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="lending is the CPU's path")


@pytest.fixture(scope="module")
def llama(hf_model_dir):
    return load(hf_model_dir("llama")[1])


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 90, size=n).astype(np.int32)


def _pointers(tree):
    return [a.unsafe_buffer_pointer() for a in jax.tree.leaves(tree)]


def test_lends_pinned_host_arrays_only():
    a = jnp.arange(8.0)
    host = offl.to_host((a, None))
    assert offl.lends(host)
    assert not offl.lends((a,))  # device memory: nothing to lend
    assert not offl.lends((None,))


def test_lending_can_be_switched_off(monkeypatch):
    monkeypatch.setattr(offl, "LEND_ON_CPU", False)
    assert not offl.lends(offl.to_host((jnp.arange(8.0),)))


def test_copy_to_host_makes_new_buffers_with_the_same_bits():
    x = jnp.asarray(np.array([1.5, -0.0, np.inf, np.nan], np.float32))
    host = offl.to_host((x, x.astype(jnp.bfloat16)))
    same = offl.to_host(host)
    copy = offl.to_host(host, copy=True)
    assert _pointers(same) == _pointers(host)  # already there: handed back as they are
    assert not set(_pointers(copy)) & set(_pointers(host))
    assert all(a.sharding.memory_kind == "pinned_host" for a in copy)
    for a, b in zip(copy, host):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_lent_verify_reads_in_place_and_equals_the_fetching_path(llama, monkeypatch):
    """Tokens and logits bit-equal to the reference and to the fetching path; every verify takes the very buffers the
    previous one handed back (`take_back`), in host memory -- the prompt's full cache is never copied."""
    prompt = _prompt(80, 1)
    ref = reference_decode(llama, prompt, 24, draft_len=4, return_logits=True)
    seen = []
    verify, take_back = verify_mod.verify_offloaded, offl.take_back

    def verify_spy(params, config, host_part, *a, **k):
        seen.append(("lent", _pointers(host_part)))
        return verify(params, config, host_part, *a, **k)

    def take_back_spy(family, committed):
        back = take_back(family, committed)
        assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(back))
        seen.append(("back", _pointers(back)))
        return back

    monkeypatch.setattr(verify_mod, "verify_offloaded", verify_spy)
    monkeypatch.setattr(offl, "take_back", take_back_spy)
    lent = generate_vericache(llama, prompt, 24, compressor="streaming", draft_len=4, offload=True,
                              ignore_eos=True, return_logits=True)
    monkeypatch.setattr(offl, "LEND_ON_CPU", False)
    fetched = generate_vericache(llama, prompt, 24, compressor="streaming", draft_len=4, offload=True,
                                 ignore_eos=True, return_logits=True)
    for g in (lent, fetched):
        np.testing.assert_array_equal(g.tokens, ref.tokens)
        np.testing.assert_array_equal(g.logits, ref.logits)
    assert lent.stats["offload_in_place"] and not fetched.stats["offload_in_place"]
    kinds = [k for k, _ in seen]
    n = lent.stats["verifications"]
    assert kinds[:2 * n] == ["lent", "back"] * n  # the lent run: every verify handed its buffers back
    ptrs = [p for _, p in seen[:2 * n]]
    assert all(p == ptrs[0] for p in ptrs)  # one set of buffers the whole run: never a copy
    assert "back" not in kinds[2 * n:]  # the fetching run copies in and hands nothing back


def test_scheduler_lends_and_keeps_the_callers_host_cache(llama, monkeypatch):
    """A prefilled request's host cache belongs to the caller: the scheduler lends its own copy, so the caller's
    stays valid and unchanged, and both paths give the reference's tokens."""
    prompts = [_prompt(70 + 9 * i, 10 + i) for i in range(3)]
    refs = [reference_decode(llama, p, 20, draft_len=4).tokens for p in prompts]
    pre = [prefill_request(llama, p, 20, draft_len=4) for p in prompts]  # in host memory, like a prefix hit
    before = [[np.asarray(a).copy() for a in jax.tree.leaves(full)] for full, _ in pre]
    for lend in (True, False):
        monkeypatch.setattr(offl, "LEND_ON_CPU", lend)
        s = sch.VeriCacheScheduler(llama, budget_bytes=1 << 40, draft_len=4, mode="lockstep",
                                   compressor="streaming", compressor_kw=dict(ratio=4.0))
        res = s.run([Request(prompt=p, max_new_tokens=20, prefilled=pp) for p, pp in zip(prompts, pre)])
        for i, r in enumerate(refs):
            np.testing.assert_array_equal(res.outputs[i], r)
        for (full, _), b in zip(pre, before):
            for a, v in zip(jax.tree.leaves(full), b):
                np.testing.assert_array_equal(np.asarray(a), v)


def test_a_request_owning_its_prefilled_cache_lends_it_without_a_copy(llama, monkeypatch):
    """`own_prefilled`: the scheduler takes the prefilled host cache's buffers for the verifies (no admission copy)."""
    prompt = _prompt(90, 20)
    ref = reference_decode(llama, prompt, 20, draft_len=4).tokens
    full, first = prefill_request(llama, prompt, 20, draft_len=4)
    own = set(_pointers(full))
    lent = []
    verify = sch.ss.verify_row

    def verify_spy(params, config, host_part, *a, **k):
        lent.append(set(_pointers(host_part)))
        return verify(params, config, host_part, *a, **k)

    monkeypatch.setattr(sch.ss, "verify_row", verify_spy)
    s = sch.VeriCacheScheduler(llama, budget_bytes=1 << 40, draft_len=4, mode="lockstep", compressor="streaming",
                               compressor_kw=dict(ratio=4.0))
    res = s.run([Request(prompt=prompt, max_new_tokens=20, prefilled=(full, first), own_prefilled=True)])
    np.testing.assert_array_equal(res.outputs[0], ref)
    assert lent and all(p <= own for p in lent)  # every verify read the request's own buffers


def test_refresh_compresses_a_prefilled_host_cache_where_it_lies(llama, monkeypatch):
    """The refreshing drafter reads a prefilled cache lent from host memory in place (`reads_host_memory`): the same
    draft, bit for bit, as from a device copy, made in device memory; the scheduler then fetches no copy for the
    compression, and its tokens are still the reference's."""
    prompt = _prompt(120, 30)
    full, first = prefill_request(llama, prompt, 20, draft_len=4)  # in host memory, like a prefix hit
    comp = llama.family.make_compressor("refresh", model=llama, max_kept=64)
    assert comp.reads_host_memory and not llama.family.make_compressor("streaming").reads_host_memory
    a = comp(llama.params, llama.config, offl.fetch(full), prompt, recent_slots=32)
    b = comp(llama.params, llama.config, full, prompt, recent_slots=32)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert y.sharding.memory_kind == "device"

    fetched = []
    fetch = offl.fetch
    monkeypatch.setattr(offl, "fetch", lambda tree, *a, **k: fetched.append(tree) or fetch(tree, *a, **k))
    ref = reference_decode(llama, prompt, 20, draft_len=4).tokens
    s = sch.VeriCacheScheduler(llama, budget_bytes=1 << 40, draft_len=4, mode="lockstep", compressor="refresh",
                               compressor_kw=dict(max_kept=64))
    res = s.run([Request(prompt=prompt, max_new_tokens=20, prefilled=(full, first))])
    np.testing.assert_array_equal(res.outputs[0], ref)
    assert not any(t is full for t in fetched)  # the prefilled cache was never copied to the device


def test_lent_verifications_are_dispatched_before_the_previous_ones_are_read(llama, monkeypatch):
    """A verification reading a lent host copy holds no device memory, so the scheduler dispatches every due one
    before reading any result (the host's work overlaps them); a fetched copy is read back before the next fetch."""
    prompts = [np.random.default_rng(20 + i).integers(0, 97, 60).astype(np.int32) for i in range(3)]
    pre = [prefill_request(llama, p, 12, draft_len=4) for p in prompts]
    for lend, pattern in ((True, "ddd" + "ccc"), (False, "dc" * 3)):
        monkeypatch.setattr(offl, "LEND_ON_CPU", lend)
        s = sch.VeriCacheScheduler(llama, budget_bytes=1 << 40, draft_len=4, mode="lockstep",
                                   compressor="streaming", compressor_kw=dict(ratio=4.0))
        order = []
        for name, tag in (("_dispatch_verify", "d"), ("_collect_verify", "c")):
            real = getattr(s, name)
            monkeypatch.setattr(s, name, lambda *a, _real=real, _tag=tag: (order.append(_tag), _real(*a))[1])
        res = s.run([Request(prompt=p, max_new_tokens=12, prefilled=pp) for p, pp in zip(prompts, pre)])
        assert "".join(order).startswith(pattern)  # the first phase verifies all three requests
        assert len(res.outputs) == 3
