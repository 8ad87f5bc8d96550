"""Offline view of a prefix-cache store (`kvjax cache`): namespaces, entries, sizes, checksums, eviction.

Works on the store's public layout (`kvjax.prefix.tiers.StoreTier`), without a model or a running `PrefixCache`:
`<namespace hex>/namespace.json`, `<namespace hex>/blocks/<block key>` (token records), and
`<namespace hex>/<form>/<block key>` (entries: `u64 header length | JSON header | payload`). Verification re-does
what `StoreTier.decode_entry` checks that needs no form spec: magic, format version, namespace / form / block key
against the entry's own key, declared shape x dtype = byte count = payload length, BLAKE2b checksum; plus that the
namespace record hashes to its directory name. Deleting entries under a running cache is safe: the cache finds the
entry missing when it reads it, counts a capacity miss and recomputes.
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np

from kvjax.prefix.identity import Namespace, payload_checksum
from kvjax.prefix.tiers import MAGIC, STORE_FORMAT_VERSION, StoreTier


def open_store(url: str) -> StoreTier:
    """Open an existing store (a local path must exist: opening would otherwise create an empty one)."""
    local = url[len("file://"):] if url.startswith("file://") else (None if "://" in url else url)
    if local is not None and not os.path.isdir(local):
        raise FileNotFoundError(f"no prefix-cache store at {url}")
    return StoreTier(url)


def check_entry(key: str, buf: bytes) -> tuple[dict | None, str | None]:
    """(header, None) if the stored value under `key` verifies, else (header or None, reason)."""
    ns_hex, form, block_hex = key.split("/", 2)
    if len(buf) < 8:
        return None, "truncated: no header length"
    hl = int.from_bytes(buf[:8], "little")
    try:
        header = json.loads(buf[8:8 + hl])
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"unreadable header: {e}"
    payload = buf[8 + hl:]
    for k, want in (("magic", MAGIC), ("format_version", STORE_FORMAT_VERSION), ("namespace", ns_hex),
                    ("form", form), ("block_key", block_hex), ("complete", True)):
        if header.get(k) != want:
            return header, f"header {k}={header.get(k)!r}, expected {want!r}"
    try:
        need = int(np.prod(header["shape"])) * np.dtype(header["dtype"]).itemsize
    except (KeyError, TypeError):
        return header, f"bad shape/dtype {header.get('shape')!r} {header.get('dtype')!r}"
    if not (header.get("nbytes") == len(payload) == need):
        return header, f"truncated payload: {len(payload)} bytes, header says {header.get('nbytes')}, " \
                       f"shape x dtype needs {need}"
    if payload_checksum(payload) != header.get("checksum"):
        return header, "checksum mismatch"
    return header, None


def inspect(url: str, *, namespace: str | None = None, verify: bool = False) -> dict:
    """Summarise a store: per namespace its identity, blocks, and entries / bytes per form (optionally verified).

    Returns:
        dict(store, namespaces=[...], corrupt=[{key, why}], entries, bytes); sizes are payload + header bytes.
    """
    store = open_store(url)
    keys = store.list_keys()
    by_ns = collections.defaultdict(list)
    for k in keys:
        ns_hex, _, rest = k.partition("/")
        if namespace is None or ns_hex.startswith(namespace):
            by_ns[ns_hex].append(rest)
    out, corrupt = [], []
    for ns_hex, rests in sorted(by_ns.items()):
        doc = store.read_json(f"{ns_hex}/namespace.json")
        ident, ns_ok = {}, False
        if doc is not None:
            try:
                ns = Namespace(semantic=doc["semantic"], representation=doc["representation"],
                               tenant_salt=doc.get("tenant_salt", ""))
                ns_ok = ns.hex == ns_hex
            except (KeyError, TypeError):
                pass
            sem, rep = doc.get("semantic", {}), doc.get("representation", {})
            ident = dict(weights=str(sem.get("weights", ""))[:16], adapter=sem.get("adapter", ""),
                         kv_dtype=rep.get("kv_dtype"), block_size=rep.get("block_size"), mesh=rep.get("mesh"),
                         kernel_abi=rep.get("kernel_abi"), forms=sorted(dict(rep.get("formats", {}))))
        if not ns_ok:
            corrupt.append(dict(key=f"{ns_hex}/namespace.json",
                                why="missing" if doc is None else "namespace record does not hash to its key"))
        entry_keys = [r for r in rests if r != "namespace.json" and not r.startswith("blocks/")]
        futs = {r: store.kv.read(f"{ns_hex}/{r}") for r in entry_keys}
        forms = collections.defaultdict(lambda: dict(entries=0, bytes=0))
        for r, f in futs.items():
            raw = f.result()
            buf = bytes(raw.value) if raw.state == "value" else b""
            form = r.split("/", 1)[0]
            forms[form]["entries"] += 1
            forms[form]["bytes"] += len(buf)
            if verify:
                _, why = check_entry(f"{ns_hex}/{r}", buf)
                if why:
                    corrupt.append(dict(key=f"{ns_hex}/{r}", why=why))
        out.append(dict(namespace=ns_hex, identity=ident, blocks=sum(r.startswith("blocks/") for r in rests),
                        forms=dict(forms), entries=sum(f["entries"] for f in forms.values()),
                        bytes=sum(f["bytes"] for f in forms.values())))
    return dict(store=store.url, namespaces=out, verified=verify, corrupt=corrupt,
                entries=sum(n["entries"] for n in out), bytes=sum(n["bytes"] for n in out))


def evict_namespace(url: str, prefix: str) -> list[str]:
    """Delete every key of the namespaces whose hex starts with `prefix` (at least 4 characters). Returns them."""
    import tensorstore as ts

    if len(prefix) < 4:
        raise ValueError(f"namespace prefix {prefix!r} too short: give at least 4 hex characters")
    store = open_store(url)
    names = sorted({k.partition("/")[0] for k in store.list_keys() if k.startswith(prefix)})
    if not names:
        raise ValueError(f"no namespace starting with {prefix!r} in {url}")
    for ns_hex in names:  # "0" is the character after "/": the range is exactly the keys under ns_hex/
        store.kv.delete_range(ts.KvStore.KeyRange(ns_hex + "/", ns_hex + "0")).result()
    return names


def evict_entries(url: str, entries: list[dict]) -> int:
    """Delete the listed keys (entries of `inspect(...)["corrupt"]`). Returns how many."""
    import tensorstore as ts

    store = open_store(url)
    futs = [store.kv.delete_range(ts.KvStore.KeyRange(e["key"], e["key"] + "\x00")) for e in entries]
    for f in futs:
        f.result()
    return len(futs)


def format_report(r: dict) -> str:
    """Human-readable table of an `inspect` result."""
    lines = [f"store {r['store']}: {len(r['namespaces'])} namespaces, {r['entries']} entries, "
             f"{r['bytes'] / 2**20:.2f} MiB" + (f", verified: {len(r['corrupt'])} corrupt" if r["verified"] else "")]
    for n in r["namespaces"]:
        i = n["identity"]
        lines.append(f"  {n['namespace'][:16]}  weights {i.get('weights', '?')}  kv {i.get('kv_dtype')}  "
                     f"P={i.get('block_size')}  mesh {i.get('mesh')}  {n['blocks']} blocks")
        for form, f in sorted(n["forms"].items()):
            lines.append(f"      {form:24s} {f['entries']:7d} entries {f['bytes'] / 2**20:10.2f} MiB")
    for c in r["corrupt"]:
        lines.append(f"  CORRUPT {c['key']}: {c['why']}")
    for k in ("evicted_namespaces", "evicted_corrupt"):
        if k in r:
            lines.append(f"  {k.replace('_', ' ')}: {r[k]}")
    return "\n".join(lines)
