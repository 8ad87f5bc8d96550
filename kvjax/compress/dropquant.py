"""Drop + quantize: keep a scored fraction of the prompt per KV head (KVzip-style or SnapKV scores) and quantize it.

Sinks and the last `residual` prompt tokens stay full precision; the kept middle tokens are stored in the
`QuantizedKV` format with per-head positions (the format's per-head extension). Bytes shrink by both factors, e.g.
ratio 2 x 4-bit ~ 1/14 of an f32 cache.
"""

from __future__ import annotations

import dataclasses

from kvjax.cache.draft import QuantizedKV
from kvjax.compress.base import (Compressor, gather_tokens, protected_mask, round_up, sinks_and_recent_part,
                                 topk_positions)
from kvjax.compress.kvzip import kvzip_scores
from kvjax.compress.snapkv import SnapKV


@dataclasses.dataclass(frozen=True)
class DropQuantize(Compressor):
    bits: int = 4
    group: int = 32
    residual: int = 128
    scorer: str = "kvzip"  # "kvzip" | "snapkv"
    chunk: int = 512
    name: str = dataclasses.field(default="dropquant", init=False)

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "name", f"drop{self.ratio:g}+q{self.bits}")

    def prepare(self, params, config, full, prompt):
        if self.scorer == "snapkv":
            return SnapKV(ratio=self.ratio, sinks=self.sinks).prepare(params, config, full, prompt)
        return {"scores": kvzip_scores(params, config, full, prompt, chunk=self.chunk)}

    def layer_parts(self, i, form, length, prompt_len, data):
        dense = sinks_and_recent_part(form, length, self.sinks, self.residual, self.draft_dtype)
        n_mid = prompt_len - self.sinks - self.residual
        if n_mid <= 0:
            return (dense,)
        budget = round_up(max(1, int(n_mid / self.ratio)), self.group)
        prot = protected_mask(length, form.k.shape[2], self.sinks, self.residual)
        pos = topk_positions(data["scores"][i], length, budget, exclude=prot)
        q = QuantizedKV.quantize(gather_tokens(form.k, pos), gather_tokens(form.v, pos), pos, bits=self.bits,
                                 group=self.group)
        return (dense, q)
