"""Floating-point operations of one training token, to turn measured tokens/s into effective GFLOP/s.

Counts the matmuls only (2 flops per multiply-add): the q/k/v/o projections, the gated MLP and the LM head in the
forward, and the causal part of attention (scores and value mix over the keys at or before each query: on
average (T + 1) / 2 of them). Backward is counted as twice the forward, the usual 3x for a training step. The
embedding lookup, norms and softmax are not counted, so the figure is what the model needs, not what the program
happens to execute (the dense causal attention computes the masked half too).
"""

from __future__ import annotations

from kvjax.models.llama.config import ModelConfig


def forward_flops_per_token(config: ModelConfig, context: int) -> float:
    """Forward matmul flops of one token in a window of `context` tokens."""
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    N, K, D = config.num_heads, config.num_kv_heads, config.head_dim
    per_layer = 2 * (H * N * D + 2 * H * K * D + N * D * H + 3 * H * I)
    attention = 2 * 2 * N * D * (context + 1) / 2
    return config.num_layers * (per_layer + attention) + 2 * H * V


def train_flops_per_token(config: ModelConfig, context: int) -> float:
    """Forward + backward flops of one training token (3x the forward)."""
    return 3.0 * forward_flops_per_token(config, context)
