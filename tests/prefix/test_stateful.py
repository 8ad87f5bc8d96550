"""Invariants under random inserts, lookups, evictions, tier moves and restarts (hypothesis stateful), and under
threads racing them. The "model" is a fake: the state at position p is a function of tokens[:p+1], so any restored
byte that came from the wrong prefix, an evicted slot or an unfinished copy shows up as a wrong value."""

import hashlib
import shutil
import tempfile
import threading

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvjax.cache.dense import DenseKV, ModelCache, WindowKV
from kvjax.prefix.identity import make_namespace
from kvjax.families import forms_for
from kvjax.prefix.manager import PrefixCache
from builders import assert_pool_bookkeeping, toy_config
from kvjax.models.layer_types import FULL, SLIDING

P, W, CAP = 4, 4, 32
CFG = toy_config((FULL, SLIDING), window=W, kv_heads=1, heads=1, head_dim=2, hidden=8)
FORMS = forms_for(CFG, np.float32, P)
NS = make_namespace(CFG, weights="fake", kv_dtype="float32", formats={s.name: s.fingerprint for s in FORMS.specs},
                    block_size=P)
ENTRY = 2 * P * 2 * 4  # bytes of one dense block (1 layer, k+v, 1 head, P, D=2, f32)


def value(prefix) -> float:
    h = hashlib.blake2b(np.asarray(prefix, np.int32).tobytes(), digest_size=4).digest()
    return int.from_bytes(h, "little") / 2**32 + 1.0  # never 0: an empty slot cannot pass for a value


def fake_state(tokens, n):
    """Dense k/v and ring after `n` tokens: every slot holds value(tokens[:p+1]) (k) and its negation (v)."""
    vals = np.zeros((CAP,), np.float32)
    for p in range(n):
        vals[p] = value(tokens[: p + 1])
    ring = np.zeros((W,), np.float32)
    for p in range(max(0, n - W), n):
        ring[p % W] = vals[p]
    return vals, ring


def fake_cache(tokens, n):
    vals, ring = fake_state(tokens, n)
    k = jnp.asarray(np.broadcast_to(vals[None, None, :, None], (1, 1, CAP, 2)))
    rk = jnp.asarray(np.broadcast_to(ring[None, None, :, None], (1, 1, W, 2)))
    length = jnp.asarray([n], jnp.int32)
    return ModelCache(layers=(DenseKV(k=k, v=-k, length=length), WindowKV(k=rk, v=-rk, seen=length, window=W)),
                      length=length)


def empty_cache():
    def z(*s):  # separate buffers: the cache is donated
        return jnp.zeros(s, jnp.float32)

    def n():
        return jnp.zeros((1,), jnp.int32)

    return ModelCache(layers=(DenseKV(k=z(1, 1, CAP, 2), v=z(1, 1, CAP, 2), length=n()),
                              WindowKV(k=z(1, 1, W, 2), v=z(1, 1, W, 2), seen=n(), window=W)), length=n())


def insert(pc, tokens):
    n = len(tokens)
    snaps = {e: FORMS.snapshot(fake_cache(tokens, e)) for e in range(P, n + 1, P)}
    pc.insert(NS, tokens, fake_cache(tokens, n), snaps)


def check_hit(pc, tokens):
    """Look up, execute, verify every restored byte; returns the plan."""
    plan = pc.lookup(NS, tokens)
    try:
        cache, plan = pc.execute(plan, empty_cache())
    finally:
        plan.lease.release()
    b = plan.boundary
    assert b <= len(tokens) - 1 and b % P == 0
    vals, ring = fake_state(tokens, b)
    k = np.asarray(cache.layers[0].k)[0, 0, :, 0]
    np.testing.assert_array_equal(k[:b], vals[:b])
    np.testing.assert_array_equal(np.asarray(cache.layers[0].v)[0, 0, :b, 1], -vals[:b])
    assert not np.any(k[b:]), "bytes beyond the boundary must not be restored"
    if b:
        np.testing.assert_array_equal(np.asarray(cache.layers[1].k)[0, 0, :, 0], ring)
    assert int(cache.length[0]) == b == int(cache.layers[1].seen[0])
    return plan


def make_cache(store):
    return PrefixCache(FORMS, device_bytes=2 * 6 * ENTRY, host_bytes=2 * 5 * ENTRY, store_url=store,
                       store_bytes=2 * 12 * ENTRY, max_meta_blocks=12)


tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=CAP - 1)


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp()
        self.pc = make_cache(self.dir)
        self.inserted = []

    def teardown(self):
        self.pc.flush()  # copies still in flight would recreate the directory after it is removed
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(tokens=tokens_st)
    def insert(self, tokens):
        insert(self.pc, tokens)
        self.inserted.append(tokens)

    @rule(tokens=tokens_st)
    def lookup_random(self, tokens):
        check_hit(self.pc, tokens)

    @precondition(lambda self: self.inserted)
    @rule(i=st.integers(0, 1000), extra=st.lists(st.integers(0, 2), max_size=6))
    def lookup_inserted(self, i, extra):
        t = self.inserted[i % len(self.inserted)]
        check_hit(self.pc, (t + extra)[: CAP - 1])

    @rule(form=st.sampled_from(["dense", "swa"]), tier=st.sampled_from(["device", "host", "store"]),
          k=st.integers(1, 6))
    def evict(self, form, tier, k):
        self.pc.evict(form, tier, k)

    @rule()
    def flush(self):
        self.pc.flush()

    @rule()
    def restart(self):
        self.pc.flush()
        self.pc = make_cache(self.dir)

    @invariant()
    def bookkeeping(self):
        pc = self.pc
        assert_pool_bookkeeping(pc)
        with pc.lock:
            for _, tree in pc.trees.values():
                for blk in tree.iter_blocks():
                    for e in list(blk.path.values()) + list(blk.snap.values()):
                        assert e.pins == 0  # every lease was released
                        assert (e.slot is not None) == (e in pc.members[e.form]["device"])
                        assert (e.host is not None) == (e in pc.members[e.form]["host"])


PrefixCacheMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None,
                                                suppress_health_check=[HealthCheck.too_slow])
TestPrefixCacheMachine = PrefixCacheMachine.TestCase


def test_threads_racing_lookups_inserts_evictions():
    pc = PrefixCache(FORMS, device_bytes=2 * 8 * ENTRY, host_bytes=2 * 6 * ENTRY)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 2, rng.integers(5, CAP - 1))) for _ in range(12)]
    errors, hits = [], []

    def worker(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(40):
                t = prompts[r.integers(len(prompts))]
                op = r.integers(3)
                if op == 0:
                    insert(pc, t)
                elif op == 1:
                    hits.append(check_hit(pc, t).boundary)
                else:
                    pc.evict(["dense", "swa"][r.integers(2)], ["device", "host"][r.integers(2)], int(r.integers(1, 4)))
        except Exception as e:  # noqa: BLE001 - reported below with the thread's seed
            errors.append((seed, repr(e)))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert any(h > 0 for h in hits)
