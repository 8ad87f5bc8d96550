"""What every family's frozen config shares: the fields that change keys/values (a cache identity's semantic part)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# Config fields that never change what a cache holds (which token ends a sequence is a decoding choice).
NOT_KV_FIELDS = ("bos_token_id", "eos_token_ids")


class KVFields:
    """Mixin for a family's config dataclass: `kv_fields()` and `to_json()`."""

    def kv_fields(self) -> dict[str, Any]:
        """Every field that changes the keys/values a cache holds (the semantic part of a cache identity)."""
        d = dataclasses.asdict(self)
        for k in NOT_KV_FIELDS:
            d.pop(k, None)
        return d

    def to_json(self) -> str:
        """All fields, as canonical JSON."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)
