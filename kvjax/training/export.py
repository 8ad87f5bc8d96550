"""Write a trained model as a kvjax / transformers checkpoint folder: config.json, bf16 model.safetensors, an
Orbax copy of the bf16 params, and the tokenizer files."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp


def shipped_params(params: Any) -> Any:
    """The params as shipped: rounded to bf16, kept in f32 (what evaluation of the shipped weights computes with)."""
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params)


def export_checkpoint(out: str, family: str, ship_cfg: Any, params: Any, tokenizer_dir: str) -> None:
    """Write `out`/config.json, model.safetensors (bf16), orbax/ (bf16 params) and the tokenizer of `tokenizer_dir`."""
    from safetensors.numpy import save_file

    from kvjax.checkpoint import save_orbax

    os.makedirs(out, exist_ok=True)
    rounded = shipped_params(params)
    if family == "llama":
        from kvjax.models.llama.weights import hf_config_dict, params_to_tensors

        hf = hf_config_dict(ship_cfg, torch_dtype="bfloat16")
        tensors = params_to_tensors(ship_cfg, rounded, dtype="bf16")
    else:
        from kvjax.models import deepseek_v4

        hf = deepseek_v4.hf_config_dict(ship_cfg)
        tensors = deepseek_v4.params_to_tensors(ship_cfg, rounded, dtype="bf16")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    orbax_dir = os.path.join(out, "orbax")
    if os.path.exists(orbax_dir):
        shutil.rmtree(orbax_dir)
    save_orbax(orbax_dir, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params))
    marker = os.path.join(orbax_dir, "commit_success.txt")  # names this machine's path; restore does not need it
    if os.path.exists(marker):
        os.remove(marker)
    if os.path.abspath(tokenizer_dir) != os.path.abspath(out):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out, name))
