"""Model families by Hugging Face `model_type`: the one place that maps an architecture to its code."""

from __future__ import annotations

from kvjax.errors import UnsupportedConfigError
from kvjax.families.base import Family
from kvjax.families.deepseek_v4 import DEEPSEEK_V4
from kvjax.families.llama import LLAMA

FAMILIES: tuple[Family, ...] = (LLAMA, DEEPSEEK_V4)
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def supported_model_types() -> tuple[str, ...]:
    """Every `model_type` kvjax can load."""
    return tuple(_BY_MODEL_TYPE)


def family_for(model_type) -> Family:
    """The family of a Hugging Face `model_type`.

    Raises:
        UnsupportedConfigError: naming the model_type and the supported ones.
    """
    fam = _BY_MODEL_TYPE.get(model_type)
    if fam is None:
        raise UnsupportedConfigError(f"model_type={model_type!r}; supported: {supported_model_types()}")
    return fam


def family_of_config(config) -> Family:
    """The family a config object belongs to (by its type)."""
    for fam in FAMILIES:
        if isinstance(config, fam.config_type):
            return fam
    raise UnsupportedConfigError(f"no model family has config type {type(config).__name__}")


def forms_for(config, dtype, block_size: int | None = None):
    """The prefix-cache BlockLayout (block layout) of a model config: `family.prefix_layout(config, dtype, block_size)`.

    Args:
        block_size: tokens per block `P` (default: the family's).
    """
    fam = family_of_config(config)
    layout = fam.require("prefix_layout", "the prefix cache")
    return layout(config, dtype) if block_size is None else layout(config, dtype, block_size)
