"""The model runs through the attention dispatcher: Pallas (interpret mode) logits equal the XLA path's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.models.llama.cache import init_cache
from kvjax.models import llama
from kvjax.models.attention import attend, default_attention
from kvjax.models.attention import attention, attention_parts, make_attention_fn
from builders import CHECKPOINTS, jitted_reference

pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning")


ON_GPU = jax.default_backend() == "gpu"


FORWARD = jax.jit(llama.forward, static_argnames="attention_fn")  # one for every case: the XLA side compiles once


@pytest.mark.parametrize("family,implementation", [
    ("llama", "pallas_interpret"),  # full layers (GQA 4/2)
    pytest.param("mistral", "pallas_interpret", marks=pytest.mark.slow),  # sliding layers (CI time: the sliding
    # kernel runs interpreted in tests/kernels/test_attention.py, the model wiring in the llama case)
    ("llama", "native"), ("mistral", "native"),  # the native CPU kernel in the model
    pytest.param("llama", "pallas", marks=[pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a GPU")]),
])
def test_forward_pallas_matches_xla(hf_model_dir, family, implementation):
    _, path = hf_model_dir(family)
    model = kvjax.load(path)
    cfg, params = model.config, model.params
    fns = {name: make_attention_fn(name) for name in ("xla", implementation)}
    chunk = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 20)).astype(np.int32)
    n_valid = jnp.asarray([20, 13], jnp.int32)  # ragged rows: padding tokens must be ignored identically
    nxt = jnp.asarray([[5], [7]], jnp.int32)
    forward = FORWARD
    out = {}
    for name, fn in fns.items():
        cache = init_cache(cfg, 2, 256)
        prefill_logits, cache = forward(params, cfg, cache, jnp.asarray(chunk), n_valid, attention_fn=fn)
        step_logits, _ = forward(params, cfg, cache, nxt, attention_fn=fn)
        out[name] = (prefill_logits, step_logits)
    for got, want in zip(out[implementation], out["xla"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_make_attention_fn_resolves():
    assert make_attention_fn("xla") is default_attention
    if not ON_GPU:  # auto picks the native kernel off the GPU where it builds, else XLA
        import pallas_kernels

        if pallas_kernels.active_cpu_implementation() == "xla":
            assert make_attention_fn(None) is default_attention
        else:
            assert make_attention_fn(None).keywords == dict(implementation="native")
    with pytest.raises(ValueError, match="implementation must be one of"):
        make_attention_fn("triton")


def test_dispatch_pallas_equals_xla_on_windowed_ring_inputs():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 3, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 2, 19, 16)), jnp.float32)  # S = 16 ring + 3 new: not a power of two
    v = jnp.asarray(rng.normal(size=(1, 2, 19, 16)), jnp.float32)
    k_pos = jnp.asarray(np.r_[np.arange(16, 32), np.arange(32, 35)][None], jnp.int32)
    q_pos = jnp.asarray([[32, 33, 34]], jnp.int32)
    # jitted: one compiled program per call, not one per op (CI time)
    want = jitted_reference(attention, q, k, v, q_pos, k_pos, window=16, implementation="xla")
    got = jitted_reference(attention, q, k, v, q_pos, k_pos, window=16, implementation="pallas_interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_attention_parts_equals_one_cache(implementation):
    """Two parts (compressed prompt with per-head positions + a recent ring) == attend over their concatenation."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(2, 2, 4, 16)), jnp.float32)
    k1, v1 = (jnp.asarray(rng.normal(size=(2, 2, 24, 16)), jnp.float32) for _ in range(2))
    k2, v2 = (jnp.asarray(rng.normal(size=(2, 2, 8, 16)), jnp.float32) for _ in range(2))
    p1 = jnp.asarray(np.sort([[rng.choice(60, 24, replace=False) for _ in range(2)] for _ in range(2)]), jnp.int32)
    p2 = jnp.broadcast_to(jnp.arange(60, 68, dtype=jnp.int32), (2, 8)).at[1, 6:].set(-1)
    q_pos = jnp.asarray([[66, 67], [64, 65]], jnp.int32)
    got = jitted_reference(attention_parts, q, [(k1, v1, p1), (k2, v2, p2)], q_pos, window=30,
                           implementation=implementation)
    p2h = jnp.broadcast_to(p2[:, None], (2, 2, 8))
    want = jitted_reference(attend, q, jnp.concatenate([k1, k2], 2), jnp.concatenate([v1, v2], 2), q_pos,
                            jnp.concatenate([p1, p2h], 2), window=30)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)




