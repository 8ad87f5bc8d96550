"""Offline view of a prefix-cache store (`kvjax cache`): namespaces, entries, sizes, checksums, eviction.

Works on the store's public layout (`kvjax.prefix.tiers.StoreTier`), without a model or a running `PrefixCache`:
`kvjax-prefix-store.json` (the marker), `<namespace hex>/namespace.json`, `<namespace hex>/blocks/<block key>`
(token records) and `<namespace hex>/<form>/<block key>` (entries, one `codec` value each).

Ownership. Only a location holding kvjax's marker is a store; anything else is refused before a key is read
(`InputError`, one line in the CLI). Inside a store, only keys of that layout (`tiers.parse_key`) are the store's:
any other file is listed as foreign and is never read as an entry, never counted, never deleted.

Verification re-does what `StoreTier.decode_entry` checks that needs no form spec: the codec (truncation, a header
that is not a JSON object, missing or mistyped fields, payload length, BLAKE2b checksum), magic, format version,
namespace / form / block key against the entry's own key, declared shape x dtype = byte count, and the entry's token
ids, parent key and index against its block record; plus that the namespace record hashes to its directory name and
block records are well formed. Deleting entries under a running cache is safe: the cache finds the entry missing
when it reads it, counts a capacity miss and recomputes.
"""

from __future__ import annotations

import collections
import json
import os
import re

import numpy as np

from kvjax.errors import CorruptEntry
from kvjax.prefix import codec
from kvjax.prefix.identity import Namespace
from kvjax.prefix.tiers import ENTRY_FIELDS, MAGIC, STORE_FORMAT_VERSION, StoreTier, parse_key, stale_version


def open_store(url: str) -> StoreTier:
    """Open an existing store; never creates one.

    Raises:
        FileNotFoundError: a local path that does not exist.
        InputError: the location is not a kvjax prefix-cache store (no marker).
    """
    local = url[len("file://"):] if url.startswith("file://") else (None if "://" in url else url)
    if local is not None and not os.path.isdir(local):
        raise FileNotFoundError(f"no prefix-cache store at {url}")
    return StoreTier(url, create=False)


def _reason(err: CorruptEntry, what: str) -> str:
    msg = str(err)
    return msg[len(what) + 2:] if msg.startswith(what + ": ") else msg


def check_entry(key: str, buf: bytes, record: dict | None = None) -> tuple[dict | None, str | None]:
    """(header, None) if the stored value under entry key `key` verifies, else (header or None, reason).

    Args:
        record: the entry's block record ({index, parent, tokens}) when the store has one: the entry's token ids,
            parent key and index must be the record's.
    """
    parsed = parse_key(key)
    if parsed is None or parsed[0] != "entry":
        return None, "not an entry key of this store"
    _, ns_hex, form, block_hex = parsed
    try:
        header, payload = codec.decode(buf, what=key, fields=ENTRY_FIELDS)
        codec.expect(header, dict(magic=MAGIC, format_version=STORE_FORMAT_VERSION, namespace=ns_hex, form=form,
                                  block_key=block_hex, complete=True), key)
    except CorruptEntry as e:
        return None, _reason(e, key)
    try:
        need = int(np.prod(header["shape"], dtype=np.int64)) * np.dtype(header["dtype"]).itemsize
    except (TypeError, ValueError):
        return header, f"bad shape/dtype {header.get('shape')!r} {header.get('dtype')!r}"
    if need != len(payload):
        return header, f"payload is {len(payload)} bytes, shape x dtype needs {need}"
    if record is not None:
        for k, want in (("tokens", record["tokens"]), ("parent_key", record["parent"]),
                        ("index", record.get("index"))):
            if header.get(k) != want:
                return header, f"header {k} differs from the block record's"
    return header, None


def _block_record(buf: bytes) -> tuple[dict | None, str | None]:
    try:
        rec = json.loads(buf)
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"block record is not JSON ({e})"
    if not isinstance(rec, dict) or not isinstance(rec.get("tokens"), list) or not isinstance(rec.get("parent"), str):
        return None, "block record is not an object with tokens and parent"
    return rec, None


def _identity(doc) -> tuple[dict, str, str]:
    """(summary, the hex it hashes to or "", what is wrong) of a record read from `<ns>/namespace.json`."""
    if not isinstance(doc, dict):
        return {}, "", "missing or not a JSON object"
    sem, rep = doc.get("semantic"), doc.get("representation")
    if not isinstance(sem, dict) or not isinstance(rep, dict):
        return {}, "", "namespace record has no semantic/representation objects"
    ident = dict(weights=str(sem.get("weights", ""))[:16], adapters=len(sem.get("adapters") or ()),
                 kv_dtype=rep.get("kv_dtype"), block_size=rep.get("block_size"), mesh=rep.get("mesh"),
                 kernel_abi=rep.get("kernel_abi"), attention=rep.get("attention"),
                 device_kind=rep.get("device_kind"), jax=rep.get("jax"),
                 forms=sorted(rep.get("formats", {})) if isinstance(rep.get("formats"), dict) else [])
    try:
        ns = Namespace(semantic=sem, representation=rep, tenant_salt=str(doc.get("tenant_salt", "")))
        return ident, ns.hex, ""
    except (TypeError, ValueError):
        return ident, "", "namespace record cannot be encoded"


