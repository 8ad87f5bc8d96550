"""The one encoding of a stored value: `u64 little-endian header length | JSON header (an object) | payload`.

Every store kvjax writes uses it: the prefix cache's store tier (`tiers.StoreTier`), the remote prefix store
(`kvjax.remote.store_client`) and `kvjax cache` (`inspect.py`). `encode` adds two fields to every header, `nbytes`
(the payload's length) and `checksum` (BLAKE2b of the payload, `identity.payload_checksum`). `decode` checks the
structure, those two fields, and that every field a caller requires is present with the right JSON type; anything
else raises `CorruptEntry` whose message starts with what was being read and names the problem. What a field must
*equal* (a namespace, a block key, the token ids) is the caller's check, through `expect`.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from kvjax.errors import CorruptEntry
from kvjax.prefix.identity import payload_checksum

LENGTH_BYTES = 8
_BASE_FIELDS = {"nbytes": int, "checksum": str}


def encode(header: Mapping[str, Any], payload: bytes | bytearray | memoryview) -> bytes:
    """One stored value: the header (plus `nbytes` and `checksum` of `payload`) and the payload."""
    h = dict(header, nbytes=len(payload), checksum=payload_checksum(payload))
    hb = json.dumps(h, sort_keys=True, separators=(",", ":")).encode()
    return len(hb).to_bytes(LENGTH_BYTES, "little") + hb + bytes(payload)


def _type_ok(value, want) -> bool:
    wants = want if isinstance(want, tuple) else (want,)
    if isinstance(value, bool):  # JSON true is not a number, and 1 is not a boolean
        return bool in wants
    return any(w is not bool and isinstance(value, w) for w in wants)


def _type_name(want) -> str:
    wants = want if isinstance(want, tuple) else (want,)
    return " or ".join(w.__name__ for w in wants)


def decode(buf, *, what: str = "value", fields: Mapping[str, type | tuple] | None = None,
           ) -> tuple[dict, memoryview]:
    """Split and verify one stored value.

    Args:
        buf: the stored bytes (bytes, bytearray or memoryview; the payload is returned as a view, not copied).
        what: names the value in error messages ("entry dense/3fa2...").
        fields: field name -> required JSON type(s) (str, int, float, bool, list, dict), besides nbytes/checksum.

    Returns:
        (header dict, payload view).

    Raises:
        CorruptEntry: truncated value, header not JSON, header JSON but not an object, a required field missing or
            of the wrong type, payload length different from `nbytes`, checksum mismatch.
    """
    buf = memoryview(buf)
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B")
    n = len(buf)
    if n < LENGTH_BYTES:
        raise CorruptEntry(f"{what}: truncated: {n} bytes, no header length")
    hl = int.from_bytes(buf[:LENGTH_BYTES], "little")
    if hl > n - LENGTH_BYTES:
        raise CorruptEntry(f"{what}: truncated: header length {hl} > the {n - LENGTH_BYTES} bytes after it")
    try:
        header = json.loads(bytes(buf[LENGTH_BYTES:LENGTH_BYTES + hl]))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptEntry(f"{what}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptEntry(f"{what}: header is JSON but not an object ({type(header).__name__})")
    for name, want in {**_BASE_FIELDS, **(fields or {})}.items():
        if name not in header:
            raise CorruptEntry(f"{what}: header has no field {name!r}")
        if not _type_ok(header[name], want):
            raise CorruptEntry(f"{what}: header field {name!r} is {type(header[name]).__name__}, expected "
                               f"{_type_name(want)}")
    payload = buf[LENGTH_BYTES + hl:]
    if header["nbytes"] != len(payload):
        short = "truncated: " if len(payload) < header["nbytes"] else ""
        raise CorruptEntry(f"{what}: {short}payload is {len(payload)} bytes, header says {header['nbytes']}")
    if payload_checksum(payload) != header["checksum"]:
        raise CorruptEntry(f"{what}: checksum mismatch")
    return header, payload


def peek_header(buf) -> dict | None:
    """The header object of a stored value without verifying anything else (None if it has no readable header): how
    a value written by another format version is recognised before its fields are held to this version's rules."""
    buf = memoryview(buf)
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B")
    if len(buf) < LENGTH_BYTES:
        return None
    hl = int.from_bytes(buf[:LENGTH_BYTES], "little")
    try:
        header = json.loads(bytes(buf[LENGTH_BYTES:LENGTH_BYTES + hl])) if hl <= len(buf) - LENGTH_BYTES else None
    except (ValueError, UnicodeDecodeError):
        return None
    return header if isinstance(header, dict) else None


def expect(header: Mapping[str, Any], want: Mapping[str, Any], what: str = "value") -> None:
    """Raise CorruptEntry naming the first field of `want` whose value in `header` differs."""
    for k, v in want.items():
        if header.get(k) != v:
            raise CorruptEntry(f"{what}: header {k}={header.get(k)!r}, expected {v!r}")
