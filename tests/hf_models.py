"""Tiny random Hugging Face models (created with transformers, saved with save_pretrained) for parity tests."""

from __future__ import annotations

import os

FAMILIES = {
    "llama": dict(model_type="llama", num_key_value_heads=2,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=64)),
    "llama_tied_linear": dict(model_type="llama", num_key_value_heads=4, tie_word_embeddings=True,
                              rope_scaling=dict(rope_type="linear", factor=2.0)),
    "llama_yarn": dict(model_type="llama", num_key_value_heads=1,
                       rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, use_sliding_window=True, sliding_window=16,
                  max_window_layers=1),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=16),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=16),
}


def make_hf_model(tmpdir: str, name: str, seed: int = 0):
    """Create, save and return (transformers model, directory) for a tiny random config of family `name`."""
    import torch
    import transformers

    spec = dict(FAMILIES[name])
    model_type = spec.pop("model_type")
    cfg_cls = transformers.AutoConfig.for_model(model_type).__class__
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, eos_token_id=None,
                bos_token_id=None, pad_token_id=None)
    base.update(spec)
    cfg = cfg_cls(**base)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    # larger-than-default init so attention patterns are not flat
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 1:
                p.normal_(0, 0.08 if p.ndim > 1 else 0.3)
                if p.ndim == 1:
                    p.add_(1.0)
    d = os.path.join(tmpdir, name)
    model.save_pretrained(d)
    return model, d
