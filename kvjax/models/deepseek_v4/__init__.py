"""DeepSeek-V4 (sliding / CSA / HCA hybrid attention): config, weights, layers, cache, forward, draft forms."""

from kvjax.models.deepseek_v4.model import (HybridCache, config_for_training, forward, forward_train, hf_config_dict,
                                            init_cache, init_params, params_from_tensors, params_to_tensors)

__all__ = ["HybridCache", "config_for_training", "forward", "forward_train", "hf_config_dict", "init_cache",
           "init_params", "params_from_tensors", "params_to_tensors"]
