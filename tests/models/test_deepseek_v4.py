"""DeepSeek-V4: full-forward parity with transformers' uncached forward, config rejection, weight round trips,
the training forward."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import hf_logits, make_v4

import kvjax
from kvjax.models.deepseek_v4.cache import init_cache
from kvjax.errors import UnsupportedConfigError
from kvjax.models import deepseek_v4
from kvjax.decode import steps
from kvjax.models.layer_types import CSA, HCA
from kvjax.models.deepseek_v4.config import config_from_hf, hf_config_dict
from kvjax.models.deepseek_v4.weights import (init_params, merge_params, params_from_tensors, params_to_tensors,
    partition_params)
from kvjax.checkpoint import read_safetensors

PAD = 48


def full_logits(model, ids):
    """kvjax full forward: an empty cache, the whole prompt (<= 64 tokens) in one padded chunk. f32[T, V]."""
    return kvjax.logits(model, ids)


@pytest.fixture(scope="module")
def hybrid():
    hf, d = make_v4("hybrid")
    return hf, kvjax.load(d)


# m = 4, m' = 8, W = 8: multiples of both (8, 24, 32, 48), of m only (12, 20), of neither (3, 17, 41);
# all but 3 are longer than the window
@pytest.mark.parametrize("T", [3, 8, 12, 17, 20, 24, 32, 41, 48])
def test_full_forward_matches_transformers(hybrid, T):
    hf, model = hybrid
    ids = np.random.RandomState(T).randint(0, model.config.vocab_size, size=T)
    ref = hf_logits(hf, ids)
    got = full_logits(model, ids)
    assert np.abs(got - ref).max() < 1e-4, np.abs(got - ref).max()


def test_variant_config_and_indexer_ties_match_transformers():
    # tied embeddings, sigmoid router, plain rope, 1 output group, hc 3, and one indexer head: most scores tie at 0.
    # transformers' torch.topk orders ties unspecified (measured logit differences ~1.2 against it on tie-heavy
    # configs); with its top-k made to break ties by lowest index, as kvjax does, parity is ~5e-6.
    hf, d = make_v4("variant")
    model = kvjax.load(d)
    assert model.config.tie_word_embeddings and "lm_head" not in model.params
    for T in (7, 30, 48):
        ids = np.random.RandomState(100 + T).randint(0, model.config.vocab_size, size=T)
        got = full_logits(model, ids)
        assert np.abs(got - hf_logits(hf, ids, lowest_index_ties=True)).max() < 1e-4


@pytest.mark.slow  # CI time (25 s): V4's generate is checked against full decoding in test_vericache_deepseek_v4
def test_api_logits_and_generate(hybrid):
    hf, model = hybrid
    ids = np.random.RandomState(5).randint(0, model.config.vocab_size, size=21)
    out = kvjax.generate(model, ids, max_new_tokens=6)
    assert out.shape == (6,) and out.dtype == np.int32
    # greedy self-consistency: each generated token is the full forward's argmax at its position
    seq = np.concatenate([ids, out])
    lg = full_logits(model, seq)
    np.testing.assert_array_equal(np.argmax(lg[len(ids) - 1:-1], axis=-1), out)


def test_prompt_over_capacity_raises(hybrid):
    _, model = hybrid
    cache = init_cache(model.config, 1, 16)
    with pytest.raises(ValueError, match="does not fit"):
        steps.prefill(model, cache, np.zeros(17, np.int32))


def _hf_dict():
    _, d = make_v4("hybrid")
    with open(os.path.join(d, "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("field,value", [
    ("num_key_value_heads", 2), ("quantization_config", {"quant_method": "fp8"}), ("n_shared_experts", 2),
    ("attention_bias", True), ("hidden_act", "gelu"), ("scoring_func", "softmax"),
    ("layer_types", ["full_attention"] * 4), ("mlp_layer_types", ["dense"] * 4),
])
def test_unsupported_field_raises_by_name(field, value):
    hf = _hf_dict()
    hf[field] = value
    with pytest.raises(UnsupportedConfigError, match=field):
        config_from_hf(hf)


def test_unsupported_rope_type_raises():
    hf = _hf_dict()
    hf["rope_parameters"]["compress"]["rope_type"] = "llama3"
    with pytest.raises(UnsupportedConfigError, match="rope_parameters.compress.rope_type"):
        config_from_hf(hf)


def test_config_round_trip(hybrid):
    _, model = hybrid
    assert config_from_hf(hf_config_dict(model.config)) == model.config
    assert model.config.family == "deepseek_v4" and "csa_rate" in model.config.kv_fields()


def test_weights_round_trip_exact_and_transformers_loads_export(hybrid, tmp_path):
    import torch
    from safetensors.numpy import save_file
    from transformers import DeepseekV4ForCausalLM

    hf, model = hybrid
    tensors = params_to_tensors(model.config, model.params)
    back = params_from_tensors(model.config, tensors)
    same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), model.params, back)
    assert all(jax.tree_util.tree_leaves(same))
    # the export is the save_pretrained spelling, and transformers loads it into the same model
    assert set(tensors) == set(read_safetensors(model.path))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf_config_dict(model.config), f)
    reloaded = DeepseekV4ForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    ids = np.arange(30) % model.config.vocab_size
    with torch.no_grad():
        a = reloaded(torch.tensor(ids[None]), use_cache=False).logits[0].numpy()
    np.testing.assert_array_equal(a, hf_logits(hf, ids))


def test_transformers_module_names_load_too(hybrid):
    hf, model = hybrid
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    params = params_from_tensors(model.config, sd)
    same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), model.params, params)
    assert all(jax.tree_util.tree_leaves(same))


def test_forward_train_equals_cached_full(hybrid):
    _, model = hybrid
    ids = np.random.RandomState(9).randint(0, model.config.vocab_size, size=PAD)
    train = jax.jit(deepseek_v4.forward_train, static_argnums=1)
    lt = np.asarray(train(model.params, model.config, jnp.asarray(ids[None], jnp.int32)))[0]
    assert np.abs(lt - full_logits(model, ids)).max() < 1e-5


@pytest.mark.slow  # compiling the gradient takes ~50 s on the shared 2-core CPU
def test_init_params_train_step_is_differentiable(hybrid):
    # a two-layer CSA + HCA model from init_params (the training entry point), gradients of the LM loss
    cfg = dataclasses.replace(hybrid[1].config, num_layers=2, layer_types=(CSA, HCA),
                              mlp_layer_types=("hash_moe", "moe"))
    params = init_params(cfg, jax.random.PRNGKey(0))
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
        params_from_tensors(cfg, params_to_tensors(cfg, params)))
    floats, ints = partition_params(params)
    tok = jnp.asarray(np.random.RandomState(3).randint(0, cfg.vocab_size, size=(2, 20)), jnp.int32)

    def loss(fp):
        lg = deepseek_v4.forward_train(merge_params(fp, ints), cfg, tok)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(lg[:, :-1]), tok[:, 1:, None], axis=-1))

    g = jax.jit(jax.grad(loss))(floats)
    norms = {jax.tree_util.keystr(k): float(jnp.linalg.norm(v)) for k, v in jax.tree_util.tree_leaves_with_path(g)}
    assert all(np.isfinite(v) for v in norms.values())
    # gradients reach the compressors and the experts; the indexer only selects entries, so it gets none
    assert norms["['layers'][0]['attn']['compressor']['wkv']"] > 0
    assert norms["['layers'][1]['attn']['compressor']['wgate']"] > 0
    assert norms["['layers'][0]['ffn']['w1']"] > 0
    assert norms["['layers'][0]['attn']['indexer']['weights_proj']"] == 0


def test_training_config_exports_a_checkpoint_transformers_runs(tmp_path):
    """config_for_training -> init_params -> params_to_tensors + hf_config_dict: transformers loads it and computes
    the same logits as kvjax (the path scripts/train_tiny.py ships a trained hybrid checkpoint by)."""
    from safetensors.numpy import save_file
    from transformers import DeepseekV4ForCausalLM

    cfg = deepseek_v4.config_for_training(
        vocab=61, eos=1, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        head_dim=16, q_lora_rank=16, o_lora_rank=8, index_head_dim=8, sliding_window=8,
        layer_types=[CSA, HCA], mlp_layer_types=["hash_moe", "moe"], compress_rates={CSA: 2, HCA: 4})
    params = deepseek_v4.init_params(cfg, jax.random.PRNGKey(1), std=0.2)
    assert all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree_util.tree_leaves(params))
    save_file(deepseek_v4.params_to_tensors(cfg, params), str(tmp_path / "model.safetensors"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(deepseek_v4.hf_config_dict(cfg), f)
    hf = DeepseekV4ForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    ids = np.random.RandomState(0).randint(0, 61, size=23)
    want = hf_logits(hf, ids)
    loaded = kvjax.load(str(tmp_path))
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(_leaf(loaded.params, path)))
    assert np.abs(kvjax.logits(loaded, ids) - want).max() < 1e-4


def _leaf(tree, path):
    for k in path:
        tree = tree[k.key if hasattr(k, "key") else k.idx]
    return tree
