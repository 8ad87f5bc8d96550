"""GGUF tensors -> Hugging Face tensor names and layouts, so a family's `params_from_tensors` checks and maps them.

llama.cpp names tensors `token_embd`, `blk.{i}.attn_q`, ... and, for the `llama` architecture, stores the query and
key projections with their rows permuted: within each head, rotary pairs are interleaved (rows 2j, 2j+1 hold HF rows
j, j + D/2), because llama.cpp's rope rotates adjacent pairs while HF's rotates halves. Loading undoes that
permutation; `qwen2` files keep HF's order (llama.cpp runs them with NeoX-style rope), so nothing is undone there.
A file without `output.weight` ties the output projection to the token embedding.
"""

from __future__ import annotations

import numpy as np

from kvjax.errors import WeightsError

# GGUF per-layer suffix -> HF per-layer name
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str:
    """The HF tensor name of a GGUF tensor name; WeightsError naming it when kvjax has no place for it."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    raise WeightsError(f"unexpected GGUF tensor {gguf_name!r} (kvjax maps {sorted(_TOP)} and blk.N."
                       f"{{{', '.join(sorted(_LAYER))}}})")


def uninterleave_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaved rotary rows -> HF's half-split rows, per head, for a [heads * D, ...] weight or bias.

    The inverse of llama.cpp's `permute` in its HF converter (`scripts/gguf_export.py` applies that one)."""
    rows = w.shape[0]
    if rows % (2 * heads):
        raise WeightsError(f"a rotary projection of {rows} rows cannot be split into {heads} heads of pairs")
    rest = w.shape[1:]
    return w.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(file, arch: str, num_heads: int, num_kv_heads: int) -> dict[str, np.ndarray]:
    """Every tensor of a `GGUFFile`, dequantised to f32, under its HF name and in HF's row order."""
    out = {}
    for name in file.tensors:
        key = hf_name(name)
        t = file.tensor(name)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            t = uninterleave_rotary(t, num_heads)
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            t = uninterleave_rotary(t, num_kv_heads)
        out[key] = t
    return out
