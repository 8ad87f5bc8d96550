"""VeriCache on DeepSeek-V4 through the one engine: drafts from a lossy copy (compressed entries and indexer keys
dropped / quantized, updated incrementally after each verify), the full hybrid state verifies; tokens AND logits equal
the verify-shape reference decoder bit for bit, greedy and sampled, resident and offloaded, with the same arguments
and stats keys as Llama."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import make_v4

import kvjax
from kvjax.decode import steps
from kvjax.errors import UnsupportedFeatureError

PROMPT, NEW = 30, 20  # 30 tokens: 7 CSA entries and 3 HCA entries per layer before decoding starts


@pytest.fixture(scope="module")
def model():
    return kvjax.load(make_v4("hybrid")[1])


def _ids(model, seed=11):
    return np.random.RandomState(seed).randint(0, model.config.vocab_size, size=PROMPT)


_RUNS: dict = {}


def _run(model, comp, kw, temperature, rejection, offload):
    """(reference_decode's Generation, generate_vericache's) for one setting, computed once per module: the lossy
    draft test below checks the CI case's run against plain decoding too (each run compiles the draft/verify steps)."""
    key = (comp, tuple(sorted(kw.items())), temperature, rejection, offload)
    if key not in _RUNS:
        ids = _ids(model)
        r = kvjax.reference_decode(model, ids, NEW, draft_len=4, temperature=temperature, seed=3,
                                   return_logits=True)
        g = kvjax.generate_vericache(model, ids, NEW, compressor=comp, compressor_kw=kw, draft_len=4,
                                     temperature=temperature, seed=3, rejection=rejection, offload=offload,
                                     ignore_eos=True, return_logits=True)
        _RUNS[key] = r, g
    return _RUNS[key]


def test_verify_rows_bitwise_equal_reference_row0(model):
    x = 4
    cache = model.family.init_cache(model.config, 1, 256, model.cache_dtype)
    last, cache = steps.prefill(model, cache, _ids(model))
    toks, ref_rows = [int(jnp.argmax(last))], []
    fwd = jax.jit(lambda *a: model.family.verify_forward(*a)[:2], static_argnums=1)
    c = jax.tree.map(jnp.copy, cache)
    for _ in range(x + 1):
        lg, c = fwd(model.params, model.config, c, jnp.zeros((1, x + 1), jnp.int32).at[0, 0].set(toks[-1]),
                    jnp.ones((1,), jnp.int32))
        ref_rows.append(np.asarray(lg[0, 0]))
        toks.append(int(np.argmax(ref_rows[-1])))
    lg, _ = fwd(model.params, model.config, cache, jnp.asarray([toks[:x + 1]], jnp.int32),
                jnp.asarray([x + 1], jnp.int32))
    for j in range(x + 1):
        np.testing.assert_array_equal(np.asarray(lg[0, j]), ref_rows[j])


DROPQUANT = ("dropquant", dict(ratio=8.0, sinks=0, bits=2), 0.0, False, False)


# CI runs one case (greedy token-dropping + quantizing; verify rows are checked bitwise below); `-m slow` runs
# every pairing (the KIVI-4 sampled and offloaded cases take ~45 s each here).
@pytest.mark.parametrize("comp,kw,temperature,rejection,offload", [
    DROPQUANT,
    pytest.param("streaming", {}, 0.0, False, False, marks=pytest.mark.slow),
    pytest.param("kivi4", {}, 0.8, False, False, marks=pytest.mark.slow),
    pytest.param("streaming", {}, 1.0, True, False, marks=pytest.mark.slow),  # CI time; rejection: test_sampling.py
    # offloaded: the prompt's compressed entries and indexer keys in pinned host memory between verifications
    pytest.param("streaming", {}, 0.0, False, True, marks=pytest.mark.slow),
    pytest.param("kivi4", {}, 0.8, False, True, marks=pytest.mark.slow),  # offload join: its own test below
])
def test_tokens_and_logits_equal_reference(model, comp, kw, temperature, rejection, offload):
    r, g = _run(model, comp, kw, temperature, rejection, offload)
    ref, ref_logits = r.tokens, r.logits
    out, stats, logits = g.tokens, g.stats, g.logits
    if not rejection:  # rejection sampling preserves the distribution, not the token sequence
        np.testing.assert_array_equal(out, ref)
        np.testing.assert_array_equal(logits, ref_logits)
    for key in ("tokens_per_s", "mean_accepted_per_round", "verifications", "draft_bytes_ratio"):
        assert key in stats
    assert 0 < stats["draft_bytes_ratio"] < 1.0
    assert (stats["h2d_bytes_per_token"] > 0) == offload


def test_lossy_draft_really_is_lossy_and_greedy_matches_full_decoding(model):
    full = kvjax.generate(model, _ids(model), NEW, ignore_eos=True)
    _, g = _run(model, *DROPQUANT)  # greedy, drafts from dropped + 2-bit entries
    out, stats = g.tokens, g.stats
    np.testing.assert_array_equal(out, full)  # agreement with plain decoding (not guaranteed bitwise, holds here)
    assert stats["mean_accepted_per_round"] < 4  # some drafts were rejected and replaced


def test_unknown_compressor_names_the_family(model):
    with pytest.raises(UnsupportedFeatureError, match="deepseek_v4.*snapkv"):
        kvjax.generate_vericache(model, _ids(model), 4, compressor="snapkv")


def test_offload_join_is_the_resident_cache(model):
    """split -> host -> fetch -> join gives the resident cache bitwise, also after entries completed past the
    prompt; update keeps the device part in step with a committed cache."""
    from kvjax.decode import offload as offl
    from kvjax.models.deepseek_v4 import offload

    cache = model.family.init_cache(model.config, 1, 256, model.cache_dtype)
    _, cache = steps.prefill(model, cache, _ids(model))
    host, dev = offload.offload_split(cache, 64)
    assert all(h is None for h, kind in zip(host, model.config.layer_types) if kind == "sliding_attention")
    P = jnp.asarray([PROMPT], jnp.int32)
    more = np.arange(9, dtype=np.int32) % model.config.vocab_size  # 9 tokens: completes CSA and HCA entries
    _, later = steps.prefill(model, jax.tree.map(jnp.copy, cache), more, chunk=steps.SHORT_CHUNK)  # compiled shape
    dev = offload.offload_update(dev, later, P, None, P, block=9)
    joined = offload.offload_join(offl.fetch(offl.to_host(host)), dev, later.length, P)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), joined, later)
    assert all(jax.tree.leaves(same))
