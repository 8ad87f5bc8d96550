"""kvjax: exact long-context decoding in JAX.

Public API: `load(path)`, `logits(model, token_ids)`, `generate(model, prompt_ids, max_new_tokens=...)`.
"""

from kvjax.api import Model, generate, load, logits
from kvjax.models.llama.config import ModelConfig, config_from_hf, load_config
from kvjax.errors import UnsupportedConfigError

__all__ = ["Model", "ModelConfig", "UnsupportedConfigError", "config_from_hf", "generate", "load", "load_config",
           "logits"]
__version__ = "0.1.0"
