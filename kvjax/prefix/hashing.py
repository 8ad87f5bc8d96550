"""The hashing primitives of cache identity: a canonical JSON form of config values and domain-separated BLAKE2b."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping

import numpy as np


def canonical(obj: Any) -> Any:
    """JSON-safe canonical form: tuples -> lists, floats by repr (so 1.0 and 1 differ), dataclasses -> dicts."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"__type__": type(obj).__name__, **{k: canonical(v) for k, v in dataclasses.asdict(obj).items()}}
    if isinstance(obj, Mapping):
        return {str(k): canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [canonical(v) for v in obj]
    if isinstance(obj, float):
        return {"f": repr(obj)}
    if isinstance(obj, (bool, int, str)) or obj is None:
        return obj
    if isinstance(obj, (np.integer, np.floating)):
        return canonical(obj.item())
    return {"repr": repr(obj)}


def digest(domain: bytes, *parts: bytes) -> bytes:
    """32-byte BLAKE2b of length-prefixed `parts` in hash domain `domain` (<= 16 bytes)."""
    h = hashlib.blake2b(digest_size=32, person=domain[:16])
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()
