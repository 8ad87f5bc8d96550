"""DeepSeek-V4 cached decoding equals kvjax's own full forward (within 1e-5) at every step: prefill split at arbitrary
points (per row), one-token decode and multi-token verify blocks across window and compression boundaries; the forms
keep static shapes; indexer top-k ties break toward the lowest entry index."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import make_v4

import kvjax
from kvjax.cache.hybrid import CompressedKV, SharedKVWindow, Tail
from kvjax.models.deepseek_v4.cache import init_cache
from kvjax.models import deepseek_v4
from kvjax.decode import steps

TOL = 1e-5
SEQ = 45  # m = 4, m' = 8, W = 8: crosses every boundary several times


@pytest.fixture(scope="module")
def model():
    return kvjax.load(make_v4("hybrid")[1])


def full(model, ids):
    """Reference: kvjax's full forward of one sequence (empty cache, the whole prompt as one padded chunk)."""
    return kvjax.logits(model, ids)


def run_schedule(model, seqs, schedule, T):
    """Feed rows of `seqs` [B, S] through the cache, `schedule[i][b]` tokens of row b at step i (chunk width T).

    Returns (per-row concatenated logits, final cache)."""
    B = len(seqs)
    cache = init_cache(model.config, B, 64)
    done = [0] * B
    outs = [[] for _ in range(B)]
    for ns in schedule:
        buf = np.zeros((B, T), np.int32)
        for b, n in enumerate(ns):
            buf[b, :n] = seqs[b][done[b]:done[b] + n]
        lg, cache = steps.forward_step(model.params, model.config, cache, jnp.asarray(buf), jnp.asarray(ns, jnp.int32), family=model.family,
                                       impl=model.attention)
        lg = np.asarray(lg)
        for b, n in enumerate(ns):
            outs[b].append(lg[b, :n])
            done[b] += n
    return [np.concatenate(o) for o in outs], cache


def random_splits(rs, total, hi):
    out, s = [], 0
    while s < total:
        n = min(total - s, int(rs.randint(0, hi + 1)))  # 0: this row idles while the other advances
        out.append(n)
        s += n
    return out


def test_prefill_split_at_arbitrary_points(model):
    rs = np.random.RandomState(0)
    seqs = rs.randint(0, model.config.vocab_size, size=(2, SEQ))
    refs = [full(model, s) for s in seqs]
    compiled = None
    for _ in range(3):
        a, b = random_splits(rs, SEQ, 8), random_splits(rs, SEQ, 8)
        n = max(len(a), len(b))
        schedule = list(zip(a + [0] * (n - len(a)), b + [0] * (n - len(b))))
        outs, cache = run_schedule(model, seqs, schedule, 8)
        for o, r in zip(outs, refs):
            assert np.abs(o - r).max() < TOL, np.abs(o - r).max()
        compiled = compiled or steps.forward_step._cache_size()
        assert steps.forward_step._cache_size() == compiled  # new split points compile nothing
    # the forms agree on how much they hold
    st = cache.layers[1]
    assert int(cache.length[0]) == SEQ and int(st.window.seen[0]) == SEQ and int(st.tail.seen[0]) == SEQ
    assert int(st.compressed.count[0]) == SEQ // 4 and int(st.indexer.keys.count[0]) == SEQ // 4
    assert int(cache.layers[2].compressed.count[0]) == SEQ // 8


def test_decode_one_token_across_boundaries(model):
    seqs = np.random.RandomState(1).randint(0, model.config.vocab_size, size=(2, SEQ))
    # row 0: prefill 5 then decode 40 tokens; row 1: prefill 13 then decode 32 (then idles)
    pre, cache = run_schedule(model, seqs, [(5, 8), (0, 5)], 8)
    outs = [[o] for o in pre]
    done = [5, 13]
    while done[0] < SEQ:
        ns = [1, 1 if done[1] < SEQ else 0]
        tok = np.array([[seqs[b][min(done[b], SEQ - 1)]] for b in range(2)], np.int32)
        lg, cache = steps.forward_step(model.params, model.config, cache, jnp.asarray(tok), jnp.asarray(ns, jnp.int32), family=model.family,
                                       impl=model.attention)
        for b in range(2):
            if ns[b]:
                outs[b].append(np.asarray(lg)[b, :1])
                done[b] += 1
    for b in range(2):
        err = np.abs(np.concatenate(outs[b]) - full(model, seqs[b])).max()
        assert err < TOL, (b, err)


