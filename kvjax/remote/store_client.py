"""A small TensorStore kvstore client for remote prefix entries: checksummed chunked bundles, two-phase publish,
reads paced by a `Link` model.

Same rules as the prefix cache's store tier (`kvjax.prefix.tiers.StoreTier`), at a coarser grain: there an entry is
one block of one form; here an entry is a whole prefix (per-layer full-cache bundles, the last-position logits, one
bundle per draft cache), because a remote fetch streams a prefix as a unit, in layer order.

- A *bundle* is a dict of named arrays stored as one payload, split into chunks of at most `chunk_bytes` (4 MiB by
  default: the unit the link paces and the background fetch hands over). Each chunk is its own value in the one
  stored-value codec (`kvjax.prefix.codec`: `u64 header length | JSON header | bytes`); the header carries magic,
  format version, namespace, prefix key, bundle name, chunk index/count, byte count and a BLAKE2b checksum, and every
  read re-checks them all.
- A *manifest* (same value format, JSON payload) lists the bundles with their array tables and chunk checksums. It
  is written only after every chunk write has completed (two-phase put: nothing is readable before it is complete);
  a reader only ever reads through a manifest. The file driver writes a temporary file and renames it, so a crash
  leaves no half value; the checksums catch anything else.
- A failed check raises `CorruptEntry` (the prefix cache's error type) naming the check; callers turn it into a
  miss and a recompute — a corrupt entry never produces a token.
"""

from __future__ import annotations

import json
import os

import numpy as np

from kvjax.errors import CorruptEntry
from kvjax.prefix import codec
from kvjax.prefix.identity import payload_checksum
from kvjax.remote.link import Link

MAGIC = "kvjax-remote-prefix"
FORMAT_VERSION = 1
CHUNK_BYTES = 4 << 20
_IDENT_FIELDS = dict(magic=str, format_version=int, namespace=str, prefix=str, bundle=str)


def _arrays(buf: bytearray, table: list[dict]) -> dict[str, np.ndarray]:
    out = {}
    for t in table:
        a = np.frombuffer(buf, dtype=np.dtype(t["dtype"]), count=int(np.prod(t["shape"], dtype=np.int64)),
                          offset=t["offset"])
        out[t["name"]] = a.reshape(t["shape"])
    return out


