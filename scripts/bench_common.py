"""What the benchmark scripts share: the model under test, its held-out prompts and the static drafters' settings."""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


# The six static drafters' settings every benchmark compares (4x budget; dropquant halves and quantizes).
STATIC_DRAFTERS = {
    "streaming": dict(ratio=4.0),
    "snapkv": dict(ratio=4.0, obs_window=32),
    "kvzip": dict(ratio=4.0, chunk=512),
    "kivi4": dict(residual=128),
    "kivi2": dict(residual=128),
    "dropquant": dict(ratio=2.0, bits=4, residual=128, chunk=512),
}


def random_model(config, seed: int = 0, tokenizer=None):
    """A `kvjax.Model` of `config` (any family) with randomly initialised params (`family.init_params`)."""
    from kvjax.families import family_of_config
    from kvjax.model import Model

    fam = family_of_config(config)
    return Model(config=config, params=fam.init_params(config, jax.random.key(seed)), family=fam,
                 tokenizer=tokenizer)


def random_model_like(checkpoint: str):
    """A randomly initialised model of the checkpoint's config (with its tokenizer when present).

    Random weights accept every draft; use it only to isolate mechanism costs from model quality, and say so.
    Without a checkpoint: the original bundled shape (4 layers, hidden 256, 8 x 4 heads of 32).
    """
    import json

    from kvjax.families import family_for

    tok = None
    if os.path.exists(os.path.join(checkpoint, "tokenizer.json")):
        from kvjax.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(checkpoint)
    cfg_path = os.path.join(checkpoint, "config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            hf = json.load(f)
    else:
        hf = dict(model_type="llama", vocab_size=tok.vocab_size if tok is not None else 4096, hidden_size=256,
                  intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072)
    return random_model(family_for(hf.get("model_type")).config_from_hf(hf), tokenizer=tok)


def model_label(path: str) -> str:
    """How results name a model directory: relative to the repository when inside it, else by its last component
    only (results never record a path of the machine that made them)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = os.path.abspath(path)
    if full.startswith(root + os.sep):
        return os.path.relpath(full, root)
    return os.path.basename(os.path.normpath(path))


def load_bench_model(checkpoint: str, random: bool):
    """(model, name): the trained checkpoint, or a random model of its shape when asked or when it is missing."""
    from kvjax import api

    if not random and os.path.exists(os.path.join(checkpoint, "config.json")):
        return api.load(checkpoint), model_label(checkpoint)
    if not random:
        print(f"[bench] no trained checkpoint in {checkpoint}: using a random model of its shape", flush=True)
    return random_model_like(checkpoint), "random-init"


def bench_prompts(model, n_tokens: int, count: int, seed: int):
    """(prompts, source): held-out stdlib code of exactly n_tokens each, or random ids without a tokenizer."""
    if model.tokenizer is not None:
        try:
            from kvjax.data import corpus

            ps = corpus.long_prompts(model.tokenizer, n_tokens, count, seed)
            return [np.asarray(p, np.int32)[:n_tokens] for p in ps], "heldout corpus"
        except Exception as e:  # noqa: BLE001 - fall back loudly
            print(f"[bench] long_prompts unavailable ({type(e).__name__}: {e}); using random token ids")
    rng = np.random.default_rng(seed)
    return [rng.integers(0, model.config.vocab_size, n_tokens).astype(np.int32) for _ in range(count)], "random ids"


def tokens_and_stats(result):
    """(tokens i32[M], stats dict) from a VeriCache run's result: a (tokens, stats[, logits]) tuple, or a
    `Generation`-like object (array-like tokens with `.stats`)."""
    if isinstance(result, tuple):
        return np.asarray(result[0]), result[1]
    return np.asarray(result), result.stats


def native_status() -> dict:
    """The native CPU attention kernel's status for a results file: the built library by file name only (results
    never record a path of the machine that made them)."""
    import pallas_kernels.native

    st = dict(pallas_kernels.native.status())
    if st.get("library"):
        st["library"] = os.path.basename(st["library"])
    return st


def best_of(fn, reps: int) -> float:
    """Best wall time in seconds of `reps` calls of fn (which returns something to block on)."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def parse_contexts(ap, value: str, minimum: int) -> list[int]:
    """`--context`'s comma-separated prompt lengths, each at least `minimum` tokens (`ap.error` otherwise)."""
    try:
        contexts = [int(c) for c in value.split(",") if c]
    except ValueError:
        ap.error(f"--context must be comma-separated integers, got {value!r}")
    if not contexts or min(contexts) < minimum:
        ap.error(f"--context lengths must be at least {minimum} tokens, got {value!r}")
    return contexts
