"""Sampling: position-keyed exact sampling (VeriCache == full-cache sampled decoding), and speculative rejection
sampling preserves the target distribution (chi-square on a tiny vocabulary)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import load
from kvjax.decode import sampling
from kvjax.decode import vericache as vc

# chi-square 0.999 quantile for 4 degrees of freedom (vocab 5)
CHI2_4DOF_999 = 18.47


def test_position_keyed_noise_depends_only_on_seed_and_position():
    gumbel = jax.jit(sampling.gumbel, static_argnums=2)  # as the decode steps run it (op by op: a compile per op)
    g1 = gumbel(jnp.asarray([7]), jnp.asarray([[10, 11, 12]]), 5)
    g2 = gumbel(jnp.asarray([7]), jnp.asarray([[12, 10]]), 5)
    np.testing.assert_array_equal(g1[0, 2], g2[0, 0])
    np.testing.assert_array_equal(g1[0, 0], g2[0, 1])
    g3 = gumbel(jnp.asarray([8]), jnp.asarray([[10]]), 5)
    assert not np.array_equal(g1[0, 0], g3[0, 0])


@pytest.mark.parametrize("x", [1, pytest.param(3, marks=pytest.mark.slow)])  # CI runs x = 1 (time)
def test_rejection_sampling_preserves_target_distribution(x):
    """First emitted token of a speculative block (accepted draft or residual sample) is distributed as p."""
    V, n = 5, 20000
    p_logits = jnp.log(jnp.asarray([0.4, 0.25, 0.2, 0.1, 0.05]))
    q_logits = jnp.log(jnp.asarray([0.1, 0.1, 0.5, 0.2, 0.1]))
    seeds = jnp.arange(n, dtype=jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(x + 1, dtype=jnp.int32) + 100, (n, x + 1))
    qlog = jnp.broadcast_to(q_logits, (n, x, V))
    # jitted: op by op, each op compiled a program of its own (CI time); the second accept reuses the first's
    drafts = jax.jit(sampling.sample_draft, static_argnums=3)(qlog, positions[:, :x], seeds, 1.0)
    plog = jnp.broadcast_to(p_logits, (n, x + 1, V))
    accept = jax.jit(sampling.rejection_accept, static_argnames="temperature")
    nacc, nxt = accept(plog, qlog, drafts, positions, seeds, temperature=1.0)
    first = np.where(np.asarray(nacc) > 0, np.asarray(drafts[:, 0]), np.asarray(nxt))
    counts = np.bincount(first, minlength=V)
    expected = n * np.exp(np.asarray(p_logits))
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < CHI2_4DOF_999, (counts, expected)
    # acceptance rate of the first draft is sum_v min(p, q)
    acc = float(np.mean(np.asarray(nacc) > 0))
    assert abs(acc - 0.55) < 0.02
    # a draft that IS the target accepts everything
    nacc2, _ = accept(plog, jnp.broadcast_to(p_logits, (n, x, V)), drafts, positions, seeds, temperature=1.0)
    assert int(jnp.min(nacc2)) == x


@pytest.fixture(scope="module")
def llama(hf_model_dir):
    return load(hf_model_dir("llama")[1])


@pytest.mark.parametrize("temperature", [pytest.param(0.7, marks=pytest.mark.slow), 1.0])
def test_sampled_vericache_equals_sampled_full_cache(llama, temperature):
    prompt = np.random.default_rng(4).integers(0, 97, 64).astype(np.int32)
    for seed in (0, 1):
        ref = vc.reference_decode(llama, prompt, 20, draft_len=4, temperature=temperature, seed=seed)
        out, _ = vc.generate_vericache(llama, prompt, 20, compressor="streaming", draft_len=4,
                                       temperature=temperature, seed=seed)
        np.testing.assert_array_equal(out, ref)
    greedy = vc.reference_decode(llama, prompt, 20, draft_len=4)
    assert not np.array_equal(ref, greedy)  # the noise is really used


@pytest.mark.slow  # CI time: test_rejection_sampling_preserves_target_distribution runs the same path end to end
def test_rejection_sampling_end_to_end_runs(llama):
    prompt = np.random.default_rng(5).integers(0, 97, 64).astype(np.int32)
    out, st = vc.generate_vericache(llama, prompt, 16, compressor="kivi4", draft_len=4, temperature=1.0,
                                    rejection=True, compressor_kw={"residual": 16})
    assert out.shape == (16,) and out.min() >= 0 and out.max() < 97
    assert st["mean_accepted_per_round"] > 0
    with pytest.raises(ValueError, match="temperature"):
        vc.generate_vericache(llama, prompt, 4, rejection=True)


@pytest.mark.parametrize("s,kept", [
    (sampling.Sampling(1.0, top_k=2), [0, 1]),
    (sampling.Sampling(1.0, top_p=0.7), [0, 1]),  # 0.5 + 0.2 reaches 0.7: the smallest such set
    (sampling.Sampling(1.0, top_p=0.71), [0, 1, 2]),
    (sampling.Sampling(1.0, min_p=0.3), [0, 1, 2]),  # p >= 0.3 * 0.5
    (sampling.Sampling(1.0, top_k=3, top_p=0.6, min_p=0.1), [0, 1]),
    (sampling.Sampling(2.0), [0, 1, 2, 3, 4]),
])
def test_filters_keep_the_documented_set(s, kept):
    x = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))[:, ::-1]  # reversed: the filter must sort
    f = np.asarray(sampling.filtered_logits(x, s))[0, ::-1]
    assert np.nonzero(np.isfinite(f))[0].tolist() == kept
    np.testing.assert_allclose(f[kept], np.log([0.5, 0.2, 0.15, 0.1, 0.05])[kept] / s.temperature, rtol=1e-6)


def test_filtered_sampling_draws_only_kept_tokens():
    s = sampling.Sampling(1.0, top_k=2)
    x = jnp.broadcast_to(jnp.log(jnp.asarray([0.1, 0.4, 0.3, 0.2])), (4000, 1, 4))
    toks = np.asarray(sampling.select_tokens(x, jnp.zeros((4000, 1), jnp.int32), jnp.arange(4000), s))
    counts = np.bincount(toks.ravel(), minlength=4)
    assert counts[0] == counts[3] == 0 and abs(counts[1] / 4000 - 4 / 7) < 0.03
