"""The Llama family (Llama, Qwen2, Qwen3, Mistral): config, weights, cache layout, forward, draft forward."""

from kvjax.models.llama.layers import decoder_stack, lm_head, project_qkv
from kvjax.models.llama.model import forward, forward_train, init_params

__all__ = ["decoder_stack", "forward", "forward_train", "init_params", "lm_head", "project_qkv"]
