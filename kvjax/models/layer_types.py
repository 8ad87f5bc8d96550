"""Attention layer kinds, spelled as Hugging Face's `layer_types` spells them."""

FULL = "full_attention"
SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
