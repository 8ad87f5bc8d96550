"""Drafting with bf16 or int8 weights (`kvjax.decode.draft_weights`): cheaper drafts, output unchanged bit for bit."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
import pallas_kernels
from kvjax.compress import make_compressor
from kvjax.decode.draft_weights import check_draft_weights, draft_params
from kvjax.decode import vericache as vericache_mod
from kvjax.remote import prefix_entry as pe
from pallas_kernels import native
from pallas_kernels.affine import PackedAffine
from pallas_kernels.int_dot import IntDot8, unpack_int_dot8
from pallas_kernels.linear import Int8Weight, PackedInt8, dequantize_int8, packed_weights_supported, unpack_int8

pytestmark = pytest.mark.skipif(not native.available(), reason="bf16 draft weights need the native kernel on CPU")


def _prompt(n=120, seed=0):
    return np.random.default_rng(seed).integers(0, 97, n).astype(np.int32)


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "int_dot"])
def test_low_precision_draft_weights_keep_vericache_exact(hf_model_dir, weights):
    m = kvjax.load(hf_model_dir("llama")[1])
    p = _prompt(seed=3)
    r = kvjax.reference_decode(m, p, 20, draft_len=4, return_logits=True)
    for compressor, kw in [("refresh", dict(block=8, recent_blocks=2, obs_window=8, min_drafts=0)), ("snapkv", {})]:
        g = kvjax.generate_vericache(m, p, 20, compressor=compressor, draft_len=4, ignore_eos=True, return_logits=True,
                                     compressor_kw=dict(kw, draft_dtype="bfloat16", draft_weights=weights))
        np.testing.assert_array_equal(g.tokens, r.tokens)
        np.testing.assert_array_equal(g.logits, r.logits)
        assert g.stats["mean_accepted_per_round"] > 0  # the cheaper draft still predicts the model's tokens


def test_draft_params_are_a_fused_bf16_copy_made_once(hf_model_dir):
    m = kvjax.load(hf_model_dir("llama")[1])
    assert draft_params(m, "float32") is m.loop_params()  # the loops' own layout, shared with verification
    d = draft_params(m, "bfloat16")
    assert draft_params(m, "bfloat16") is d  # kept, not rebuilt per call
    layer = d["layers"][0]
    assert {"wqkv", "w_gate_up"} <= set(layer) and "wq" not in layer
    assert all(layer[k].dtype == jnp.bfloat16 for k in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert d["lm_head"].shape == (m.config.hidden_size, m.config.vocab_size) and d["lm_head"].dtype == jnp.bfloat16
    assert m.params["layers"][0]["wq"].dtype == jnp.float32  # the model's own weights are untouched
    # a weight replaced inside the tree (the dict in place, as fine-tuning loops do): the kept copy is not reused
    m.params["layers"][0]["wq"] = m.params["layers"][0]["wq"] * 2.0
    again = draft_params(m, "bfloat16")
    assert again is not d
    n = m.params["layers"][0]["wq"].shape[1]
    np.testing.assert_array_equal(np.asarray(again["layers"][0]["wqkv"][:, :n]),
                                  np.asarray(m.params["layers"][0]["wq"].astype(jnp.bfloat16)))


def test_int8_draft_params_are_codes_and_scales_per_output_column(hf_model_dir):
    m = kvjax.load(hf_model_dir("llama")[1])
    d = draft_params(m, "int8")
    assert draft_params(m, "int8") is d and d is not draft_params(m, "bfloat16")  # kept, one copy per kind
    # on CPU with the native kernel, codes whose width is a multiple of 64 are stored in 64-column panels
    packed = packed_weights_supported()
    layer = {k: unpack_int8(v) if isinstance(v, PackedInt8) else v for k, v in d["layers"][0].items()}
    for k in ("wqkv", "wo", "w_gate_up", "w_down"):
        assert isinstance(layer[k], Int8Weight) and layer[k].codes.dtype == jnp.int8
        assert isinstance(d["layers"][0][k], PackedInt8) == (packed and layer[k].shape[1] % 64 == 0), k
    n = m.params["layers"][0]["wq"].shape[1]
    wq = np.asarray(m.params["layers"][0]["wq"])
    np.testing.assert_allclose(np.asarray(dequantize_int8(layer["wqkv"]))[:, :n], wq, rtol=0,
                               atol=np.abs(wq).max() / 127)
    assert d["lm_head"].shape == (m.config.hidden_size, m.config.vocab_size)


def test_int_dot_draft_params_of_a_float_model_are_int8_codes_in_the_pair_layout(hf_model_dir):
    """A float model's integer-dot draft reads the int8 draft's codes and scales (`IntDot8`) where the kernel's blocks
    of 32 k and panels of 64 columns fit the matrix, and the int8 draft's own layout where they do not."""
    m = kvjax.load(hf_model_dir("llama")[1])
    d, i8 = draft_params(m, "int_dot"), draft_params(m, "int8")
    assert draft_params(m, "int_dot") is d  # kept, like every other kind
    for k in ("wqkv", "wo", "w_gate_up", "w_down"):
        w, ref = d["layers"][0][k], i8["layers"][0][k]
        ref = unpack_int8(ref) if isinstance(ref, PackedInt8) else ref
        K, N = ref.shape
        assert isinstance(w, IntDot8) == (K % 32 == 0 and N % 64 == 0), k
        if isinstance(w, IntDot8):
            np.testing.assert_array_equal(np.asarray(unpack_int_dot8(w)), np.asarray(ref.codes))
            np.testing.assert_array_equal(np.asarray(w.scale), np.asarray(ref.scale))
    assert d["lm_head"].shape == (m.config.hidden_size, m.config.vocab_size)


