"""A draft whose prompt parts are bf16 (`draft_dtype="bfloat16"`: half the prompt-part bytes) or int8 codes with
per-slot scales (`"int8"`: a quarter), the recent ring f32, the refreshing drafter's re-selections keeping the dtype
without recompiling, and VeriCache's output still the reference decoder's bit for bit (verification reads the f32
full cache)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.cache.draft import Int8KV, SparseKV
from kvjax.compress import make_compressor
from kvjax.decode import steps
from kvjax.decode.refresh import refresh_step

REFRESH = dict(ratio=4.0, block=8, recent_blocks=2, obs_window=8, min_drafts=0)  # re-select after every verify


def _prompt(n=120, seed=1):
    return np.random.default_rng(seed).integers(0, 97, n).astype(np.int32)


@pytest.mark.parametrize("name,kw", [
    # CI time: tests/decode/test_draft_weights.py::test_bf16_draft_weights_keep_vericache_exact runs refresh and snapkv
    # with a bf16 draft cache and bf16 draft weights against reference_decode in CI
    pytest.param("refresh", REFRESH, marks=pytest.mark.slow),
    pytest.param("snapkv", dict(ratio=4.0, obs_window=8), marks=pytest.mark.slow)])  # CI time: one static drafter
def test_bf16_draft_vericache_equals_the_reference(hf_model_dir, name, kw):
    m = kvjax.load(hf_model_dir("llama")[1])
    p = _prompt()
    ref = kvjax.reference_decode(m, p, 20, draft_len=4, return_logits=True)
    g = kvjax.generate_vericache(m, p, 20, compressor=name, compressor_kw=dict(kw, draft_dtype="bfloat16"),
                                 draft_len=4, ignore_eos=True, return_logits=True)
    np.testing.assert_array_equal(g.tokens, ref.tokens)
    np.testing.assert_array_equal(g.logits, ref.logits)
    assert g.stats["verifications"] >= 4
    # static shapes and dtypes: only the first round compiles (draft, verify and -- refresh -- re-selection steps);
    # a re-selection that changed the parts' dtype would recompile the next round's draft
    assert g.stats["compile_rounds"] <= 1 and g.stats["timed_rounds"] >= 3


def _drafts(m, name, kw):
    cache = m.family.init_cache(m.config, 1, 256, m.cache_dtype)
    _, cache = steps.prefill(m, cache, _prompt())
    return cache, {dt: make_compressor(name, **kw, draft_dtype=dt)(m.params, m.config, cache, _prompt(),
                                                                   recent_slots=32)
                   for dt in ("float32", "bfloat16")}


@pytest.mark.parametrize("name,kw", [("refresh", REFRESH), ("streaming", dict(ratio=4.0)), ("kivi4", {})])
def test_prompt_parts_are_bf16_at_half_the_bytes_and_the_ring_stays_f32(hf_model_dir, name, kw):
    m = kvjax.load(hf_model_dir("llama")[1])
    _, d = _drafts(m, name, kw)
    checked = 0
    for l32, l16 in zip(d["float32"].layers, d["bfloat16"].layers):
        assert l16.recent.k.dtype == jnp.float32 and l16.recent.nbytes() == l32.recent.nbytes()
        for a, b in zip(l32.parts, l16.parts):
            if l16.window is None and isinstance(b, SparseKV):
                assert b.k.dtype == b.v.dtype == jnp.bfloat16 and a.k.dtype == jnp.float32
                assert b.k.nbytes + b.v.nbytes == (a.k.nbytes + a.v.nbytes) // 2
                np.testing.assert_array_equal(np.asarray(b.pos), np.asarray(a.pos))  # the same tokens kept
                np.testing.assert_array_equal(np.asarray(b.k), np.asarray(a.k.astype(jnp.bfloat16)))
                checked += 1
    assert checked
    assert d["bfloat16"].prompt_nbytes() < d["float32"].prompt_nbytes()


def test_a_refresh_keeps_the_draft_dtype(hf_model_dir):
    m = kvjax.load(hf_model_dir("llama")[1])
    cache, d = _drafts(m, "refresh", REFRESH)
    d["int8"] = make_compressor("refresh", **REFRESH, draft_dtype="int8")(m.params, m.config, cache, _prompt(),
                                                                         recent_slots=32)
    toks = jnp.asarray([[5, 9, 11, 2, 7]], jnp.int32)
    _, after, aux = jax.jit(lambda c: m.family.verify_forward(m.params, m.config, c, toks,
                                                               jnp.asarray([5], jnp.int32)))(cache)
    for dt, want in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16), ("int8", jnp.int8)):
        new = refresh_step(d[dt], after, aux, family=m.family)
        parts = [p for l in new.layers if l.window is None for p in l.parts if isinstance(p, (SparseKV, Int8KV))]
        assert parts and all(p.k.dtype == p.v.dtype == want for p in parts)


@pytest.mark.parametrize("name,kw", [("refresh", REFRESH), ("snapkv", dict(ratio=4.0, obs_window=8)),
                                     ("kivi4", {})])
def test_int8_prompt_parts_keep_the_tokens_at_a_quarter_of_the_bytes(hf_model_dir, name, kw):
    """`draft_dtype="int8"`: the same kept tokens as f32, as codes and a scale per head and slot (`Int8KV`), each
    value within half a quantisation step of the f32 part's; the ring stays f32."""
    m = kvjax.load(hf_model_dir("llama")[1])
    cache, d = _drafts(m, name, kw)
    q8 = make_compressor(name, **kw, draft_dtype="int8")(m.params, m.config, cache, _prompt(), recent_slots=32)
    checked = 0
    for l32, l8 in zip(d["float32"].layers, q8.layers):
        assert l8.recent.k.dtype == jnp.float32
        for a, b in zip(l32.parts, l8.parts):
            if l8.window is None and isinstance(b, Int8KV):
                assert b.k.dtype == b.v.dtype == jnp.int8 and b.k.nbytes == a.k.nbytes // 4
                np.testing.assert_array_equal(np.asarray(b.pos), np.asarray(a.pos))
                for x, (got, scale) in ((a.k, (b.dense()[0], b.k_scale)), (a.v, (b.dense()[1], b.v_scale))):
                    assert np.all(np.abs(np.asarray(got) - np.asarray(x)) <= np.asarray(scale)[..., None] / 2 + 1e-7)
                checked += 1
    assert checked and q8.prompt_nbytes() < d["bfloat16"].prompt_nbytes()


