"""A GGUF model file -> (HF config dict, HF-named f32 tensors, tokenizer): what `kvjax.load` builds a Model from."""

from __future__ import annotations

import os

import numpy as np

from kvjax.formats.gguf_config import architecture, hf_config
from kvjax.formats.gguf_file import GGUFError, GGUFFile
from kvjax.formats.gguf_tokenizer import gguf_tokenizer
from kvjax.formats.gguf_weights import hf_tensors
from kvjax.tokenizer import Tokenizer


def gguf_path(path: str) -> str | None:
    """The GGUF file `path` names: the file itself, or the one .gguf in a directory that has no config.json.

    Returns None for a Hugging Face directory (config.json present, or no .gguf at all).

    Raises:
        GGUFError: a directory with several .gguf files and no config.json (naming them).
    """
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(found) > 1:
        raise GGUFError(f"{path} holds {len(found)} GGUF files ({', '.join(found)}); name the one to load")
    return os.path.join(path, found[0]) if found else None


def read_gguf(path: str) -> tuple[dict, dict[str, np.ndarray], Tokenizer | None]:
    """Read a GGUF model: the HF config dict, every tensor dequantised to f32 under its HF name, the tokenizer.

    Raises:
        GGUFError: a malformed or truncated file; UnsupportedConfigError: an architecture, rope scaling or tokenizer
        kvjax does not run; WeightsError: a tensor kvjax has no place for (each naming it).
    """
    f = GGUFFile(path)
    meta = f.metadata
    arch = architecture(meta, path)
    if "token_embd.weight" not in f.tensors:
        raise GGUFError(f"{path}: missing tensor 'token_embd.weight'")
    hf = hf_config(meta, path, f.tensors["token_embd.weight"].shape[0], tied="output.weight" not in f.tensors)
    tensors = hf_tensors(f, arch, hf["num_attention_heads"], hf["num_key_value_heads"])
    tok = gguf_tokenizer(meta, path) if "tokenizer.ggml.model" in meta else None
    return hf, tensors, tok
