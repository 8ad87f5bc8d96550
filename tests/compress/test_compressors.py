"""Draft compressors and draft forms: packing, quantization error, selections, the draft forward, byte ratios."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import load
from kvjax.cache.draft import QuantizedKV, RecentKV, pack_codes, unpack_codes
from kvjax.models.llama.cache import init_cache
from kvjax.compress import StreamingLLM, make_compressor
from kvjax.compress.base import gather_blocks, gather_tokens, sinks_and_recent, topk_positions
from kvjax.compress.snapkv import avg_pool
from kvjax.decode import steps
from kvjax.models.llama.draft import draft_forward


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_roundtrip_and_layout(bits):
    codes = jax.random.randint(jax.random.key(0), (2, 3, 5, 16), 0, 2**bits).astype(jnp.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (2, 3, 5, 16 * bits // 8)
    np.testing.assert_array_equal(unpack_codes(packed, bits), codes)
    per = 8 // bits  # element d in byte d // per at bit (d % per) * bits
    c = np.asarray(codes)[0, 0, 0]
    byte0 = sum(int(c[d]) << (d * bits) for d in range(per))
    assert int(packed[0, 0, 0, 0]) == byte0


@pytest.mark.parametrize("bits", [2, 4])
def test_quantize_error_within_half_step(bits):
    k = jax.random.normal(jax.random.key(1), (1, 2, 64, 64))
    v = jax.random.normal(jax.random.key(2), (1, 2, 64, 64))
    v = v.at[0, 0, 3].set(0.5)  # a zero-range token: scale 1, exact
    q = QuantizedKV.quantize(k, v, jnp.arange(64)[None], bits=bits, group=32)
    assert q.k_scale.shape == (1, 2, 2, 64) and q.v_scale.shape == (1, 2, 64, 1)
    kd, vd, _ = q.dense()
    assert np.all(np.abs(kd - k) <= np.repeat(q.k_scale, 32, axis=2) / 2 + 1e-6)
    assert np.all(np.abs(vd - v) <= q.v_scale / 2 + 1e-6)
    np.testing.assert_allclose(vd[0, 0, 3], 0.5, atol=1e-7)
    assert q.nbytes() < (k.nbytes + v.nbytes) / (3 if bits == 4 else 5)


def test_sinks_and_recent_positions():
    pos = sinks_and_recent(jnp.asarray([100, 6]), 4, 8)
    assert pos[0].tolist() == [0, 1, 2, 3] + list(range(92, 100))
    assert pos[1].tolist() == list(range(6)) + [-1] * 6


def test_topk_positions_sorted_valid_per_head():
    sc = jnp.asarray([[[5.0, 1, 4, 3, 9, 0], [0, 1, 2, 3, 4, 5]]])
    pos = topk_positions(sc, jnp.asarray([5]), 3)
    assert pos.tolist() == [[[0, 2, 4], [2, 3, 4]]]  # slot 5 is beyond the length
    pos = topk_positions(sc, jnp.asarray([2]), 3)
    assert pos.tolist() == [[[0, 1, -1], [0, 1, -1]]]


@pytest.mark.parametrize("slots", [128, 100])  # 100: slots not a multiple of the block -> the per-row gather
def test_gather_blocks_copies_exactly_what_gather_tokens_does(slots):
    """Whole-block selections (one block cut short by the end, one wholly masked) give the same array as the
    per-row gather: the same values, zeros where masked."""
    B, K, D, block = 2, 3, 8, 16
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, K, slots, D)), jnp.float32)
    blocks = np.array([[[0, 2, 5], [1, 3, 4], [0, 1, 2]], [[2, 4, 5], [0, 5, 6], [3, 4, 6]]])
    pos = (blocks[..., None] * block + np.arange(block)).astype(np.int32)
    pos = np.where(pos < 90, pos, -1)  # an end at position 90: block 5 cut short, block 6 gone
    pos = jnp.asarray(pos.reshape(B, K, -1))
    got = gather_blocks(x, pos, block)
    assert got.shape == (B, K, 3 * block, D)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(gather_tokens(x, pos)))
    assert not np.asarray(got)[np.asarray(pos) < 0].any()


def test_block_mass_is_the_softmax_mass_per_block():
    """Refresh's scores against their definition: each query row's softmax over the keys it can see, summed over the
    rows and each KV head's query group, per block of keys; masked and empty slots get none."""
    from kvjax.models.attention_scores import block_mass

    B, R, N, K, S, D, block = 2, 2, 6, 3, 40, 8, 16
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, R, N, D)).astype(np.float32)
    k = rng.standard_normal((B, K, S, D)).astype(np.float32)
    k_pos = np.where(np.arange(S) < 35, np.arange(S), -1)[None].repeat(B, 0).astype(np.int32)
    q_pos = np.array([[20, 34], [33, 34]], np.int32)
    got = np.asarray(block_mass(jnp.asarray(q), jnp.asarray(k), jnp.asarray(q_pos), jnp.asarray(k_pos), block))
    want = np.zeros((B, K, 3))
    G = N // K
    for b in range(B):
        for h in range(K):
            for r in range(R):
                for g in range(G):
                    s = k[b, h] @ q[b, r, h * G + g] / np.sqrt(D)
                    vis = (k_pos[b] >= 0) & (k_pos[b] <= q_pos[b, r])
                    p = np.where(vis, np.exp(s - s[vis].max()), 0.0)
                    p /= p.sum()
                    want[b, h] += np.add.reduceat(np.pad(p, (0, 8)), [0, 16, 32])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.sum(-1), R * G, rtol=1e-5)


