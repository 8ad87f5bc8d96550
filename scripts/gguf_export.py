"""Write a Llama-family kvjax checkpoint as an f32 GGUF file, so llama.cpp can run the same weights as a peer.

The tensors are the checkpoint's (names and orientation as llama.cpp's own HF converter writes them: linear weights
[out, in], the query and key projections' rows permuted from Hugging Face's half-split rotary layout to llama.cpp's
interleaved one); the tokenizer is the checkpoint's byte-level BPE (tokens, merges, special tokens). Only what the
benchmarks need: dense Llama layers (no biases, no q/k norms, no sliding windows); anything else is refused.

A GGUF file given as the checkpoint (e.g. a quantized model as shipped) is written again with every tensor
dequantised to f32 (`export_dequantised`), metadata unchanged.

Usage: python scripts/gguf_export.py checkpoints/kvjax-code-tiny kvjax-code-tiny-f32.gguf
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _interleave_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotary halves [x0..x_{d/2-1}, x_{d/2}..] per head -> llama.cpp's pairs (x0, x_{d/2}), (x1, ...)."""
    out, inp = w.shape
    return w.reshape(heads, 2, out // heads // 2, inp).swapaxes(1, 2).reshape(out, inp)


def export(checkpoint: str, path: str) -> str:
    """Write `checkpoint` (a Hugging Face Llama directory kvjax loads) to the GGUF file `path`; returns `path`."""
    import gguf

    from kvjax import api
    from kvjax.formats.gguf_write import add_llama_hparams

    model = api.load(checkpoint)
    cfg = model.config
    if model.family.name != "llama":
        raise ValueError(f"gguf export supports the llama family only, not {model.family.name!r}")
    if cfg.attention_bias or cfg.qk_norm or any(t != "full_attention" for t in cfg.layer_types):
        raise ValueError("gguf export supports plain Llama layers only (no biases, q/k norms or sliding windows)")
    with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    p = {k: v for k, v in model.params.items() if k != "layers"}
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(os.path.basename(os.path.normpath(checkpoint)))
    add_llama_hparams(w, cfg)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(w, checkpoint, cfg.vocab_size)

    f32 = lambda a: np.ascontiguousarray(np.asarray(a, np.float32))  # noqa: E731
    w.add_tensor("token_embd.weight", f32(p["embed"]))
    w.add_tensor("output_norm.weight", f32(p["final_norm"]))
    if "lm_head" in p:
        w.add_tensor("output.weight", f32(np.asarray(p["lm_head"]).T))
    for i, lp in enumerate(model.params["layers"]):
        t = lambda a: f32(np.asarray(a).T)  # noqa: E731  kvjax keeps [in, out]; GGUF wants HF's [out, in]
        w.add_tensor(f"blk.{i}.attn_norm.weight", f32(lp["attn_norm"]))
        w.add_tensor(f"blk.{i}.attn_q.weight", f32(_interleave_rotary(t(lp["wq"]), cfg.num_heads)))
        w.add_tensor(f"blk.{i}.attn_k.weight", f32(_interleave_rotary(t(lp["wk"]), cfg.num_kv_heads)))
        w.add_tensor(f"blk.{i}.attn_v.weight", t(lp["wv"]))
        w.add_tensor(f"blk.{i}.attn_output.weight", t(lp["wo"]))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", f32(lp["mlp_norm"]))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", t(lp["w_gate"]))
        w.add_tensor(f"blk.{i}.ffn_up.weight", t(lp["w_up"]))
        w.add_tensor(f"blk.{i}.ffn_down.weight", t(lp["w_down"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def export_dequantised(source: str, path: str) -> str:
    """Write the GGUF file `source` (e.g. a Q4_1 model as shipped) again as `path` with every tensor dequantised to
    f32 by the `gguf` package — the values kvjax computes with — and the metadata copied unchanged (file type: all
    f32), so llama.cpp runs the same weights in the same format as kvjax. Returns `path`."""
    import gguf

    r = gguf.GGUFReader(source)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(path, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue  # the writer writes the header fields and the architecture itself
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vtype, sub_type=sub)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in r.tensors:
        w.add_tensor(t.name, np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tokenizer(w, checkpoint: str, vocab_size: int) -> None:
    import gguf

    with open(os.path.join(checkpoint, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    if tok["model"]["type"] != "BPE":
        raise ValueError(f"gguf export supports byte-level BPE tokenizers only, not {tok['model']['type']!r}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for piece, i in tok["model"]["vocab"].items():
        if i < vocab_size:
            tokens[i], types[i] = piece, gguf.TokenType.NORMAL
    for added in tok.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # the checkpoint's split regex is Qwen2's (single digits, case-insensitive suffixes)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: gguf_export.py CHECKPOINT_DIR OUT.gguf")
    src = sys.argv[1]
    print(export_dequantised(src, sys.argv[2]) if src.endswith(".gguf") else export(src, sys.argv[2]))
