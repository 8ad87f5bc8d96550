"""DeepSeek-V4 (sliding / CSA / HCA hybrid attention) as a `Family` value."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from kvjax import sharding
from kvjax.families.base import Family
from kvjax.models.deepseek_v4 import cache, config, draft, model, offload, verify, weights
from kvjax.models.deepseek_v4.config import DeepseekV4Config
from kvjax.models.deepseek_v4.sharding import param_specs
from kvjax.prefix.layouts.deepseek_v4 import DeepseekV4BlockLayout


def shard_params(params, config_: DeepseekV4Config, mesh, *, vocab: bool | None = None):
    """Place DeepSeek-V4 params on `mesh`: query heads, experts and MLP on "tp" (`param_specs`), replicated over
    "dp"."""
    specs = param_specs(params, config_, mesh.shape[sharding.TP], axis=sharding.TP, vocab=vocab)
    return jax.tree.map(lambda x, s: sharding.place(x, NamedSharding(mesh, s)), params, specs)


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
    offload_split=offload.offload_split,
    offload_join=offload.offload_join,
    offload_update=offload.offload_update,
    prefix_layout=DeepseekV4BlockLayout,
    shard_params=shard_params,
)