@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_attention_merged_equals_one_softmax_with_sinks(implementation):
    """DeepSeek-V4's attention as parts (a windowed shared K=V ring, compressed entries keyed by position, each
    query's own sparse picks) merged with per-head sinks == one softmax over their union plus the sinks."""
    from kvjax.models.attention import attention_merged
    from pallas_kernels.reference import masked_softmax_attention, position_visible

    rng = np.random.default_rng(3)
    B, T, N, D, W = 2, 3, 4, 16, 6
    q = jnp.asarray(rng.normal(size=(B, T, N, D)), jnp.float32)
    ring, ents, picks = (jnp.asarray(rng.normal(size=(B, 1, S, D)), jnp.float32) for S in (9, 5, 7))
    q_pos = jnp.asarray([[20, 21, 22], [10, 11, 12]], jnp.int32)
    ring_pos = jnp.asarray([np.arange(14, 23), np.r_[np.arange(4, 13)[:8], -1]], jnp.int32)
    ent_pos = jnp.asarray([[3, 7, -1, 15, 19], [3, 7, 11, 15, 19]], jnp.int32)  # (w + 1) * m - 1; -1 = dropped
    idx = jnp.asarray(rng.integers(-1, 7, size=(B, T, 3)), jnp.int32)
    sinks = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
    got = jax.jit(lambda q, q_pos, ring, ring_pos, ents, ent_pos, picks, idx, sinks: attention_merged(
        q, q_pos, parts=[(ring, None, ring_pos, W), (ents, None, ent_pos, None)], sparse_parts=[(picks, None, idx)],
        sinks=sinks, implementation=implementation))(q, q_pos, ring, ring_pos, ents, ent_pos, picks, idx, sinks)

    @jax.jit  # one compiled program, not one per op (CI time)
    def want_fn(q, q_pos, ring, ring_pos, ents, ent_pos, picks, idx, sinks):
        gathered = jax.vmap(lambda kb, ib: kb[:, ib])(picks, jnp.maximum(idx, 0))  # [B, 1, T, 3, D]
        union = jnp.concatenate([jnp.broadcast_to(ring[:, :, None], (B, 1, T, 9, D)),
                                 jnp.broadcast_to(ents[:, :, None], (B, 1, T, 5, D)), gathered], axis=3)
        vis = jnp.concatenate([position_visible(q_pos, ring_pos, W), position_visible(q_pos, ent_pos),
                               (idx >= 0)[:, None]], axis=3)
        return masked_softmax_attention(q, union, None, vis, sinks=sinks)

    want = want_fn(q, q_pos, ring, ring_pos, ents, ent_pos, picks, idx, sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


# Both bundled checkpoints run under `-m slow` (CI time: interpret mode is slow on a CPU; the Llama kernels' wiring is
# checked in CI by test_forward_pallas_matches_xla).
@pytest.mark.parametrize("checkpoint", [pytest.param("kvjax-code-tiny", marks=pytest.mark.slow),
                                        pytest.param("kvjax-hybrid-tiny", marks=pytest.mark.slow)])
def test_bundled_model_full_draft_and_verify_pallas_interpret_match_xla(checkpoint):
    """On a GPU the Pallas kernels serve every step of a bundled model: prefill, one-token decode, a draft step and
    a verify round, run with `attention="pallas_interpret"`, match the XLA path."""
    import os

    from kvjax.decode import draft, verify, vericache

    path = os.path.join(CHECKPOINTS, checkpoint)
    models = {impl: kvjax.load(path, attention=impl) for impl in ("xla", "pallas_interpret")}
    ids = np.asarray(models["xla"].tokenizer.encode("def parse(text):\n    return [line.split() for line in"),
                     np.int32)
    got = {}
    for impl, m in models.items():
        full, first, logits = vericache.prefill_for(m, ids, 8, max_draft=3, return_logits=True)
        dc = m.family.make_compressor("streaming", ratio=2.0, sinks=2)(m.params, m.config, full, ids,
                                                                         recent_slots=16)
        seed = jnp.zeros((1,), jnp.int32)
        drafts, _, dc = draft.draft_step(m.params, m.config, dc, first, seed, x=3, family=m.family, impl=m.attention)
        drafts = jnp.asarray(got["xla"][1]) if impl != "xla" else drafts  # verify the same block in both
        qlog = jnp.zeros((1, 1, m.config.vocab_size), jnp.float32)
        _, _, _, _, vlog, _ = verify.verify_step(m.params, m.config, full, dc, first, drafts, qlog, seed,
                                              family=m.family, impl=m.attention)
        got[impl] = (np.asarray(logits), np.asarray(drafts), np.asarray(vlog))
    for a, b in zip(got["pallas_interpret"], got["xla"]):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-4)


def test_attention_parts_reads_a_quantized_part_through_kernel_6():
    """A `QuantizedKV` part with per-head positions (drop + quantize, a refreshing bulk): kernel 6 in interpret mode
    equals the XLA form (dequantise, then attend) and attention over the dequantised keys and values."""
    from kvjax.cache.draft import QuantizedKV

    rng = np.random.default_rng(4)
    B, K, S, D = 1, 2, 64, 32
    k, v = (jnp.asarray(rng.normal(size=(B, K, S, D)), jnp.float32) for _ in range(2))
    pos = jnp.asarray(np.where(rng.random((B, K, S)) < 0.3, -1, np.arange(S)), jnp.int32)
    part = jitted_reference(QuantizedKV.quantize, k, v, pos, bits=4, group=16)
    q = jnp.asarray(rng.normal(size=(B, 2, 4, D)), jnp.float32)
    q_pos = jnp.asarray([[60, 70]], jnp.int32)
    # jitted: one compiled program per call, not one per op (CI time)
    got = jitted_reference(attention_parts, q, [part], q_pos, implementation="pallas_interpret")
    xla = jitted_reference(attention_parts, q, [part], q_pos, implementation="xla")
    kd, vd, _ = jitted_reference(QuantizedKV.dense, part)
    np.testing.assert_allclose(np.asarray(got), np.asarray(xla), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(xla), np.asarray(jitted_reference(attend, q, kd, vd, q_pos, pos)),
                               atol=1e-5, rtol=1e-5)
