"""The refreshing drafter: exact (tokens and logits equal the reference, resident and offloaded, greedy and sampled),
its scores come from the verify pass without changing it, the selection follows the static budget and really moves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.compress.refresh import Refresh, RefreshSpec, select_blocks
from kvjax.decode import steps, verify
from kvjax.decode.refresh import refresh_step


def _prompt(n=120, seed=0):
    return np.random.default_rng(seed).integers(0, 97, n).astype(np.int32)


KW = dict(ratio=4.0, block=8, recent_blocks=2, obs_window=8, min_drafts=0)  # min_drafts 0: every `period`-th round


def test_refresh_is_due_after_period_rounds_and_min_drafts():
    spec = RefreshSpec(block=4, budget_blocks=4, sink_blocks=1, recent_blocks=1, period=2, min_drafts=16)
    assert not spec.due(1, 32)  # one verification: period 2 not reached
    assert not spec.due(3, 12)  # three short rounds of x = 4: too few drafts
    assert spec.due(4, 16) and spec.due(2, 64)
    assert spec.after_verify((3, 12), 4) == (True, (0, 0))  # the fourth round of 4 drafts re-selects and resets
    assert spec.after_verify((0, 0), 4) == (False, (1, 4))
    assert Refresh().spec(1000).min_drafts == 32  # the default: adaptive x down to 2-4 re-selects every ~32 drafts


@pytest.mark.parametrize("name,offload,temperature,period,block", [
    ("llama", False, 0.0, 1, 8),
    # CI time: offloaded + sampled refresh stays in CI through test_refresh_over_a_quantized_bulk_is_exact[refresh_kivi4]
    pytest.param("llama", True, 0.8, 1, 8, marks=pytest.mark.slow),
    # the default block: the re-selections take the verify's own masses (native kernel), here from a lent host copy
    ("llama", True, 0.8, 1, 16),
    pytest.param("qwen2", False, 0.0, 2, 8, marks=pytest.mark.slow),  # CI time: the other families run other drafters
    pytest.param("mistral", True, 0.0, 1, 8, marks=pytest.mark.slow),
    ("llama", False, 0.0, None, 8)])  # None: the default schedule (re-select once 32 tokens were drafted)
def test_refresh_is_exact(hf_model_dir, name, offload, temperature, period, block):
    m = kvjax.load(hf_model_dir(name)[1])
    p = _prompt(seed=1)
    r = kvjax.reference_decode(m, p, 24, draft_len=4, temperature=temperature, seed=2, return_logits=True)
    ref, ref_lg = r.tokens, r.logits
    kw = dict(KW, period=period) if period is not None else {k: v for k, v in KW.items() if k != "min_drafts"}
    kw["block"] = block
    g = kvjax.generate_vericache(m, p, 24, compressor="refresh", compressor_kw=kw, draft_len=4, offload=offload,
                                 temperature=temperature, seed=2, ignore_eos=True, return_logits=True)
    out, st, lg = g.tokens, g.stats, g.logits
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(lg, ref_lg)
    assert st["verifications"] >= 24 / 5
    if name != "mistral":  # mistral's layers are all sliding: its draft is its rings, nothing to select
        assert 0 < st["draft_bytes_ratio"] < 1


def test_the_verify_hands_out_its_rows_queries_and_they_score_the_cache(hf_model_dir):
    from kvjax.models.llama.refresh import refresh_masses

    m = kvjax.load(hf_model_dir("qwen2")[1])
    cache = m.family.init_cache(m.config, 1, 256, m.cache_dtype)
    _, cache = steps.prefill(m, cache, _prompt(60))
    toks = jnp.asarray([[5, 9, 11, 2, 7]], jnp.int32)
    logits, after, aux = jax.jit(lambda c: m.family.verify_forward(m.params, m.config, c, toks,
                                                                   jnp.asarray([5], jnp.int32)))(cache)
    queries, q_pos, fused = aux
    np.testing.assert_array_equal(np.asarray(q_pos), [[60, 64]])  # the first and the last verify row
    for block in (8, 16):  # 16: the verify's own masses where the native kernel ran it; 8: scored from the queries
        masses = [x for x in refresh_masses(after, aux, block=block) if x is not None]
        assert masses and all(x.shape == (1, m.config.num_kv_heads, 256 // block) for x in masses)
        for x in masses:  # two rows, each a distribution over the visible keys, summed over the query group
            np.testing.assert_allclose(np.asarray(x).sum(-1), 2 * m.config.num_heads // m.config.num_kv_heads,
                                       rtol=1e-4)
    scored = refresh_masses(after, (queries, q_pos, (None,) * len(fused)), block=16)
    assert any(f is not None for f in fused) == (m.attention == "native")
    for f, s in zip(fused, scored):  # the verify's masses are its rows' over the cache it read: the queries' scores
        if f is not None:
            np.testing.assert_allclose(np.asarray(f), np.asarray(s), rtol=1e-4, atol=1e-6)


def test_select_blocks_respects_budget_sinks_recent_and_the_ring():
    spec = RefreshSpec(block=4, budget_blocks=4, sink_blocks=1, recent_blocks=1, period=1)
    mass = jnp.asarray([[[0.0, 0.1, 5.0, 0.2, 3.0, 0.3, 9.0, 0.0]]])  # [B=1, K=1, 8 blocks]
    pos = np.asarray(select_blocks(mass, jnp.asarray([22]), spec))[0, 0]  # tokens 0..21 are candidates
    blocks = sorted({p // 4 for p in pos if p >= 0})
    assert blocks == [0, 2, 4, 5]  # sink 0, the two best below the end (2, 4), the block holding token 21 (5)
    assert pos.size == 16 and (pos < 22).all() and (pos[pos >= 0] == np.sort(pos[pos >= 0])).all()
    assert (pos == -1).sum() == 2  # block 5 holds tokens 20..23; 22 and 23 are the ring's


def _one_refreshed_round(m, full, first, dc):
    """Draft 4 tokens, verify them, re-select the draft from the verification: the draft after one round."""
    seed = jnp.zeros((1,), jnp.int32)
    drafts, _, dc = kvjax.decode.draft.draft_step(m.params, m.config, dc, first, seed, x=4, family=m.family,
                                                  impl=m.attention)
    qlog = jnp.zeros((1, 1, m.config.vocab_size), jnp.float32)
    _, _, full, dc, _, aux = verify.verify_step(m.params, m.config, full, dc, first, drafts, qlog, seed,
                                                family=m.family, impl=m.attention)
    return refresh_step(dc, full, aux, family=m.family)


def test_the_selection_moves_with_the_decode(hf_model_dir):
    m = kvjax.load(hf_model_dir("llama")[1])
    p = _prompt(160, seed=3)
    full, first = kvjax.decode.vericache.prefill_for(m, p, 16, max_draft=4)
    dc = Refresh(**KW)(m.params, m.config, full, p, recent_slots=32)
    before = [np.asarray(l.parts[0].pos) for l in dc.layers]
    dc = _one_refreshed_round(m, full, first, dc)
    after = [np.asarray(l.parts[0].pos) for l in dc.layers]
    assert all(a.shape == b.shape for a, b in zip(after, before))  # static budget
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))  # re-selected


def test_refresh_compiles_nothing_after_warm_up(hf_model_dir, compile_count):
    m = kvjax.load(hf_model_dir("llama")[1])
    for n in (12, 20):
        kvjax.generate_vericache(m, _prompt(seed=4), n, compressor="refresh", compressor_kw=dict(KW, period=2),
                                 draft_len=3, ignore_eos=True)
        if n == 12:
            warm = (compile_count(verify.verify_step), compile_count(refresh_step))
    assert (compile_count(verify.verify_step), compile_count(refresh_step)) == warm


def test_refresh_in_the_scheduler_is_exact(hf_model_dir):
    m = kvjax.load(hf_model_dir("llama")[1])
    prompts = [_prompt(140, seed=6), _prompt(100, seed=7), _prompt(120, seed=8)]
    outs = kvjax.generate_vericache(m, prompts, 16, compressor="refresh", compressor_kw=KW, draft_len=4,
                                    ignore_eos=True)
    for p, g in zip(prompts, outs):
        np.testing.assert_array_equal(g.tokens, kvjax.reference_decode(m, p, 16, draft_len=4).tokens)
        assert g.stats["compressor"] == "refresh"


@pytest.mark.parametrize("name,offload,temperature", [
    pytest.param("refresh_kivi2", False, 0.0, marks=pytest.mark.slow), ("refresh_kivi4", True, 0.8)])  # CI: one bulk
def test_refresh_over_a_quantized_bulk_is_exact(hf_model_dir, name, offload, temperature):
    m = kvjax.load(hf_model_dir("llama")[1])
    p = _prompt(seed=9)
    r = kvjax.reference_decode(m, p, 20, draft_len=4, temperature=temperature, seed=3, return_logits=True)
    ref, ref_lg = r.tokens, r.logits
    kw = {k: v for k, v in KW.items() if k != "ratio"}
    g = kvjax.generate_vericache(m, p, 20, compressor=name, compressor_kw=kw, draft_len=4, offload=offload,
                                 temperature=temperature, seed=3, ignore_eos=True, return_logits=True)
    out, st, lg = g.tokens, g.stats, g.logits
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(lg, ref_lg)
    assert 0 < st["draft_bytes_ratio"] < 1


def _bulk_and_selection(dc):
    """Per full-attention layer: (positions visible in the bulk, positions held at full precision) per head."""
    from kvjax.cache.draft import QuantizedBulk

    out = []
    for layer in dc.layers:
        bulk = next(p for p in layer.parts if isinstance(p, QuantizedBulk))
        seen, sel = np.asarray(bulk.view().pos)[0], np.asarray(layer.parts[0].pos)[0]
        out.append([(set(seen[h][seen[h] >= 0]), set(sel[h][sel[h] >= 0])) for h in range(seen.shape[0])])
    return out


def test_the_bulk_hides_exactly_the_blocks_held_at_full_precision(hf_model_dir):
    """Every prompt token is attended once: in the full-precision selection or in the bulk, never both — after
    compression and after a re-selection, which changes which bulk slots are hidden but not the codes."""
    m = kvjax.load(hf_model_dir("llama")[1])
    p = _prompt(150, seed=5)
    full, first = kvjax.decode.vericache.prefill_for(m, p, 16, max_draft=4)
    dc = kvjax.compress.make_compressor("refresh_kivi2", **{k: v for k, v in KW.items() if k != "ratio"})(
        m.params, m.config, full, p, recent_slots=32)
    codes = [np.asarray(l.parts[1].q.k_codes) for l in dc.layers]
    before = _bulk_and_selection(dc)
    dc = _one_refreshed_round(m, full, first, dc)
    after = _bulk_and_selection(dc)
    for state in (before, after):
        for heads in state:
            for seen, sel in heads:
                assert not seen & sel
                assert seen | {s for s in sel if s < len(p)} == set(range(len(p)))
                assert len(seen) < len(p)  # some blocks are held at full precision
    assert before != after  # re-selected
    for c, l in zip(codes, dc.layers):
        np.testing.assert_array_equal(c, np.asarray(l.parts[1].q.k_codes))


def test_the_first_selection_takes_the_prompt_rows_masses_from_their_attention(hf_model_dir):
    """`prompt_block_masses` (the first selection's scores): where the native kernel runs, every observed row's
    masses come from its attention pass (no `kvjax_block_mass` pass over the keys); they agree with the masses the
    queries score on their own (a block the kernel cannot sum: 24 does not divide its key block)."""
    from kvjax.models.llama.refresh import prompt_block_masses

    m = kvjax.load(hf_model_dir("qwen2")[1])
    cache = m.family.init_cache(m.config, 1, 240, m.cache_dtype)
    _, cache = steps.prefill(m, cache, _prompt(60))
    toks, start = jnp.asarray(_prompt(60)[None, -8:]), jnp.asarray([52], jnp.int32)
    hlo = prompt_block_masses.lower(m.params, m.config, cache, toks, start, block=8).as_text()
    assert ("kvjax_attend_mass" in hlo) == (m.attention == "native")
    assert "kvjax_block_mass" not in hlo or m.attention != "native"
    from pallas_kernels import native

    assert not native.mass_block_fits(24, native.default_block(m.config.head_dim))  # so block 24 is scored apart
    fused = prompt_block_masses(m.params, m.config, cache, toks, start, block=8)
    scored = prompt_block_masses(m.params, m.config, cache, toks, start, block=24)
    G = m.config.num_heads // m.config.num_kv_heads
    assert any(f is not None for f in fused)
    for f, s in zip(fused, scored):
        if f is None:
            continue
        np.testing.assert_allclose(np.asarray(f).sum(-1), 8 * G, rtol=1e-4)  # 8 rows, each a distribution
        np.testing.assert_allclose(np.asarray(f).reshape(1, -1, 10, 3).sum(-1), np.asarray(s), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("n", [300, 262])  # the last 8 rows in one chunk; split over two (256-token chunks)
def test_the_prefill_hands_out_the_first_selections_masses(hf_model_dir, n):
    """A prefill asked for a drafter's `prompt_scoring` leaves its cache and logits bit for bit as they were and
    hands out the masses `prompt_block_masses` computes from its own forward of the last rows (summed over the
    chunks that hold them); a draft built from them is the draft `prepare` builds, and VeriCache run from them is
    the reference's output."""
    from kvjax.decode import vericache as vc
    from kvjax.models.llama.refresh import prompt_block_masses

    m = kvjax.load(hf_model_dir("llama")[1])
    comp = Refresh(**dict(KW, block=16))
    assert comp.prompt_scoring == (8, 16)
    p = _prompt(n, seed=3)
    plain = steps.prefill(m, m.family.init_cache(m.config, 1, 512, m.cache_dtype), p)
    last, full, masses = steps.prefill(m, m.family.init_cache(m.config, 1, 512, m.cache_dtype), p, scoring=(8, 16))
    np.testing.assert_array_equal(np.asarray(last), np.asarray(plain[0]))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(plain[1])))
    if m.attention != "native":
        assert masses is None  # the XLA attention hands out none: the drafter scores the prompt itself
        return
    want = prompt_block_masses(m.params, m.config, full, jnp.asarray(p[None, -8:]), jnp.asarray([n - 8], jnp.int32),
                               block=16)
    assert any(w is not None for w in want)
    for got, w in zip(masses, want):
        assert (got is None) == (w is None)
        if w is not None:
            np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-5, atol=1e-6)
    own = comp(m.params, m.config, full, p, recent_slots=16)
    given = comp(m.params, m.config, full, p, recent_slots=16, prompt_masses=masses)
    for a, b in zip(own.layers, given.layers):
        for pa, pb in zip(a.parts, b.parts):
            np.testing.assert_array_equal(np.asarray(pa.pos), np.asarray(pb.pos))  # the same blocks kept
    with pytest.raises(ValueError, match="blocks of another size"):
        Refresh(**dict(KW, block=8))(m.params, m.config, full, p, recent_slots=16, prompt_masses=masses)
    ref = kvjax.reference_decode(m, p, 12, draft_len=4).tokens
    full2, first, *scored = vc.prefill_for(m, p, 12, max_draft=4, scoring=comp.prompt_scoring)
    out, st = vc.run_vericache(m, full2, first, p, 12, compressor=comp, draft_len=4, prompt_masses=scored[0])
    np.testing.assert_array_equal(out, ref)
