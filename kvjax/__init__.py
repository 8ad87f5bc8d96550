"""kvjax: exact long-context decoding in JAX.

Public API (the same arguments and stats keys for every model family):
    load, logits, generate, stream              — load a Hugging Face model directory, full-cache decoding (one prompt,
                                                  a batch, or streamed); Generation, Delta, Sampling
    generate_vericache, reference_decode        — VeriCache (lossy draft, full-cache verify) and its reference
    PrefixCache, forms_for                      — the prefix cache and a family's block layout
    VeriCacheScheduler, FullCacheScheduler, Request — many requests under one device-memory budget
    Model, Family, families                     — what `load` returns; model families as values
and every error class (`kvjax.errors`).
"""

from kvjax.api import (DEFAULT_MAX_NEW_TOKENS, check_token_ids, generate, generate_vericache, load, logits,
                       reference_decode, stream)
from kvjax.decode.sampling import Sampling
from kvjax.errors import (BudgetError, CapacityError, CorruptEntry, InputError, KvjaxError, StaleLease,
                          UnsupportedConfigError, UnsupportedFeatureError, WeightsError)
from kvjax.families import Family, forms_for
from kvjax.generation import Delta, Generation
from kvjax.model import Model
from kvjax.models.llama.config import ModelConfig, config_from_hf, load_config
from kvjax.prefix import PrefixCache
from kvjax.scheduling.full_scheduler import FullCacheScheduler
from kvjax.scheduling.vericache_scheduler import Request, VeriCacheScheduler

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "BudgetError", "CapacityError", "CorruptEntry", "Delta", "Family",
           "FullCacheScheduler", "Generation", "InputError", "KvjaxError", "Model", "ModelConfig", "PrefixCache",
           "Request", "Sampling", "StaleLease", "UnsupportedConfigError", "UnsupportedFeatureError",
           "VeriCacheScheduler", "WeightsError", "check_token_ids", "config_from_hf", "forms_for", "generate",
           "generate_vericache", "load", "load_config", "logits", "reference_decode", "stream"]
__version__ = "0.3.0"
