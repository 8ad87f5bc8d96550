"""DeepSeek-V4 behind kvjax's public API: `kvjax.load` dispatches here for `model_type == "deepseek_v4"`.

Provides `load`, `logits(model, ids)`, `generate(model, ids, max_new_tokens, stop_at_eos=...)` and the jitted steps
they use (static shapes: a fixed prefill chunk, one-token decode in a `lax.fori_loop`; the cache is donated).
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.capacity import pick_capacity
from kvjax.cache.hybrid import HybridCache
from kvjax.models.deepseek_v4.cache import init_cache
from kvjax.decode.steps import greedy_loop, truncate_at_eos
from kvjax.models import deepseek_v4
from kvjax.models.deepseek_v4.config import DeepseekV4Config, config_from_hf
from kvjax.models.deepseek_v4.weights import params_from_tensors
from kvjax.checkpoint import read_safetensors

DEFAULT_CHUNK = 256
SHORT_CHUNK = 64  # prompts up to this long run as one chunk of this width (one compiled shape for all of them)


def load(path: str | os.PathLike, hf_config: dict, *, dtype: str = "f32"):
    """Load a DeepSeek-V4 model directory (config.json + safetensors [+ tokenizer.json]) into a `kvjax.api.Model`.

    Raises:
        UnsupportedConfigError / WeightsError: naming the field or tensor at fault.
    """
    from kvjax.api import Model  # noqa: PLC0415 - kvjax.api imports this module lazily

    path = os.fspath(path)
    config = config_from_hf(hf_config)
    params = params_from_tensors(config, read_safetensors(path), dtype=dtype)
    tok = None
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        from kvjax.tokenizer import Tokenizer  # noqa: PLC0415 - optional dependency of the API only

        tok = Tokenizer.from_dir(path)
    return Model(config=config, params=params, tokenizer=tok, path=path, dtype=dtype, family_api=sys.modules[__name__])


@functools.partial(jax.jit, donate_argnames="cache")
def forward_step(params, config: DeepseekV4Config, cache: HybridCache, tokens: jax.Array, n_valid: jax.Array):
    """All-row logits for `T` new tokens (prefill chunk / multi-token verify). Returns (logits f32[B, T, V], cache)."""
    return deepseek_v4.forward(params, config, cache, tokens, n_valid)


@functools.partial(jax.jit, static_argnames="num_steps", donate_argnames="cache")
def greedy_decode(params, config: DeepseekV4Config, cache: HybridCache, first: jax.Array, *, num_steps: int):
    """`num_steps` one-token greedy steps in one `lax.fori_loop`; `first` i32[B] is fed first.

    Returns (i32[B, num_steps] tokens produced after `first`, cache).
    """
    return greedy_loop(lambda c, t, n: deepseek_v4.forward(params, config, c, t, n), cache, first, num_steps)


def _dtype(model):
    return jnp.bfloat16 if model.dtype in ("bf16", "bfloat16") else jnp.float32


def prefill(params, config: DeepseekV4Config, cache: HybridCache, ids: np.ndarray, *, chunk: int = DEFAULT_CHUNK):
    """Feed one sequence (batch 1) in fixed-size padded chunks. Returns (all-row logits f32[T, V], cache)."""
    ids = np.asarray(ids, np.int32).reshape(-1)
    if ids.size == 0:
        raise ValueError("prompt must hold at least one token id")
    if ids.size + int(cache.length[0]) > cache.capacity:
        raise ValueError(f"{ids.size} tokens do not fit the cache ({cache.capacity} tokens, "
                         f"{int(cache.length[0])} used)")
    if ids.size <= SHORT_CHUNK:
        chunk = min(chunk, SHORT_CHUNK)
    out = []
    for s in range(0, ids.size, chunk):
        part = ids[s:s + chunk]
        buf = np.zeros((1, chunk), np.int32)
        buf[0, :part.size] = part
        lg, cache = forward_step(params, config, cache, jnp.asarray(buf), jnp.asarray([part.size], jnp.int32))
        out.append(np.asarray(lg[0, :part.size]))
    return np.concatenate(out, axis=0), cache


def logits(model, ids) -> np.ndarray:
    """Full-forward logits f32[T, V] of one sequence (chunked prefill through the cache, all rows kept)."""
    ids = np.asarray(ids, np.int32).reshape(-1)
    cache = init_cache(model.config, 1, pick_capacity(ids.size), _dtype(model))
    return prefill(model.params, model.config, cache, ids)[0]


def generate(model, ids, max_new_tokens: int = 32, *, stop_at_eos: bool = True) -> np.ndarray:
    """Greedy full-cache decoding. Returns i32[<= max_new_tokens] new token ids (ends at EOS, inclusive)."""
    ids = np.asarray(ids, np.int32).reshape(-1)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cache = init_cache(model.config, 1, pick_capacity(ids.size + max_new_tokens), _dtype(model))
    lg, cache = prefill(model.params, model.config, cache, ids)
    first = int(np.argmax(lg[-1]))
    toks = [first]
    if max_new_tokens > 1:
        rest, cache = greedy_decode(model.params, model.config, cache, jnp.asarray([first], jnp.int32),
                                    num_steps=max_new_tokens - 1)
        toks += [int(t) for t in np.asarray(rest[0])]
    out = np.asarray(toks, np.int32)
    if stop_at_eos:
        out = truncate_at_eos(out, model.config.eos_token_ids)
    return out
