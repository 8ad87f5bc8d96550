"""SnapKV draft (Li et al. 2024, arXiv 2404.14469): keep what the last prompt queries attend to.

The last `obs_window` prompt tokens re-attend to the prompt; their attention is averaged over the window, smoothed
by a 1-D average pool (kernel 5, so neighbours stay together), averaged over the query heads of each KV group, and
the top-k slots per KV head are kept, together with the sinks and the window itself. Query-aware: strong when the
question sits at the end of the prompt.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.compress.base import Compressor, protected_mask, sparse_part, topk_positions
from kvjax.compress.scoring import attention_received


def avg_pool(scores, kernel: int):
    """'Same' 1-D average pool along the last axis (zero padding, divided by the kernel like SnapKV's)."""
    pad = kernel // 2
    x = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(pad, kernel - 1 - pad)])
    c = jnp.cumsum(x, axis=-1)
    c = jnp.concatenate([jnp.zeros_like(c[..., :1]), c], axis=-1)
    return (c[..., kernel:] - c[..., :-kernel]) / kernel


def group_reduce(scores, kv_heads: int, how: str):
    """[B, N, S] -> [B, K, S] over each GQA group's query heads."""
    B, N, S = scores.shape
    g = scores.reshape(B, kv_heads, N // kv_heads, S)
    return jnp.max(g, axis=2) if how == "max" else jnp.mean(g, axis=2)


def select_protected(form, length, budget, scores, sinks, window):
    """Per-head top-(budget) slots, sinks and the last `window` prompt tokens forced in. Returns pos i32[B, K, C]."""
    S = form.k.shape[2]
    prot = protected_mask(length, S, sinks, window)
    return topk_positions(jnp.where(prot[:, None, :], jnp.inf, scores), length, budget)


@dataclasses.dataclass(frozen=True)
class SnapKV(Compressor):
    obs_window: int = 32
    kernel: int = 5
    name: str = dataclasses.field(default="snapkv", init=False)

    def prepare(self, params, config, full, prompt):
        L = int(full.length[0])
        w = min(self.obs_window, L)
        toks = jnp.asarray(prompt[L - w:L], jnp.int32)[None, :]
        pos = jnp.arange(L - w, L, dtype=jnp.int32)[None, :]
        scores = attention_received(params, config, full, toks, pos, full.length - w, reduce="mean")
        K = config.num_kv_heads
        return {"scores": [None if s is None else group_reduce(avg_pool(s, self.kernel), K, "mean") for s in scores],
                "window": w}

    def layer_parts(self, i, form, length, prompt_len, data):
        pos = select_protected(form, length, self.budget(prompt_len), data["scores"][i], self.sinks, data["window"])
        return (sparse_part(form, pos, self.draft_dtype),)
