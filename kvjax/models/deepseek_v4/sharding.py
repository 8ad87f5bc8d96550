"""How DeepSeek-V4 params split over the tensor-parallel axis of a mesh: query heads, experts and MLP.

The layout follows the Llama family's Megatron split (`kvjax.sharding`), adapted to V4's attention: there is ONE
shared key=value head, so `wkv`, `kv_norm` and everything that makes compressed entries (compressors, the lightning
indexer) are replicated, and every device holds the whole (small) cache; the query projection `wq_b` is split by
heads (its output columns), the per-head sinks with it, and the grouped output projection by groups (`wo_a` on its
group axis, `wo_b` on its rows) when "tp" divides `o_groups`. Routed experts are split by expert (`w1`/`w3`/`w2` on
their expert axis) and the shared expert Megatron-style; the router, hyper-connections and norms are replicated.
A dimension "tp" does not divide stays replicated (only `num_heads` must be divisible). XLA's sharding propagation
inserts the collectives; logits agree with one device to float rounding, not bit for bit. Placing the params on a
mesh is `kvjax.sharding`'s (the family value composes the two: `kvjax.families.deepseek_v4.shard_params`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from kvjax.models.deepseek_v4.config import DeepseekV4Config


def param_specs(params, config: DeepseekV4Config, tp: int, *, axis: str, vocab: bool | None = None):
    """PartitionSpec pytree (same structure as `params`) for tensor parallelism of degree `tp` over mesh axis `axis`.

    Args:
        vocab: split the embeddings / LM head over the vocabulary (default: when `tp` divides `vocab_size`).

    Raises:
        ValueError: `tp` does not divide `num_heads` (or `vocab_size` when `vocab` is asked for).
    """
    c = config
    if c.num_heads % tp:
        raise ValueError(f"tp={tp} does not divide num_heads={c.num_heads}")
    if vocab is None:
        vocab = c.vocab_size % tp == 0
    elif vocab and c.vocab_size % tp:
        raise ValueError(f"tp={tp} does not divide vocab_size={c.vocab_size}")
    TP = axis
    groups = c.o_groups % tp == 0
    experts = c.n_routed_experts % tp == 0
    mlp = c.moe_intermediate_size % tp == 0
    # (parent key, leaf key) -> spec; anything not listed is replicated
    rules = {
        ("attn", "wq_b"): P(None, TP), ("attn", "sinks"): P(TP),
        ("attn", "wo_a"): P(TP, None, None) if groups else None, ("attn", "wo_b"): P(TP, None) if groups else None,
        ("ffn", "w1"): P(TP, None, None) if experts else None, ("ffn", "w3"): P(TP, None, None) if experts else None,
        ("ffn", "w2"): P(TP, None, None) if experts else None,
        ("shared", "w1"): P(None, TP) if mlp else None, ("shared", "w3"): P(None, TP) if mlp else None,
        ("shared", "w2"): P(TP, None) if mlp else None,
        (None, "embed"): P(TP, None) if vocab else None, (None, "lm_head"): P(None, TP) if vocab else None,
    }

    def spec(path, leaf):
        keys = [getattr(k, "key", None) for k in path]
        parent = keys[-2] if len(keys) > 1 and isinstance(keys[-2], str) else None
        s = rules.get((parent, keys[-1]))
        return s if s is not None else P(*([None] * np.ndim(leaf)))

    return jax.tree_util.tree_map_with_path(spec, params)

