"""The one stored-value codec (`length | JSON header | payload`): round trip, and every malformed input raises
CorruptEntry naming the problem."""

import json

import pytest

from kvjax.errors import CorruptEntry
from kvjax.prefix import codec

FIELDS = {"magic": str, "index": int, "tokens": list, "complete": bool}
HEADER = dict(magic="m", index=3, tokens=[1, 2], complete=True)


def _raw(header_bytes: bytes, payload: bytes = b"abc") -> bytes:
    return len(header_bytes).to_bytes(8, "little") + header_bytes + payload


def test_round_trip_adds_length_and_checksum():
    buf = codec.encode(HEADER, b"payload")
    header, payload = codec.decode(buf, what="x", fields=FIELDS)
    assert bytes(payload) == b"payload" and header["nbytes"] == 7 and {**HEADER}.items() <= header.items()
    codec.expect(header, {"magic": "m", "index": 3}, "x")
    with pytest.raises(CorruptEntry, match=r"x: header index=3, expected 4"):
        codec.expect(header, {"index": 4}, "x")


GOOD = codec.encode(HEADER, b"abc")
GOOD_HEADER = json.loads(GOOD[8:8 + int.from_bytes(GOOD[:8], "little")])


@pytest.mark.parametrize("buf,needle", [
    (b"", "truncated: 0 bytes, no header length"),
    (b"\x05\x00\x00", "truncated: 3 bytes, no header length"),
    ((100).to_bytes(8, "little") + b"{}", "truncated: header length 100"),
    (_raw(b"{nope"), "header is not JSON"),
    (_raw(b"\xff\xfe"), "header is not JSON"),
    (_raw(b"[1, 2]"), "header is JSON but not an object (list)"),
    (_raw(b"7"), "header is JSON but not an object (int)"),
    (_raw(b"null"), "header is JSON but not an object (NoneType)"),
    (_raw(json.dumps({k: v for k, v in GOOD_HEADER.items() if k != "index"}).encode()), "no field 'index'"),
    (_raw(json.dumps({**GOOD_HEADER, "index": "3"}).encode()), "field 'index' is str"),
    (_raw(json.dumps({**GOOD_HEADER, "index": True}).encode()), "field 'index' is bool"),
    (_raw(json.dumps({**GOOD_HEADER, "complete": 1}).encode()), "field 'complete' is int"),
    (_raw(json.dumps({**GOOD_HEADER, "nbytes": 4}).encode()), "payload is 3 bytes, header says 4"),
    (_raw(json.dumps(GOOD_HEADER).encode(), b"abd"), "checksum mismatch"),
    (GOOD[:-1], "payload is 2 bytes, header says 3"),
])
def test_malformed_values_raise_corrupt_entry_naming_the_problem(buf, needle):
    with pytest.raises(CorruptEntry) as err:
        codec.decode(buf, what="entry k", fields=FIELDS)
    assert str(err.value).startswith("entry k: ") and needle in str(err.value), str(err.value)
