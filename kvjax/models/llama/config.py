"""ModelConfig: a frozen, static description of a Llama-family model built from a Hugging Face config.json.

Everything that changes the computation (and therefore the keys and values a cache holds) is a field here, so the
prefix-cache identity can be derived from it. Anything kvjax cannot run raises `UnsupportedConfigError` naming the
field, instead of silently computing something else.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import jax

from kvjax.errors import UnsupportedConfigError
from kvjax.models.config_fields import KVFields
from kvjax.models.layer_types import FULL, SLIDING
from kvjax.models.rope import SUPPORTED_ROPE_TYPES, RopeConfig

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ModelConfig(KVFields):
    """Static model description; hashable, so it can be passed straight into jitted functions."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group)."""
        return self.num_heads // self.num_kv_heads


# Fields that, when present with a non-default value, change the computation in ways kvjax does not implement.
_UNSUPPORTED_IF_SET = {
    "attention_dropout": (0, 0.0, None),
    "mlp_bias": (False, None),
    "pretraining_tp": (1, None),
    "use_mrope": (False, None),
    "quantization_config": (None,),
}
def _rope_from_hf(hf: Mapping[str, Any], head_dim: int, max_pos: int) -> RopeConfig:
    params = hf.get("rope_parameters")
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        if "rope_theta" in hf:
            params.setdefault("rope_theta", hf["rope_theta"])
    else:
        params = dict(params)
        if any(isinstance(v, Mapping) for v in params.values()):
            raise UnsupportedConfigError("rope_parameters: per-layer-type rope parameters are not supported for this family")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedConfigError(f"rope_parameters.rope_type={rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    prf = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if prf != 1.0:
        raise UnsupportedConfigError(f"partial_rotary_factor={prf}: only 1.0 is supported for the Llama family")
    orig = int(params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings", max_pos)))
    factor = params.get("factor", 1.0)
    if rope_type in ("linear", "llama3", "yarn") and factor is None and rope_type != "yarn":
        raise UnsupportedConfigError(f"rope_parameters.factor is required for rope_type={rope_type!r}")
    if factor is None:  # yarn derives it from the two context lengths, as transformers does
        factor = max_pos / orig
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=orig,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
        mscale=None if params.get("mscale") is None else float(params["mscale"]),
        mscale_all_dim=None if params.get("mscale_all_dim") is None else float(params["mscale_all_dim"]),
        truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=prf,
    )


def _layer_types(hf: Mapping[str, Any], family: str, n: int) -> tuple[tuple[str, ...], int | None]:
    """Derive per-layer attention types exactly as transformers does for each family."""
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window", False):
            window = None
        types = hf.get("layer_types")
        if types is None:
            mwl = hf.get("max_window_layers", 28)
            types = [SLIDING if window is not None and i >= mwl else FULL for i in range(n)]
    elif family == "mistral":
        if hf.get("layer_types") is not None:
            types = hf["layer_types"]
        else:
            types = [SLIDING if window is not None else FULL] * n
    else:  # llama
        types = hf.get("layer_types") or [FULL] * n
        if window is not None and SLIDING not in types:
            window = None
    types = tuple(types)
    if len(types) != n:
        raise UnsupportedConfigError(f"layer_types has {len(types)} entries, num_hidden_layers={n}")
    for t in types:
        if t not in (FULL, SLIDING):
            raise UnsupportedConfigError(f"layer_types entry {t!r}; supported: {(FULL, SLIDING)}")
    if SLIDING in types and not window:
        raise UnsupportedConfigError("layer_types has sliding_attention but sliding_window is unset")
    return types, (int(window) if (window and SLIDING in types) else None)


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a parsed Hugging Face config.json (dict).

    Raises:
        UnsupportedConfigError: naming the field that kvjax cannot run.
    """
    family = hf.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedConfigError(f"model_type={family!r}; supported: {SUPPORTED_FAMILIES} (and deepseek_v4)")
    for field, ok in _UNSUPPORTED_IF_SET.items():
        if field in hf and hf[field] not in ok:
            raise UnsupportedConfigError(f"{field}={hf[field]!r} is not supported")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedConfigError(f"hidden_act={act!r}; supported: silu")
    n_layers = int(hf["num_hidden_layers"])
    n_heads = int(hf["num_attention_heads"])
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    if n_heads % n_kv:
        raise UnsupportedConfigError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // n_heads)
    max_pos = int(hf.get("max_position_embeddings", 2048))
    types, window = _layer_types(hf, family, n_layers)
    bias = bool(hf.get("attention_bias", family == "qwen2"))
    if family == "qwen2":
        bias = True  # Qwen2 always has q/k/v bias (no config switch in transformers)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return ModelConfig(
        family=family,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(hf, head_dim, max_pos),
        layer_types=types,
        sliding_window=window,
        attention_bias=bias,
        qk_norm=family == "qwen3",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=max_pos,
        hidden_act="silu",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read `config.json` from a model directory (or the file itself) into a ModelConfig."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    with open(p) as f:
        return config_from_hf(json.load(f))


def with_rope_scaling(config: ModelConfig, rope_type: str, factor: float) -> ModelConfig:
    """`config` extended to `factor` x its trained context by rope scaling ("linear" or "yarn"), as HF would run it
    with `rope_parameters={"rope_type": rope_type, "factor": factor, "original_max_position_embeddings": trained}`.

    Opt-in only: the model never saw the scaled positions, so quality past the trained context is not measured here.

    Raises:
        UnsupportedConfigError: a rope type other than linear/yarn, a factor <= 1, or a model already scaled.
    """
    if rope_type not in ("linear", "yarn"):
        raise UnsupportedConfigError(f"rope scaling {rope_type!r}; supported: linear, yarn")
    if not factor > 1:
        raise UnsupportedConfigError(f"rope scaling factor must be > 1, got {factor}")
    if config.rope.rope_type != "default":
        raise UnsupportedConfigError(f"the model already uses {config.rope.rope_type!r} rope scaling")
    trained = config.max_position_embeddings
    rope = dataclasses.replace(config.rope, rope_type=rope_type, factor=float(factor),
                               original_max_position_embeddings=trained)
    return dataclasses.replace(config, rope=rope, max_position_embeddings=int(trained * factor))