def test_verify_blocks_after_prefill(model):
    # x = 4 drafts + 1: blocks of 5 after a 13-token prefill, ending in a partial block
    seqs = np.random.RandomState(2).randint(0, model.config.vocab_size, size=(2, SEQ))
    schedule = [(5, 5), (5, 5), (3, 5)] + [(5, 5)] * 6 + [(2, 0)]
    outs, _ = run_schedule(model, seqs, schedule, 5)
    for o, s in zip(outs, seqs):
        assert np.abs(o - full(model, s)).max() < TOL


def test_indexer_ties_break_to_lowest_index(model):
    # zero indexer head weights: every score is exactly 0, all complete entries tie
    layers = list(model.params["layers"])
    for i in (1, 3):
        attn = dict(layers[i]["attn"])
        attn["indexer"] = dict(attn["indexer"], weights_proj=jnp.zeros_like(attn["indexer"]["weights_proj"]))
        layers[i] = dict(layers[i], attn=attn)
    tied = dataclasses.replace(model, params=dict(model.params, layers=tuple(layers)))
    cfg = model.config
    T = 24
    h = jax.random.normal(jax.random.PRNGKey(0), (1, T, cfg.hidden_size))
    q_res = jax.random.normal(jax.random.PRNGKey(1), (1, T, cfg.q_lora_rank))
    state = init_cache(cfg, 1, 32).layers[1].indexer
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    indexer = jax.jit(deepseek_v4.model._indexer, static_argnums=1)
    _, idx, ok = indexer(tied.params["layers"][1]["attn"]["indexer"], cfg, state, h, q_res, pos,
                         jnp.asarray([T], jnp.int32))
    ready = (np.arange(T) + 1) // cfg.csa_rate
    for t in range(T):
        chosen = sorted(int(i) for i, o in zip(np.asarray(idx[0, t]), np.asarray(ok[0, t])) if o)
        assert chosen == list(range(min(ready[t], cfg.index_topk))), (t, chosen)
    # and the tie rule is the same in one-token decode and in chunks
    seqs = np.random.RandomState(3).randint(0, cfg.vocab_size, size=(2, 30))
    outs, _ = run_schedule(tied, seqs, [(7, 1), (5, 8), (8, 8), (3, 8), (7, 5)], 8)
    for o, s in zip(outs, seqs):
        assert np.abs(o - full(tied, s)).max() < TOL


def test_swa_window_ring_keeps_last_w():
    W = 4
    win = SharedKVWindow(kv=jnp.zeros((1, W, 1)), seen=jnp.zeros((1,), jnp.int32), window=W)
    for n in (3, 6, 1):  # a chunk longer than the ring keeps only its newest W rows
        start = int(win.seen[0])
        new = jnp.arange(start, start + 8, dtype=jnp.float32)[None, :, None]
        win = win.write(new, jnp.asarray([n], jnp.int32))
    pos = np.asarray(win.slot_positions()[0])
    assert sorted(pos) == [6, 7, 8, 9]
    np.testing.assert_array_equal(np.asarray(win.kv[0, :, 0]), pos.astype(np.float32))


@pytest.mark.parametrize("overlap", [True, False])
def test_tail_emits_each_window_once_with_its_tokens(overlap):
    m, d, S = 3, 2, 20
    dp = 2 * d if overlap else d
    tail = Tail(kv=jnp.zeros((1, m, dp)), gate=jnp.zeros((1, m, dp)),
                overlap_kv=jnp.zeros((1, m, d)) if overlap else None,
                overlap_gate=jnp.zeros((1, m, d)) if overlap else None, seen=jnp.zeros((1,), jnp.int32), rate=m)
    comp = CompressedKV(entries=jnp.zeros((1, 8, m * (2 if overlap else 1) * d)), count=jnp.zeros((1,), jnp.int32),
                        rate=m)
    src = np.arange(S * dp, dtype=np.float32).reshape(S, dp)
    done = 0
    for n in (2, 5, 1, 0, 4, 3, 5):
        buf = np.zeros((1, 5, dp), np.float32)
        buf[0, :n] = src[done:done + n]
        win_kv, _, slot_ok, index, ok, tail = tail.absorb(jnp.asarray(buf), jnp.asarray(buf), jnp.asarray([n]))
        flat = jnp.where(slot_ok[..., None], win_kv, -1.0).reshape(1, win_kv.shape[1], -1)
        comp = comp.write(flat, index, ok)
        done += n
    assert int(comp.count[0]) == S // m and int(tail.seen[0]) == S
    for w in range(S // m):
        cur = src[w * m:(w + 1) * m]
        want = cur if not overlap else np.concatenate(
            [src[(w - 1) * m:w * m, :d] if w else -np.ones((m, d), np.float32), cur[:, d:]])
        np.testing.assert_array_equal(np.asarray(comp.entries[0, w]), want.reshape(-1))
