"""Hugging Face safetensors tensors <-> Llama-family params (names, shapes, transposes).

The mapping is one table (`_layer_map`) used in both directions, so loading and exporting cannot drift apart.
Every problem with a checkpoint names the tensor: missing, unexpected, or mis-shaped (with both shapes).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from kvjax.arrays import np_dtype
from kvjax.errors import WeightsError
from kvjax.models.llama.config import ModelConfig



def _layer_map(config: ModelConfig, i: int) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """kvjax key -> (HF name, HF shape, transpose?)."""
    H, I = config.hidden_size, config.intermediate_size
    N, K, D = config.num_heads, config.num_kv_heads, config.head_dim
    p = f"model.layers.{i}."
    m = {
        "attn_norm": (p + "input_layernorm.weight", (H,), False),
        "wq": (p + "self_attn.q_proj.weight", (N * D, H), True),
        "wk": (p + "self_attn.k_proj.weight", (K * D, H), True),
        "wv": (p + "self_attn.v_proj.weight", (K * D, H), True),
        "wo": (p + "self_attn.o_proj.weight", (H, N * D), True),
        "mlp_norm": (p + "post_attention_layernorm.weight", (H,), False),
        "w_gate": (p + "mlp.gate_proj.weight", (I, H), True),
        "w_up": (p + "mlp.up_proj.weight", (I, H), True),
        "w_down": (p + "mlp.down_proj.weight", (H, I), True),
    }
    if config.attention_bias:
        m["bq"] = (p + "self_attn.q_proj.bias", (N * D,), False)
        m["bk"] = (p + "self_attn.k_proj.bias", (K * D,), False)
        m["bv"] = (p + "self_attn.v_proj.bias", (K * D,), False)
    if config.qk_norm:
        m["q_norm"] = (p + "self_attn.q_norm.weight", (D,), False)
        m["k_norm"] = (p + "self_attn.k_norm.weight", (D,), False)
    return m


def _top_map(config: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    V, H = config.vocab_size, config.hidden_size
    m = {"embed": ("model.embed_tokens.weight", (V, H), False), "final_norm": ("model.norm.weight", (H,), False)}
    if not config.tie_word_embeddings:
        m["lm_head"] = ("lm_head.weight", (V, H), True)
    return m


def params_from_tensors(config: ModelConfig, tensors: dict[str, np.ndarray], dtype="f32") -> dict[str, Any]:
    """Map HF tensors to the params pytree, checking every name and shape.

    Raises:
        WeightsError: listing missing, unexpected and mis-shaped tensors.
    """
    dt = np_dtype(dtype)
    missing, bad = [], []
    used = set()

    def take(name, shape, transpose):
        if name not in tensors:
            missing.append(name)
            return None
        t = tensors[name]
        used.add(name)
        if tuple(t.shape) != shape:
            bad.append(f"{name}: got {tuple(t.shape)}, expected {shape}")
            return None
        t = np.asarray(t, dtype=np.float32)
        return jnp.asarray((t.T if transpose else t).astype(dt))

    top = {k: take(*v) for k, v in _top_map(config).items()}
    layers = tuple({k: take(*v) for k, v in _layer_map(config, i).items()} for i in range(config.num_layers))
    if config.tie_word_embeddings and "lm_head.weight" in tensors:
        used.add("lm_head.weight")  # some exporters write the tied head too; it must equal the embedding
    unexpected = sorted(k for k in tensors if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if missing or bad or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected tensors: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if bad:
            parts.append(f"mis-shaped tensors: {bad[:8]}")
        raise WeightsError("; ".join(parts))
    return {**top, "layers": layers}


def params_to_tensors(config: ModelConfig, params: dict[str, Any], dtype="f32") -> dict[str, np.ndarray]:
    """The inverse of `params_from_tensors`: HF names and `[out, in]` layouts, for `save_file`."""
    dt = np_dtype(dtype)
    out = {}
    for k, (name, _, tr) in _top_map(config).items():
        a = np.asarray(params[k], np.float32)
        out[name] = np.ascontiguousarray((a.T if tr else a).astype(dt))
    for i, layer in enumerate(params["layers"]):
        for k, (name, _, tr) in _layer_map(config, i).items():
            a = np.asarray(layer[k], np.float32)
            out[name] = np.ascontiguousarray((a.T if tr else a).astype(dt))
    return out


def hf_config_dict(config: ModelConfig, *, architectures: tuple[str, ...] | None = None,
                   torch_dtype: str = "float32") -> dict[str, Any]:
    """A Hugging Face config.json dict for a Llama-family ModelConfig (inverse of `config_from_hf`)."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM"}[config.family]
    r = config.rope
    rope: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type in ("linear", "llama3", "yarn"):
        rope["factor"] = r.factor
    if r.rope_type in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = r.original_max_position_embeddings
    if r.rope_type == "llama3":
        rope.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.rope_type == "yarn":
        rope.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow)
        if r.attention_factor is not None:
            rope["attention_factor"] = r.attention_factor
    d: dict[str, Any] = {
        "architectures": list(architectures or (arch,)),
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": config.attention_bias,
        "layer_types": list(config.layer_types),
        "torch_dtype": torch_dtype,
    }
    if config.sliding_window is not None:
        d["sliding_window"] = config.sliding_window
        if config.family in ("qwen2", "qwen3"):
            d["use_sliding_window"] = True
    if config.bos_token_id is not None:
        d["bos_token_id"] = config.bos_token_id
    if config.eos_token_ids:
        d["eos_token_id"] = config.eos_token_ids[0] if len(config.eos_token_ids) == 1 else list(config.eos_token_ids)
    return d
