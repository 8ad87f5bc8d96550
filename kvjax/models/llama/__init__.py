"""The Llama family (Llama, Qwen2, Qwen3, Mistral): config, weights, cache layout, forward, draft forward."""

from kvjax.models.llama.model import apply_rope, forward, forward_train, init_params, project_qkv

__all__ = ["apply_rope", "forward", "forward_train", "init_params", "project_qkv"]