def inspect(url: str, *, namespace: str | None = None, verify: bool = False) -> dict:
    """Summarise a store: per namespace its identity, blocks, and entries / bytes per form (optionally verified).

    Returns:
        dict(store, namespaces=[...], verified, corrupt=[{key, why}], foreign=[keys that are not the store's],
        entries, bytes); sizes are payload + header bytes.
    """
    store = open_store(url)
    by_ns, foreign = collections.defaultdict(list), []
    for k in store.list_keys():
        parsed = parse_key(k)
        if parsed is None:
            foreign.append(k)
        elif parsed[0] != "marker" and (namespace is None or parsed[1].startswith(namespace)):
            by_ns[parsed[1]].append((k, parsed))
    out, corrupt, stale = [], [], []
    for ns_hex, keys in sorted(by_ns.items()):
        ident, got_hex, problem = _identity(store.read_json(f"{ns_hex}/namespace.json"))
        if got_hex != ns_hex:
            corrupt.append(dict(key=f"{ns_hex}/namespace.json",
                                why=problem or "namespace record does not hash to its key"))
        records = {}
        if verify:
            futs = {kh: store.kv.read(k) for k, (kind, _, _, kh) in keys if kind == "block"}
            for kh, f in futs.items():
                raw = f.result()
                rec, why = _block_record(bytes(raw.value)) if raw.state == "value" else (None, "missing")
                if why:
                    corrupt.append(dict(key=f"{ns_hex}/blocks/{kh}", why=why))
                else:
                    records[kh] = rec
        futs = {k: (form, kh, store.kv.read(k)) for k, (kind, _, form, kh) in keys if kind == "entry"}
        forms = collections.defaultdict(lambda: dict(entries=0, bytes=0))
        for k, (form, kh, f) in futs.items():
            raw = f.result()
            buf = bytes(raw.value) if raw.state == "value" else b""
            forms[form]["entries"] += 1
            forms[form]["bytes"] += len(buf)
            if verify:
                v = stale_version(buf)
                if v is not None:  # another store format's entry: not corrupt, not readable here
                    stale.append(dict(key=k, format_version=v))
                    continue
                _, why = check_entry(k, buf, records.get(kh))
                if why:
                    corrupt.append(dict(key=k, why=why))
        out.append(dict(namespace=ns_hex, identity=ident, blocks=sum(kind == "block" for _, (kind, *_) in keys),
                        forms=dict(forms), entries=sum(f["entries"] for f in forms.values()),
                        bytes=sum(f["bytes"] for f in forms.values())))
    entries = sum(n["entries"] for n in out)
    return dict(store=store.url, format_version=STORE_FORMAT_VERSION, marker_format_version=store.marker_version,
                namespaces=out, verified=verify, corrupt=corrupt, stale=stale, foreign=sorted(foreign),
                entries=entries, current=entries - len(stale) - len(corrupt) if verify else None,
                bytes=sum(n["bytes"] for n in out))


def _delete(store: StoreTier, keys) -> int:
    """Delete exactly `keys` (each one key, never a range of them). Returns how many."""
    import tensorstore as ts

    futs = [store.kv.delete_range(ts.KvStore.KeyRange(k, k + "\x00")) for k in keys]
    for f in futs:
        f.result()
    return len(futs)


def evict_namespace(url: str, prefix: str) -> list[str]:
    """Delete the store's own keys of every namespace whose hex starts with `prefix` (at least 4 hex characters).

    Returns:
        the namespaces evicted. Keys that are not the store's (foreign files) are left where they are.
    """
    if not re.fullmatch(r"[0-9a-f]{4,64}", prefix):
        raise ValueError(f"namespace prefix {prefix!r}: give 4 to 64 lowercase hex characters")
    store = open_store(url)
    keys = [(k, p[1]) for k in store.list_keys() if (p := parse_key(k)) is not None and p[0] != "marker"
            and p[1].startswith(prefix)]
    if not keys:
        raise ValueError(f"no namespace starting with {prefix!r} in {url}")
    _delete(store, [k for k, _ in keys])
    return sorted({ns for _, ns in keys})


def evict_entries(url: str, entries: list[dict]) -> int:
    """Delete the listed keys (items of `inspect(...)["corrupt"]` or `["stale"]`) that are the store's own. Returns
    how many."""
    store = open_store(url)
    return _delete(store, [e["key"] for e in entries if (p := parse_key(e["key"])) is not None and p[0] != "marker"])


def format_report(r: dict) -> str:
    """Human-readable table of an `inspect` result."""
    lines = [f"store {r['store']}: {len(r['namespaces'])} namespaces, {r['entries']} entries, "
             f"{r['bytes'] / 2**20:.2f} MiB"
             + (f", verified: {r['current']} of format {r['format_version']}, {len(r['stale'])} stale (another store "
                f"format), {len(r['corrupt'])} corrupt" if r["verified"] else "")
             + (f", {len(r['foreign'])} foreign files left alone" if r.get("foreign") else "")]
    for n in r["namespaces"]:
        i = n["identity"]
        lines.append(f"  {n['namespace'][:16]}  weights {i.get('weights', '?')}  kv {i.get('kv_dtype')}  "
                     f"P={i.get('block_size')}  mesh {i.get('mesh')}  {i.get('device_kind')}  jax {i.get('jax')}  "
                     f"{n['blocks']} blocks")
        for form, f in sorted(n["forms"].items()):
            lines.append(f"      {form:24s} {f['entries']:7d} entries {f['bytes'] / 2**20:10.2f} MiB")
    for c in r["corrupt"]:
        lines.append(f"  CORRUPT {c['key']}: {c['why']}")
    for v in sorted({str(e["format_version"]) for e in r.get("stale", [])}):
        n = sum(str(e["format_version"]) == v for e in r["stale"])
        lines.append(f"  STALE {n} entries of store format {v} (compatibility misses here; --evict-stale deletes them)")
    for k in ("evicted_namespaces", "evicted_corrupt", "evicted_stale"):
        if k in r:
            lines.append(f"  {k.replace('_', ' ')}: {r[k]}")
    return "\n".join(lines)