class RemoteStore:
    """Prefix entries in a TensorStore kvstore, read through a bandwidth-capped `Link`.

    Args:
        url: kvstore URL (`file://...`, `gs://...`, `s3://...`) or a directory (-> `file://`).
        link: the link model reads go through (default: uncapped).
        chunk_bytes: largest chunk of a bundle.
    """

    def __init__(self, url: str, link: Link | None = None, chunk_bytes: int = CHUNK_BYTES):
        import tensorstore as ts

        if "://" not in url:
            url = "file://" + os.path.abspath(url)
        spec = ({"driver": "file", "path": url[len("file://"):].rstrip("/") + "/"} if url.startswith("file://")
                else url.rstrip("/") + "/")
        self.url = url
        self.kv = ts.KvStore.open(spec).result()
        self.link = link or Link()
        self.chunk_bytes = int(chunk_bytes)

    # ------------------------------------------------------------------------------------------------ keys
    @staticmethod
    def _key(ns_hex: str, prefix_hex: str, name: str, part: str) -> str:
        return f"{ns_hex}/{prefix_hex}/{name}/{part}"

    def _ident(self, ns_hex, prefix_hex, name) -> dict:
        return dict(magic=MAGIC, format_version=FORMAT_VERSION, namespace=ns_hex, prefix=prefix_hex, bundle=name)

    # ------------------------------------------------------------------------------------------------ write
    def put_bundle(self, ns_hex: str, prefix_hex: str, name: str, arrays: dict[str, np.ndarray]) -> dict:
        """Write a bundle (waits for every chunk); returns its record for the manifest."""
        table, parts, off = [], [], 0
        for k, a in arrays.items():
            a = np.ascontiguousarray(np.asarray(a))
            table.append(dict(name=k, dtype=a.dtype.str, shape=list(a.shape), offset=off, nbytes=a.nbytes))
            parts.append(a.tobytes())
            off += a.nbytes
        payload = b"".join(parts)
        n = max(1, -(-len(payload) // self.chunk_bytes))
        futs, sums = [], []
        for i in range(n):
            piece = payload[i * self.chunk_bytes:(i + 1) * self.chunk_bytes]
            sums.append(payload_checksum(piece))
            header = dict(self._ident(ns_hex, prefix_hex, name), chunk=i, chunks=n)
            futs.append(self.kv.write(self._key(ns_hex, prefix_hex, name, f"{i:06d}"), codec.encode(header, piece)))
        for f in futs:
            f.result()
        return dict(name=name, table=table, nbytes=len(payload), chunks=n, chunk_bytes=self.chunk_bytes,
                    checksums=sums)

    def put_manifest(self, ns_hex: str, prefix_hex: str, name: str, body: dict) -> None:
        """Publish a manifest (call only after its bundles' `put_bundle` returned)."""
        payload = json.dumps(body, sort_keys=True).encode()
        header = dict(self._ident(ns_hex, prefix_hex, name), kind="manifest")
        self.kv.write(self._key(ns_hex, prefix_hex, name, "manifest"), codec.encode(header, payload)).result()

    # ------------------------------------------------------------------------------------------------ read
    def get_manifest(self, ns_hex: str, prefix_hex: str, name: str) -> dict | None:
        """The manifest, or None when absent (a miss). Raises CorruptEntry if present but bad."""
        raw = self.kv.read(self._key(ns_hex, prefix_hex, name, "manifest")).result()
        if raw.state != "value":
            return None
        buf = bytes(raw.value)
        self.link.transfer(len(buf))
        what = f"manifest {name}"
        header, payload = codec.decode(buf, what=what, fields=dict(_IDENT_FIELDS, kind=str))
        codec.expect(header, dict(self._ident(ns_hex, prefix_hex, name), kind="manifest"), what)
        try:
            body = json.loads(bytes(payload))
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptEntry(f"{what}: unreadable body ({e})") from None
        if not isinstance(body, dict):
            raise CorruptEntry(f"{what}: body is JSON but not an object ({type(body).__name__})")
        return body

    def get_bundle(self, ns_hex: str, prefix_hex: str, record: dict, lookahead: int = 3) -> dict[str, np.ndarray]:
        """Read, pace and verify every chunk of one bundle; returns its arrays (read-only views)."""
        return next(self.iter_bundles(ns_hex, prefix_hex, [record], lookahead))[1]

    def iter_bundles(self, ns_hex: str, prefix_hex: str, records: list[dict], lookahead: int = 3):
        """Stream bundles in order, yielding (record, arrays) as each completes.

        A chunk's bytes are booked on the link when its read is ISSUED (they start crossing the link then), and the
        chunk is handed over once both the local read and its link time are done. `lookahead` reads are in flight
        across bundle boundaries, so verifying one chunk overlaps the transfer of the next ones.

        Raises:
            CorruptEntry: at the first chunk failing a check (earlier bundles have been yielded).
        """
        plan = []  # (bundle index, chunk index, key, payload size)
        for b, rec in enumerate(records):
            cb, n = rec["chunk_bytes"], rec["chunks"]
            plan += [(b, i, self._key(ns_hex, prefix_hex, rec["name"], f"{i:06d}"),
                      max(min(cb, rec["nbytes"] - i * cb), 0)) for i in range(n)]
        pending = []

        def issue(j):
            pending.append((self.kv.read(plan[j][2]), self.link.reserve(plan[j][3])))

        for j in range(min(lookahead, len(plan))):
            issue(j)
        buf, pos = None, 0
        for j, (b, i, _, size) in enumerate(plan):
            rec = records[b]
            if i == 0:
                buf, pos = bytearray(rec["nbytes"]), 0
            fut, done = pending.pop(0)
            if j + lookahead < len(plan):
                issue(j + lookahead)
            raw = fut.result()
            n, name = rec["chunks"], rec["name"]
            what = f"bundle {name} chunk {i}/{n}"
            if raw.state != "value":
                raise CorruptEntry(f"{what}: missing from the store")
            value = memoryview(raw.value)
            if len(value) > size:  # the header crosses the link too
                done = self.link.reserve(len(value) - size)
            self.link.wait_until(done)
            header, piece = codec.decode(value, what=what, fields=dict(_IDENT_FIELDS, chunk=int, chunks=int))
            codec.expect(header, dict(self._ident(ns_hex, prefix_hex, name), chunk=i, chunks=n), what)
            if header["checksum"] != rec["checksums"][i]:
                raise CorruptEntry(f"{what}: checksum differs from the manifest's")
            if pos + len(piece) > len(buf):
                raise CorruptEntry(f"{what}: more bytes than the manifest's {rec['nbytes']}")
            buf[pos:pos + len(piece)] = piece
            pos += len(piece)
            if i == n - 1:
                if pos != rec["nbytes"]:
                    raise CorruptEntry(f"bundle {name}: {pos} bytes, manifest says {rec['nbytes']}")
                yield rec, _arrays(buf, rec["table"])

    def delete_prefix(self, ns_hex: str, prefix_hex: str) -> None:
        import tensorstore as ts

        p = f"{ns_hex}/{prefix_hex}/"
        self.kv.delete_range(ts.KvStore.KeyRange(p, p[:-1] + chr(ord("/") + 1))).result()
