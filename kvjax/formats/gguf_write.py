"""Writing GGUF: the Llama hyper-parameters as llama.cpp's converter records them, for the exporter that hands kvjax
weights to llama.cpp (`scripts/gguf_export.py`) and the reader's tests, which build toy files with it."""

from __future__ import annotations


def add_llama_hparams(writer, config) -> None:
    """Record `config`'s (a `kvjax` Llama config) shape in `writer` (a `gguf.GGUFWriter` of architecture `llama`):
    context length, widths, layer and head counts, head size, RMS epsilon and rotary base. Rotary scaling, the
    tokenizer and the tensors are the caller's."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope.theta))
