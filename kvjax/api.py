"""The small public API: `load`, `logits`, `generate` — the same for every model family."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

import pallas_kernels
from kvjax.arrays import np_dtype
from kvjax.cache.capacity import pick_capacity
from kvjax.checkpoint import read_safetensors
from kvjax.decode import steps
from kvjax.errors import InputError
from kvjax.families import family_for
from kvjax.model import Model


def load(path: str | os.PathLike, *, dtype: str = "f32", attention: str | None = None) -> Model:
    """Load a Hugging Face-format model directory (config.json + safetensors [+ tokenizer.json]).

    Args:
        path: model directory.
        dtype: parameter and cache dtype, "f32" (CPU default: measured ~10x faster than bf16 there) or "bf16".
        attention: attention implementation: None (Pallas kernels on a GPU, XLA elsewhere), "xla", "pallas",
            "pallas_interpret", "pallas_debug".

    Raises:
        FileNotFoundError: no config.json.
        UnsupportedConfigError / WeightsError: naming the field or tensor at fault.
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(cfg_path, encoding="utf-8") as f:
        hf = json.load(f)
    np_dtype(dtype)  # an unknown dtype name fails here, naming the choices
    family = family_for(hf.get("model_type"))
    config = family.config_from_hf(hf)
    params = family.params_from_tensors(config, read_safetensors(path), dtype=dtype)
    tok = None
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        from kvjax.tokenizer import Tokenizer  # noqa: PLC0415 - only models with a tokenizer need it

        tok = Tokenizer.from_dir(path)
    return Model(config=config, params=params, family=family, tokenizer=tok, path=path, dtype=dtype,
                 attention=pallas_kernels.resolve(attention))


def check_token_ids(model: Model, token_ids, name: str = "prompt") -> np.ndarray:
    """The token ids as i32[T], or InputError naming the first bad id and its index.

    Token ids must be a non-empty 1-D sequence of integers in [0, vocab_size).
    """
    a = np.asarray(token_ids) if not isinstance(token_ids, np.ndarray) else token_ids
    if a.dtype == object:
        raise InputError(f"{name} must be a 1-D sequence of integer token ids (got a ragged or mixed sequence)")
    if a.ndim != 1:
        raise InputError(f"{name} must be a 1-D sequence of token ids, got shape {a.shape}")
    if a.size == 0:
        raise InputError(f"{name} is empty: give at least one token id")
    if not np.issubdtype(a.dtype, np.integer):
        bad = np.nonzero(~np.isfinite(a) | (a != np.floor(a)))[0] if np.issubdtype(a.dtype, np.floating) else []
        i = int(bad[0]) if len(bad) else 0
        raise InputError(f"{name} token ids must be integers, got {a[i]!r} at index {i} (dtype {a.dtype})")
    V = model.config.vocab_size
    bad = np.nonzero((a < 0) | (a >= V))[0]
    if bad.size:
        i = int(bad[0])
        raise InputError(f"{name} token id {int(a[i])} at index {i} is outside the vocabulary [0, {V})")
    return a.astype(np.int32)


def logits(model: Model, token_ids) -> np.ndarray:
    """Full-forward logits f32[T, vocab] for one sequence (chunked prefill, all rows kept)."""
    ids = check_token_ids(model, token_ids)
    cache = model.family.init_cache(model.config, 1, pick_capacity(ids.size), model.cache_dtype)
    return steps.prefill(model, cache, ids, all_logits=True)[0]


def generate(model: Model, prompt_ids, max_new_tokens: int = 32, *, stop_at_eos: bool = True,
             temperature: float = 0.0, seed: int = 0) -> np.ndarray:
    """Full-cache decoding of one prompt: greedy, or position-keyed sampling at `temperature`.

    Returns:
        i32[<= max_new_tokens] new token ids (ends at EOS, inclusive, when `stop_at_eos`).
    """
    ids = check_token_ids(model, prompt_ids)
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    from kvjax.decode.vericache import first_token  # noqa: PLC0415 - the one first-token rule

    cache = model.family.init_cache(model.config, 1, pick_capacity(ids.size + max_new_tokens), model.cache_dtype)
    last, cache = steps.prefill(model, cache, ids)
    seed_a = jnp.asarray([seed], jnp.int32)
    first = first_token(last, ids.size, seed_a, temperature)
    toks = [int(first[0])]
    if max_new_tokens > 1:
        rest, cache = steps.decode(model.params, model.config, cache, first, seed_a, num_steps=max_new_tokens - 1,
                                   temperature=float(temperature), family=model.family, impl=model.attention)
        toks += [int(t) for t in np.asarray(rest[0])]
    out = np.asarray(toks, np.int32)
    if stop_at_eos:
        out = steps.truncate_at_eos(out, model.config.eos_token_ids)
    return out