def test_avg_pool_same_length_kernel5():
    x = jnp.zeros((1, 9)).at[0, 4].set(5.0)
    np.testing.assert_allclose(avg_pool(x, 5)[0], [0, 0, 1, 1, 1, 1, 1, 0, 0])


def test_recent_ring_write_rollback():
    r = RecentKV.empty(1, 1, 4, 2)
    kv = jnp.arange(6, dtype=jnp.float32).reshape(1, 3, 1, 2)
    r = r.write(kv, kv, jnp.asarray([[5, 6, 7]]), jnp.asarray([3]))
    assert sorted(r.pos[0].tolist()) == [-1, 5, 6, 7]
    r = r.rollback(jnp.asarray([6]))
    assert sorted(r.pos[0].tolist()) == [-1, -1, -1, 5]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_lossless_draft_forward_matches_full_forward(hf_model_dir, name):
    """A draft that keeps every prompt token is the full model: logits agree to float tolerance."""
    m = load(hf_model_dir(name)[1])
    prompt = np.random.default_rng(0).integers(0, 97, 40).astype(np.int32)
    full = init_cache(m.config, 1, 256)
    _, full = steps.prefill(m, full, prompt, chunk=64)
    dc = StreamingLLM(ratio=1.0)(m.params, m.config, full, prompt, recent_slots=32)
    toks = jnp.asarray([[3, 7, 11]], jnp.int32)
    ld, _ = jax.jit(draft_forward)(m.params, m.config, dc, toks)
    lf, _ = steps.forward_step(m.params, m.config, full, toks, jnp.asarray([3], jnp.int32), family=m.family, impl=m.attention)
    np.testing.assert_allclose(ld, lf, atol=2e-5, rtol=1e-5)


def test_compressors_budget_and_bytes(hf_model_dir):
    m = load(hf_model_dir("llama")[1])
    prompt = np.random.default_rng(1).integers(0, 97, 240).astype(np.int32)
    full = init_cache(m.config, 1, 256)
    _, full = steps.prefill(m, full, prompt, chunk=256)
    full_bytes = sum(l.k.nbytes + l.v.nbytes for l in full.layers) * 240 / 256
    ratios = {}
    for name, kw in [("streaming", {}), ("snapkv", {"obs_window": 16}), ("kvzip", {"chunk": 64, "recent": 8}),
                     ("kivi4", {"residual": 32}), ("kivi2", {"residual": 32}),
                     ("dropquant", {"residual": 32, "chunk": 64})]:
        dc = make_compressor(name, **kw)(m.params, m.config, full, prompt, recent_slots=16)
        ratios[name] = dc.prompt_nbytes() / full_bytes
        for layer in dc.layers:
            for part in layer.parts:
                pos = np.asarray(part.pos)
                assert pos.max() < 240
                rows = pos.reshape(-1, pos.shape[-1])
                for row in rows:  # no position kept twice within a head
                    kept = row[row >= 0]
                    assert kept.size == np.unique(kept).size
        if name in ("snapkv", "kvzip"):
            pos = np.asarray(dc.layers[0].parts[0].pos)
            assert pos.shape[-1] == 64  # 240 / 4 rounded up to 32
            assert np.all(np.isin([0, 1, 2, 3, 239], pos[0, 0]))  # sinks and the window kept
    assert 0.2 < ratios["streaming"] < 0.35 and 0.2 < ratios["snapkv"] < 0.4
    assert ratios["kivi2"] < ratios["kivi4"] < 0.45
    assert ratios["dropquant"] < ratios["kivi4"]


def test_unknown_compressor_is_loud():
    with pytest.raises(ValueError, match="unknown compressor"):
        make_compressor("h2o")
