"""The small public API: `load`, `logits`, `generate`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from kvjax.models.llama.cache import init_cache
from kvjax.cache.capacity import pick_capacity
from kvjax.models.llama.config import ModelConfig, config_from_hf
from kvjax.decode import steps
from kvjax.models.llama.weights import params_from_tensors
from kvjax.checkpoint import read_safetensors


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: static config, params pytree, tokenizer (when the directory has one) and where it came from."""

    config: ModelConfig
    params: Any
    tokenizer: Any = None
    path: str | None = None
    dtype: str = "f32"
    # Families other than Llama (e.g. DeepSeek-V4) plug in a module with `logits(model, ids)` and
    # `generate(model, ids, max_new_tokens, stop_at_eos=...)`; None means the Llama-family path below.
    family_api: Any = None


def load(path: str | os.PathLike, *, dtype: str = "f32") -> Model:
    """Load a Hugging Face-format model directory (config.json + safetensors [+ tokenizer.json]).

    Args:
        path: model directory.
        dtype: parameter and cache dtype, "f32" (CPU default: measured ~10x faster than bf16 there) or "bf16".

    Raises:
        UnsupportedConfigError / WeightsError: naming the field or tensor at fault.
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(cfg_path) as f:
        hf = json.load(f)
    if hf.get("model_type") == "deepseek_v4":
        from kvjax.models.deepseek_v4 import (api_old as deepseek_v4_api)  # noqa: PLC0415 - optional family, imported on demand

        return deepseek_v4_api.load(path, hf, dtype=dtype)
    config = config_from_hf(hf)
    params = params_from_tensors(config, read_safetensors(path), dtype=dtype)
    tok = None
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        from kvjax.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(path)
    return Model(config=config, params=params, tokenizer=tok, path=path, dtype=dtype)


def _cache_dtype(model: Model):
    return jnp.bfloat16 if model.dtype in ("bf16", "bfloat16") else jnp.float32


def logits(model: Model, token_ids) -> np.ndarray:
    """Full-forward logits f32[T, vocab] for one sequence (chunked prefill, all rows kept)."""
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    if getattr(model, "family_api", None) is not None:
        return model.family_api.logits(model, ids)
    cache = init_cache(model.config, 1, pick_capacity(ids.size), _cache_dtype(model))
    out = []
    C = steps.DEFAULT_CHUNK
    for s in range(0, ids.size, C):
        part = ids[s:s + C]
        buf = np.zeros((1, C), np.int32)
        buf[0, :part.size] = part
        lg, cache = steps.forward_step(model.params, model.config, cache, jnp.asarray(buf),
                                       jnp.asarray([part.size], jnp.int32))
        out.append(np.asarray(lg[0, :part.size]))
    return np.concatenate(out, axis=0)


def generate(model: Model, prompt_ids, max_new_tokens: int = 32, *, stop_at_eos: bool = True) -> np.ndarray:
    """Greedy full-cache decoding. Returns i32[<= max_new_tokens] new token ids (ends at EOS, inclusive)."""
    ids = np.asarray(prompt_ids, np.int32).reshape(-1)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if getattr(model, "family_api", None) is not None:
        return model.family_api.generate(model, ids, max_new_tokens, stop_at_eos=stop_at_eos)
    cache = init_cache(model.config, 1, pick_capacity(ids.size + max_new_tokens), _cache_dtype(model))
    last, cache = steps.prefill(model.params, model.config, cache, ids)
    first = jnp.argmax(last).astype(jnp.int32)[None]
    toks = [int(first[0])]
    if max_new_tokens > 1:
        rest, cache = steps.greedy_decode(model.params, model.config, cache, first, num_steps=max_new_tokens - 1)
        toks += [int(t) for t in np.asarray(rest[0])]
    out = np.asarray(toks, np.int32)
    if stop_at_eos:
        out = steps.truncate_at_eos(out, model.config.eos_token_ids)
    return out
