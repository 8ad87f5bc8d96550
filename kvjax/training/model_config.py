"""The config of the bundled tiny code model (checkpoints/kvjax-code-tiny) and its shipped long-context rope."""

from __future__ import annotations

import dataclasses

from kvjax.models.layer_types import FULL
from kvjax.models.llama.config import ModelConfig
from kvjax.models.rope import RopeConfig


def tiny_llama_config(*, context: int, vocab: int = 4096, eos: int = 0, hidden: int = 256, intermediate: int = 768,
                      layers: int = 4, heads: int = 8, kv_heads: int = 4, head_dim: int = 32,
                      rope_theta: float = 10000.0) -> ModelConfig:
    """A Llama config with tied embeddings and default rope over `context` trained positions."""
    return ModelConfig(
        family="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
        rope=RopeConfig(rope_type="default", theta=rope_theta), layer_types=(FULL,) * layers,
        tie_word_embeddings=True, max_position_embeddings=context, eos_token_ids=(eos,),
    )


def with_long_context_rope(cfg: ModelConfig, factor: float) -> ModelConfig:
    """The shipped config: YaRN over the trained context, so prompts `factor` times longer keep seen angles."""
    if factor <= 1:
        return cfg
    rope = dataclasses.replace(cfg.rope, rope_type="yarn", factor=factor,
                               original_max_position_embeddings=cfg.max_position_embeddings)
    return dataclasses.replace(cfg, rope=rope, max_position_embeddings=int(cfg.max_position_embeddings * factor))