def test_int8_draft_vericache_equals_the_reference(hf_model_dir):
    """An int8 draft cache (refresh, re-selecting after every verify) changes acceptance at most, never the output:
    tokens and logits equal the reference decoder's; only the first round compiles."""
    m = kvjax.load(hf_model_dir("llama")[1])
    p = _prompt()
    ref = kvjax.reference_decode(m, p, 20, draft_len=4, return_logits=True)
    g = kvjax.generate_vericache(m, p, 20, compressor="refresh", compressor_kw=dict(REFRESH, draft_dtype="int8"),
                                 draft_len=4, ignore_eos=True, return_logits=True)
    np.testing.assert_array_equal(g.tokens, ref.tokens)
    np.testing.assert_array_equal(g.logits, ref.logits)
    assert g.stats["verifications"] >= 4 and g.stats["compile_rounds"] <= 1


@pytest.mark.parametrize("name", ["refresh", "snapkv", "streaming", "kivi4", "refresh_kivi4"])
@pytest.mark.parametrize("bad", ["float16", "bf16", "int4", None])
def test_an_unknown_draft_dtype_is_one_clear_error(name, bad):
    with pytest.raises(ValueError, match="draft_dtype"):
        make_compressor(name, draft_dtype=bad)
    assert make_compressor(name, draft_dtype="bfloat16").draft_dtype == "bfloat16"
    assert make_compressor(name).draft_dtype == "float32"


@pytest.mark.slow  # a batch through the scheduler (~40 s on CI each)
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_bf16_and_int8_refresh_drafts_in_the_scheduler_are_exact(hf_model_dir, dtype):
    """The scheduler re-selects a row without its parts and writes them into the batch's (bf16 / int8) slots."""
    m = kvjax.load(hf_model_dir("llama")[1])
    prompts = [_prompt(140, seed=6), _prompt(100, seed=7)]
    outs = kvjax.generate_vericache(m, prompts, 16, compressor="refresh",
                                    compressor_kw=dict(REFRESH, draft_dtype=dtype), draft_len=4, ignore_eos=True)
    for p, g in zip(prompts, outs):
        np.testing.assert_array_equal(g.tokens, kvjax.reference_decode(m, p, 16, draft_len=4).tokens)


def test_max_kept_caps_the_budget_and_is_checked():
    c = make_compressor("snapkv", ratio=4.0, max_kept=256)
    assert (c.budget(512), c.budget(4096)) == (128, 256)
    for bad in (0, 31, 2.5, True):
        with pytest.raises(ValueError, match="max_kept"):
            make_compressor("snapkv", max_kept=bad)
