"""What the prefix cache tracks: one `Entry` per (block, form) with the tiers holding its bytes, and `Metrics`."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from kvjax.prefix.plan import CAPACITY, COMPATIBILITY
from kvjax.prefix.radix import Block
from kvjax.prefix.tiers import DEVICE, HOST, STORE, TIERS


@dataclasses.dataclass(eq=False)
class Entry:
    """One form's state for one block, and where its bytes are (any subset of the tiers)."""

    form: str
    block: Block
    slot: int | None = None  # device pool slot
    host: Any = None  # published pinned_host jax.Array
    in_store: bool = False
    pending: int = 0  # copies in flight (not visible)
    pins: int = 0
    generation: int = 0
    why: str = "not admitted"  # why it is unavailable, when it is
    last_access: int = 0
    priority: int = 0
    tokens: Any = None  # i32[P] the token ids of the prompt its bytes were computed from (compared on restore)

    def tier(self, allowed=TIERS) -> str | None:
        if self.slot is not None and DEVICE in allowed:
            return DEVICE
        if self.host is not None and HOST in allowed:
            return HOST
        if self.in_store and STORE in allowed:
            return STORE
        return None


class Metrics:
    """Counters: reuse per form and tier, misses by kind and cause (in tokens), lookup latency.

    Every prompt token of every request is counted once, as a hit or under one (kind, cause) of its plan
    (`plan.Shortfall`): `prompt_tokens == hit_tokens + sum(misses)`. A re-plan replaces its request's counts.
    """

    def __init__(self):
        self.lookups = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.lookup_ms: collections.deque = collections.deque(maxlen=4096)  # the latest lookups only: bounded
        self.reused_tokens = collections.defaultdict(collections.Counter)  # form -> tier -> tokens
        self.reused_blocks = collections.defaultdict(collections.Counter)  # form -> tier -> entries
        self.misses = {COMPATIBILITY: collections.Counter(), CAPACITY: collections.Counter(),
                       "boundary": collections.Counter()}  # kind -> cause -> tokens
        self.events = collections.Counter()  # evicted, demoted, not_admitted, corrupt, replans

    def as_dict(self) -> dict:
        ms = sorted(self.lookup_ms)
        return dict(lookups=self.lookups, prompt_tokens=self.prompt_tokens, hit_tokens=self.hit_tokens,
                    hit_rate=self.hit_tokens / max(self.prompt_tokens, 1),
                    lookup_ms_p50=ms[len(ms) // 2] if ms else None, lookup_ms_max=ms[-1] if ms else None,
                    reused_tokens={f: dict(c) for f, c in self.reused_tokens.items()},
                    reused_blocks={f: dict(c) for f, c in self.reused_blocks.items()},
                    misses={k: {c: n for c, n in cs.items() if n} for k, cs in self.misses.items()},
                    events={k: n for k, n in self.events.items() if n})
