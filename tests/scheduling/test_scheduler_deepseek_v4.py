"""The many-request schedulers on DeepSeek-V4 (sliding / CSA / HCA hybrid state): every request's tokens equal its
own `reference_decode` (staggered, lock-step, full-cache batching), the budget holds, nothing recompiles once warm —
the Llama tests of `test_scheduler.py`, on the hybrid family. (Sampling through the scheduler is family-generic
code, tested on Llama; V4's sampled exactness is tested per request in `tests/decode`.)"""

from __future__ import annotations

import numpy as np
import pytest
from builders import assert_every_request_exact, make_v4

import kvjax
from kvjax.decode import vericache as vc
from kvjax.scheduling import batch_steps as ss
from kvjax.scheduling import requests
from kvjax.scheduling import vericache_scheduler as sch
from kvjax.scheduling.full_scheduler import FullCacheScheduler

X = 4


@pytest.fixture(scope="module")
def model():
    return kvjax.load(make_v4("hybrid")[1])


def _requests(model, seed=0):
    """4 requests of 30..39 prompt tokens (one capacity bucket, different entry counts), 7..11 new tokens, arriving
    at iterations 0, 0, 1, 2; the first two prefilled into pinned host memory (prefix-cache hits)."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(4):
        r = requests.Request(prompt=rng.integers(0, model.config.vocab_size, 30 + 3 * i).astype(np.int32),
                             max_new_tokens=int(rng.integers(7, 12)), arrival=max(i - 1, 0))
        if i < 2:
            r.prefilled = requests.prefill_request(model, r.prompt, r.max_new_tokens, draft_len=X)
        reqs.append(r)
    refs = [vc.reference_decode(model, r.prompt, r.max_new_tokens, draft_len=X) for r in reqs]
    return reqs, refs


@pytest.fixture(scope="module")
def workload(model):
    reqs, refs = _requests(model)
    F = sch.VeriCacheScheduler(model, budget_bytes=1, draft_len=X)._full_bytes(reqs[0])
    return reqs, refs, F


# A V4 draft row is a full-size masked copy and a tail holds ~1/m of a capacity bucket of entries, each larger than
# the host part F at these tiny sizes: 9 F holds the verification pool and 2 slots, fewer than the 4 requests.
BUDGET = 9


@pytest.mark.slow  # ~50-75 s of V4 step compiles; the schedulers are family-generic and CI runs them on Llama (test_scheduler.py)
def test_schedulers_exact_within_budget_and_warm(model, workload, compile_count):
    """One scenario, so the compiled steps are shared (each V4 step compiles for seconds): staggered VeriCache warmed
    on two requests, then all four — exact, within budget, some waiting for a slot, nothing recompiled; lock-step
    (everyone verifies at once); full-cache batching. Every request's tokens equal its reference decode."""
    reqs, refs, F = workload
    s = sch.VeriCacheScheduler(model, budget_bytes=BUDGET * F, draft_len=X)
    s.run(reqs[:2])
    fns = (ss.draft_slots, ss.verify_row, ss.put_slot_row, ss.put_parts)
    before = [compile_count(f) for f in fns]
    res = s.run(reqs)
    assert [compile_count(f) for f in fns] == before
    assert_every_request_exact(res, refs)
    st = res.stats
    assert 1 <= st["slots"] < len(reqs)  # some requests wait in the queue
    assert 0 < res.peak_measured_bytes <= res.budget_bytes and res.peak_reserved_bytes <= res.budget_bytes
    assert st["verifications"] == sum(st["verifies_per_iteration"])

    res = sch.VeriCacheScheduler(model, budget_bytes=BUDGET * F, draft_len=X, mode="lockstep").run(reqs)
    assert_every_request_exact(res, refs)
    assert max(res.stats["verifies_per_iteration"]) == res.stats["slots"]

    res = FullCacheScheduler(model, budget_bytes=BUDGET * F, draft_len=X).run(reqs)
    assert_every_request_exact(res, refs)  # the plain batched one-token forward agrees with the verify-shape reference here
    assert res.stats["slots"] >= 1 and 0 < res.peak_measured_bytes <= res.budget_bytes
