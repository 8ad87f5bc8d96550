"""DeepSeek-V4 (sliding / CSA / HCA hybrid attention) as a `Family` value."""

from __future__ import annotations

from kvjax.families.base import Family
from kvjax.models.deepseek_v4 import cache, config, draft, model, verify, weights
from kvjax.models.deepseek_v4.config import DeepseekV4Config
from kvjax.prefix.layouts.deepseek_v4 import DeepseekV4BlockLayout

DEEPSEEK_V4 = Family(
    name="deepseek_v4",
    model_types=("deepseek_v4",),
    config_type=DeepseekV4Config,
    config_from_hf=config.config_from_hf,
    params_from_tensors=weights.params_from_tensors,
    params_to_tensors=weights.params_to_tensors,
    hf_config_dict=config.hf_config_dict,
    init_params=weights.init_params,
    init_cache=cache.init_cache,
    read_bytes=cache.read_bytes,
    forward=model.forward,
    verify_forward=verify.verify_forward,
    commit=verify.commit,
    draft_forward=draft.draft_forward,
    draft_commit=draft.draft_commit,
    draft_split=draft.draft_split,
    draft_join=draft.draft_join,
    compressor=draft.make_compressor,
    compressors=draft.COMPRESSORS,
    prefix_layout=DeepseekV4BlockLayout,
)
