"""GGUF metadata -> the Hugging Face config dict a family's `config_from_hf` reads, for the `llama` and `qwen2`
architectures (the ones whose layers kvjax's Llama family runs as llama.cpp does).

The keys are llama.cpp's (`{arch}.block_count`, `{arch}.attention.head_count`, ...); a key the model needs and the
file lacks, an architecture kvjax does not run, or a rope scaling it does not implement raises an error naming it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvjax.errors import UnsupportedConfigError

ARCHITECTURES = ("llama", "qwen2")
_ROPE_SCALING = ("none", "linear", "yarn")


def _scalar(v):
    return v.item() if isinstance(v, np.generic) else v


def architecture(meta: dict, path: str) -> str:
    """`general.architecture`, checked against the ones kvjax runs."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedConfigError(f"{path}: general.architecture={arch!r}; kvjax reads {ARCHITECTURES} from GGUF")
    return arch


def hf_config(meta: dict, path: str, n_vocab_rows: int, tied: bool) -> dict[str, Any]:
    """The HF config dict of a GGUF file's metadata.

    Args:
        meta: the file's metadata.
        path: the file (named in errors).
        n_vocab_rows: rows of `token_embd.weight` (the vocabulary size when `{arch}.vocab_size` is absent).
        tied: True when the file has no `output.weight` (the output projection is the token embedding).
    """
    arch = architecture(meta, path)

    def get(key, default=None, required=True):
        v = meta.get(f"{arch}.{key}", default)
        if v is None and required:
            raise UnsupportedConfigError(f"{path}: metadata key {arch}.{key} is missing")
        return _scalar(v)

    heads = int(get("attention.head_count"))
    kv = get("attention.head_count_kv", heads)
    if isinstance(kv, np.ndarray):  # per-layer head counts (some hybrids) are not a dense Llama
        if len(set(kv.tolist())) != 1:
            raise UnsupportedConfigError(f"{path}: {arch}.attention.head_count_kv varies per layer ({kv.tolist()})")
        kv = int(kv[0])
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedConfigError(f"{path}: {arch}.attention.value_length differs from key_length")
    rot = int(get("rope.dimension_count", head_dim))
    if rot != head_dim:
        raise UnsupportedConfigError(f"{path}: {arch}.rope.dimension_count={rot}, head dim {head_dim}: partial "
                                     f"rotary is not supported")
    ctx = int(get("context_length", 2048))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type", "none")
    if scaling not in _ROPE_SCALING:
        raise UnsupportedConfigError(f"{path}: {arch}.rope.scaling.type={scaling!r}; supported: {_ROPE_SCALING}")
    if scaling != "none":
        rope.update(rope_type=scaling, factor=float(get("rope.scaling.factor")))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    hf = {
        "model_type": arch,
        "vocab_size": int(get("vocab_size", n_vocab_rows)),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope,
        "max_position_embeddings": ctx,
        "tie_word_embeddings": bool(tied),
        "hidden_act": "silu",
    }
    if meta.get(f"{arch}.attention.sliding_window") is not None:
        raise UnsupportedConfigError(f"{path}: {arch}.attention.sliding_window is set; GGUF sliding windows are not "
                                     f"supported")
    if bos is not None:
        hf["bos_token_id"] = int(bos)
    # llama.cpp ends a turn at EOS and at the end-of-turn / end-of-message tokens when a file names them
    ends = [int(t) for t in (eos, meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id"))
            if t is not None]
    if ends:
        hf["eos_token_id"] = ends[0] if len(set(ends)) == 1 else list(dict.fromkeys(ends))
    return hf
