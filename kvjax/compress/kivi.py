"""KIVI-style quantized draft (Liu et al. 2024, arXiv 2402.02750; QuantSpec's 4-bit drafter, arXiv 2502.10424).

Every prompt token is kept; the middle of the prompt is quantized to 2 or 4 bits (keys per channel over groups of
`group` tokens, values per token — the `QuantizedKV` format), while the sinks and the most recent `residual` prompt
tokens stay in full precision (a KIVI drafter without that residual collapsed to ~1% acceptance in a public
reproduction). Tokens decoded later are full precision in the draft's recent ring.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.cache.draft import QuantizedKV
from kvjax.compress.base import Compressor, gather_tokens, round_up, sinks_and_recent_part


def middle_positions(length, sinks: int, residual: int, slots: int):
    """i32[B, slots]: positions sinks .. L-residual-1 in order, -1 beyond."""
    i = jnp.arange(slots, dtype=jnp.int32)[None, :] + sinks
    return jnp.where(i < length[:, None] - residual, i, -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class KIVI(Compressor):
    bits: int = 4
    group: int = 32
    residual: int = 128
    name: str = dataclasses.field(default="kivi", init=False)

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "name", f"kivi{self.bits}")

    def layer_parts(self, i, form, length, prompt_len, data):
        dense = sinks_and_recent_part(form, length, self.sinks, self.residual, self.draft_dtype)
        n_mid = prompt_len - self.sinks - self.residual
        if n_mid <= 0:
            return (dense,)
        mid = middle_positions(length, self.sinks, self.residual, round_up(n_mid, self.group))
        q = QuantizedKV.quantize(gather_tokens(form.k, mid), gather_tokens(form.v, mid), mid, bits=self.bits,
                                 group=self.group)
        return (dense, q)
