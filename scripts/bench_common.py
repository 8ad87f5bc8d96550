"""What the benchmark scripts share: the model under test and its held-out prompts."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def random_model_like(checkpoint: str):
    """A randomly initialised model of the bundled checkpoint's shape (with its tokenizer when present).

    Random weights accept every draft; use it only to isolate mechanism costs from model quality, and say so.
    """
    from kvjax import api
    from kvjax.models.layer_types import FULL
    from kvjax.models.llama.config import ModelConfig
    from kvjax.models.rope import RopeConfig
    from kvjax.models import llama

    tok = None
    if os.path.exists(os.path.join(checkpoint, "tokenizer.json")):
        from kvjax.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(checkpoint)
    V = tok.vocab_size if tok is not None else 4096
    cfg = ModelConfig(family="llama", vocab_size=V, hidden_size=256, intermediate_size=768, num_layers=4,
                      num_heads=8, num_kv_heads=4, head_dim=32, rms_norm_eps=1e-5, rope=RopeConfig(theta=10000.0),
                      layer_types=(FULL,) * 4, tie_word_embeddings=True, max_position_embeddings=131072)
    return api.Model(config=cfg, params=llama.init_params(cfg, jax.random.key(0)), tokenizer=tok, path=None,
                     dtype="f32")


def load_bench_model(checkpoint: str, random: bool):
    """(model, name): the trained checkpoint, or a random model of its shape when asked or when it is missing."""
    from kvjax import api

    if not random and os.path.exists(os.path.join(checkpoint, "config.json")):
        return api.load(checkpoint), checkpoint
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
