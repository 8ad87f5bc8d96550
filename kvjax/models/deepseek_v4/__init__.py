"""DeepSeek-V4 (sliding / CSA / HCA hybrid attention): config, weights, layers, cache, forward, draft."""

from kvjax.models.deepseek_v4.cache import init_cache
from kvjax.models.deepseek_v4.config import config_for_training, config_from_hf, hf_config_dict
from kvjax.models.deepseek_v4.model import forward, forward_train
from kvjax.models.deepseek_v4.weights import init_params, params_from_tensors, params_to_tensors

__all__ = ["config_for_training", "config_from_hf", "forward", "forward_train", "hf_config_dict", "init_cache",
           "init_params", "params_from_tensors", "params_to_tensors"]
