"""ModelConfig from Hugging Face configs: derived fields match transformers, unsupported fields raise by name."""

import numpy as np
import pytest
import torch
import transformers

from kvjax.models.layer_types import FULL, SLIDING
from kvjax.errors import UnsupportedConfigError
from kvjax.models.llama.config import config_from_hf
from kvjax.models.rope import rope_inv_freq

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0)


def _hf(model_type, **kw):
    cls = transformers.AutoConfig.for_model(model_type).__class__
    cfg = cls(**{**BASE, **kw})
    return cfg, cfg.to_dict()


@pytest.mark.parametrize("model_type,kw", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),
    ("qwen2", dict(use_sliding_window=False, sliding_window=16, max_window_layers=2)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    ("mistral", dict(sliding_window=16)),
    ("mistral", dict(sliding_window=None)),
    ("llama", dict()),
])
def test_layer_types_derived_like_transformers(model_type, kw):
    hf_cfg, d = _hf(model_type, **kw)
    cfg = config_from_hf(d)
    expected = getattr(hf_cfg, "layer_types", None)
    if expected is None:  # mistral: every layer slides when a window is set
        expected = [SLIDING if getattr(hf_cfg, "sliding_window", None) else FULL] * hf_cfg.num_hidden_layers
    assert list(cfg.layer_types) == list(expected)
    if SLIDING in cfg.layer_types:
        assert cfg.sliding_window == hf_cfg.sliding_window


@pytest.mark.parametrize("rope", [
    dict(rope_type="default"),
    dict(rope_type="linear", factor=3.0),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=16, beta_slow=2,
         attention_factor=1.3),
])
def test_rope_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg, d = _hf("llama", rope_parameters={**rope, "rope_theta": 5000.0})
    cfg = config_from_hf(d)
    inv, scale = rope_inv_freq(cfg.rope, cfg.head_dim)
    if rope["rope_type"] == "default":
        ref = 1.0 / (5000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
    np.testing.assert_allclose(inv, ref.numpy(), rtol=1e-6)
    assert scale == pytest.approx(ref_scale, rel=1e-6)


def test_legacy_rope_scaling_and_rope_parameters_agree():
    legacy = {**BASE, "model_type": "llama", "rope_theta": 500000.0,
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    modern = {**BASE, "model_type": "llama", "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 500000.0}}
    modern.pop("rope_theta")
    assert config_from_hf(legacy).rope == config_from_hf(modern).rope


@pytest.mark.parametrize("patch,field", [
    (dict(model_type="gpt2"), "model_type"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "rope_type"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(attention_dropout=0.1), "attention_dropout"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(layer_types=["full_attention"] * 3), "layer_types"),
    (dict(layer_types=["chunked_attention"] * 4), "layer_types"),
])
def test_unsupported_fields_raise_by_name(patch, field):
    d = {**BASE, "model_type": "llama", **patch}
    with pytest.raises(UnsupportedConfigError, match=field):
        config_from_hf(d)


def test_config_is_hashable_and_static():
    cfg = config_from_hf({**BASE, "model_type": "qwen3"})
    assert hash(cfg) == hash(config_from_hf({**BASE, "model_type": "qwen3"}))
    assert cfg.qk_norm and not cfg.attention_bias
    assert config_from_hf({**BASE, "model_type": "qwen2"}).attention_bias
