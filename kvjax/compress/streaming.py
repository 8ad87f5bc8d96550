"""StreamingLLM draft (Xiao et al. 2023; the MagicDec drafter, arXiv 2408.11049): attention sinks + recent window.

Keeps `sinks` first tokens and the most recent prompt tokens at their original positions; query-agnostic and
costs nothing to build. Tokens decoded later live in the draft's recent ring.
"""

from __future__ import annotations

import dataclasses

from kvjax.compress.base import Compressor, sinks_and_recent, sparse_part


@dataclasses.dataclass(frozen=True)
class StreamingLLM(Compressor):
    name: str = dataclasses.field(default="streaming", init=False)

    def layer_parts(self, i, form, length, prompt_len, data):
        C = self.budget(prompt_len)
        pos = sinks_and_recent(length, self.sinks, C - self.sinks)
        return (sparse_part(form, pos, self.draft_dtype),)
