"""Model families as values: the `Family` protocol and the registry keyed by Hugging Face `model_type`."""

from kvjax.families.base import Family
from kvjax.families.registry import FAMILIES, family_for, family_of_config, forms_for, supported_model_types

__all__ = ["FAMILIES", "Family", "family_for", "family_of_config", "forms_for", "supported_model_types"]