def test_bad_draft_weights_and_the_draft_identity(hf_model_dir, monkeypatch):
    m = kvjax.load(hf_model_dir("llama")[1])
    with pytest.raises(ValueError, match="draft_weights must be one of"):
        kvjax.generate_vericache(m, _prompt(), 4, compressor="snapkv", compressor_kw=dict(draft_weights="int3"))
    with pytest.raises(kvjax.InputError, match="draft_weights must be one of"):
        check_draft_weights("int4")
    with pytest.raises(kvjax.InputError, match="llama family"):
        check_draft_weights("bfloat16", "deepseek_v4")
    # integer-dot drafts of a GGUF model read its 4-bit block codes: one of 8-bit codes is told so before any compute
    calls = []
    monkeypatch.setattr(vericache_mod, "prefill_for", lambda *a, **k: calls.append(a))
    eight_bit = PackedAffine(jnp.zeros((1, 64, 64), jnp.int8), jnp.ones((1, 2, 64)), jnp.zeros((1, 2, 64)))
    assert eight_bit.bits == 8
    monkeypatch.setattr(type(m), "loop_params", lambda self: {"layers": ({"wqkv": eight_bit},)})
    with pytest.raises(kvjax.InputError, match="4-bit block codes"):
        kvjax.generate_vericache(m, _prompt(), 4, compressor_kw=dict(draft_weights="int_dot"))
    assert not calls
    monkeypatch.undo()
    # the weights drafting reads do not change the draft cache's keys and values: same stored-draft identity
    c = make_compressor("snapkv")
    assert pe.draft_identity(c, 64) == pe.draft_identity(dataclasses.replace(c, draft_weights="bfloat16"), 64)


def test_the_default_drafter_drafts_cheaply_where_the_kernels_read_it(hf_model_dir):
    """The family's default drafter (no compressor named) takes the measured-best cheap draft where the kernels read
    it directly (bf16 kept keys and values; int8 for a model whose kept part would not stay in cache, or whose int8
    keys are scored as integers on VNNI tiles; int8 weights on the CPU); a named drafter keeps its f32 defaults, and
    given fields win over the default ones."""
    m = kvjax.load(hf_model_dir("llama")[1])
    d = m.family.make_compressor(None, model=m)
    on_native = pallas_kernels.active_cpu_implementation() == "native"
    small = "int8" if on_native and native.int8_scores_fast(m.config.head_dim) else "bfloat16"
    assert (d.name, d.draft_dtype, d.draft_weights, d.max_kept) == ("refresh", small, "int8", 2048)
    odd = dataclasses.replace(m, config=dataclasses.replace(m.config, head_dim=24))  # small, no VNNI tiles: bf16
    assert m.family.make_compressor(None, model=odd).draft_dtype == "bfloat16"
    big = dataclasses.replace(m, config=dataclasses.replace(m.config, num_layers=30, num_kv_heads=3, head_dim=64))
    assert m.family.make_compressor(None, model=big).draft_dtype == ("int8" if on_native else "bfloat16")  # SmolLM2's
    assert m.family.make_compressor(None, model=big, draft_dtype="bfloat16").draft_dtype == "bfloat16"
    assert (d.budget(4096), d.budget(32768), d.budget(100)) == (1024, 2048, 32)  # ratio 4, capped at 2048
    assert m.family.make_compressor("refresh").draft_weights == "float32"
    assert m.family.make_compressor(None, draft_weights="float32").draft_weights == "float32"
    assert m.family.make_compressor(None, draft_weights="bfloat16").draft_weights == "bfloat16"
