"""A tiny random Llama-family `Model` (no files, no torch) for prefix-cache tests and benchmarks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.api import Model
from kvjax.models.layer_types import FULL, SLIDING
from kvjax.models.llama.config import ModelConfig
from kvjax.models.rope import RopeConfig


def toy_config(layer_types=(FULL, SLIDING, FULL), *, window: int | None = 16, vocab: int = 97, hidden: int = 64,
               heads: int = 4, kv_heads: int = 2, head_dim: int = 16, theta: float = 10000.0,
               max_pos: int = 1 << 17) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_layers=len(layer_types), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       rms_norm_eps=1e-5, rope=RopeConfig(theta=theta), layer_types=tuple(layer_types),
                       sliding_window=window if SLIDING in layer_types else None, max_position_embeddings=max_pos)


def toy_model(config: ModelConfig | None = None, seed: int = 0, scale: float = 0.08) -> Model:
    """Random params in kvjax's layout (matrices [in, out]); larger-than-default init so attention is not flat."""
    c = config or toy_config()
    H, I, N, K, D, V = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 10 * c.num_layers + 4))

    def w(*shape):
        return jax.random.normal(next(keys), shape, jnp.float32) * scale

    def norm(n):
        return 1.0 + 0.3 * jax.random.normal(next(keys), (n,), jnp.float32)

    layers = tuple(dict(attn_norm=norm(H), wq=w(H, N * D), wk=w(H, K * D), wv=w(H, K * D), wo=w(N * D, H),
                        mlp_norm=norm(H), w_gate=w(H, I), w_up=w(H, I), w_down=w(I, H)) for _ in range(c.num_layers))
    params = dict(embed=w(V, H) * 10, final_norm=norm(H), lm_head=w(H, V), layers=layers)
    return Model(config=c, params=params)
