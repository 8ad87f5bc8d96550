"""Tiny random DeepSeek-V4 models for the V4 tests, built with transformers' own config class and `save_pretrained`.

(Helpers only; no tests here. Named test_* so it stays within the V4 test files.)
"""

from __future__ import annotations

import functools
import os
import tempfile

import numpy as np

# Every layer type (sliding / CSA / HCA), hash-routed and top-k MoE, yarn "compress" rope; m = 4, m' = 8, W = 8.
# index_topk = 3 is below the number of complete CSA entries for prompts over 16 tokens, so the indexer really selects.
# 16 indexer heads make exact ReLU score ties (all heads zero) improbable, so transformers' unspecified top-k tie
# order does not enter the parity test (the tie rule is tested separately).
SPECS = {
    "hybrid": dict(
        vocab_size=97, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=4,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=3,
        partial_rotary_factor=0.25, hc_mult=2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        max_position_embeddings=256, eos_token_id=None, bos_token_id=None),
    # Other switches: tied embeddings, sigmoid router scores, plain compress rope, one output group, hc_mult 3,
    # HCA first (the V4 default order), CSA with m = 2 and a window of 12. One indexer head: scores are
    # w * relu(q . k), so every entry with q . k <= 0 (or with a negative head weight) ties at 0 and top-k ties
    # decide the selection everywhere.
    "variant": dict(
        vocab_size=89, hidden_size=48, moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
        head_dim=24, q_lora_rank=32, num_experts_per_tok=3, n_routed_experts=5, scoring_func="sigmoid",
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        sliding_window=12, o_groups=1, o_lora_rank=20, index_n_heads=1, index_head_dim=8, index_topk=4,
        partial_rotary_factor=1 / 3, hc_mult=3, hc_sinkhorn_iters=7, tie_word_embeddings=True,
        max_position_embeddings=256, eos_token_id=None, bos_token_id=None),
}


@functools.lru_cache(maxsize=None)
def make_v4(name: str = "hybrid", seed: int = 0):
    """(transformers model in eval mode, saved directory) for the tiny config `name`, random weights of useful size."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    # one torch thread: on a shared 2-core machine, torch's thread pool made each tiny forward ~100x slower
    torch.set_num_threads(1)
    cfg = DeepseekV4Config(**SPECS[name])
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0, 0.08 if p.ndim > 1 else 0.3)
            if p.ndim == 1 and ("norm" in n or "scale" in n):
                p.add_(1.0)
        for n, b in model.named_buffers():
            if n.endswith("tid2eid"):
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape))
            elif n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    d = os.path.join(tempfile.mkdtemp(prefix="kvjax_v4_"), name)
    model.save_pretrained(d)
    return model, d


def hf_logits(model, ids: np.ndarray, *, lowest_index_ties: bool = False) -> np.ndarray:
    """transformers' uncached full forward: logits f32[T, V] for one sequence.

    lowest_index_ties: run it with `Tensor.topk` (the indexer's selection; the router calls `torch.topk`) replaced by
    a stable sort, so ties go to the lowest index as in kvjax — torch leaves their order unspecified.
    """
    import collections

    import torch

    topk = torch.Tensor.topk
    if lowest_index_ties:
        TopK = collections.namedtuple("TopK", "values indices")

        def stable_topk(self, k, dim=-1, largest=True, sorted=True):
            assert largest
            v, i = torch.sort(self, dim=dim, descending=True, stable=True)
            return TopK(v.narrow(dim, 0, k), i.narrow(dim, 0, k))

        torch.Tensor.topk = stable_topk
    try:
        with torch.no_grad():
            return model(torch.tensor(np.asarray(ids)[None], dtype=torch.long), use_cache=False).logits[0].numpy()
    finally:
        torch.Tensor.topk = topk
