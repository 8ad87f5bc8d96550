"""KVzip-style query-agnostic draft (Kim et al. 2025, arXiv 2505.23416): keep what reconstructing the context needs.

The model re-reads the context in chunks after a short "repeat" prompt (each later chunk prefixed with the last 8
tokens of the previous one), at positions after the prompt, attending to the full prompt cache; a prompt token's
importance is the MAX attention it receives over the GQA group's query heads and all repeat queries. The top
fraction per KV head is kept (per-head budgets, not KVzip's global non-uniform ones), plus sinks and a short recent
window. Costs about one extra prefill; independent of any later question.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kvjax.compress.base import Compressor, sparse_part
from kvjax.compress.scoring import attention_received
from kvjax.compress.snapkv import group_reduce, select_protected


def kvzip_scores(params, config, full, prompt, *, chunk: int, repeat_ids=(), overlap: int = 8):
    """Per full layer f32[B, K, S]: max attention over group heads and repeat queries. B must be 1."""
    L = int(full.length[0])
    prompt = np.asarray(prompt, np.int32)[:L]
    rep = np.asarray(repeat_ids, np.int32)
    T = chunk + len(rep) + overlap  # static block length: one compile per chunk size
    best = None
    for start in range(0, L, chunk):
        body = prompt[max(0, start - overlap):start + chunk]
        ids = np.concatenate([rep, body])
        toks = np.zeros((1, T), np.int32)
        pos = np.full((1, T), -1, np.int32)
        toks[0, :ids.size] = ids
        pos[0, :ids.size] = L + np.arange(ids.size)
        sc = attention_received(params, config, full, jnp.asarray(toks), jnp.asarray(pos), full.length, reduce="max")
        sc = [None if s is None else group_reduce(s, config.num_kv_heads, "max") for s in sc]
        best = sc if best is None else [None if a is None else jnp.maximum(a, b) for a, b in zip(best, sc)]
    return best


@dataclasses.dataclass(frozen=True)
class KVzipStyle(Compressor):
    chunk: int = 512
    recent: int = 32
    repeat_ids: tuple = ()
    name: str = dataclasses.field(default="kvzip", init=False)

    def prepare(self, params, config, full, prompt):
        return {"scores": kvzip_scores(params, config, full, prompt, chunk=self.chunk, repeat_ids=self.repeat_ids)}

    def layer_parts(self, i, form, length, prompt_len, data):
        pos = select_protected(form, length, self.budget(prompt_len), data["scores"][i], self.sinks, self.recent)
        return (sparse_part(form, pos, self.draft_dtype),)
