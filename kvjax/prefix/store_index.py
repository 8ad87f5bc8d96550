"""Rebuild a PrefixCache's trees and store-tier availability from its store: the cache survives a restart.

Only what verifies is trusted: a namespace record must hash to its directory name, a chain of block records must
hash (`identity.block_keys`) to the keys it is stored under, and an entry's bytes are verified when read
(`tiers.StoreTier.decode_entry`, which also compares the entry's token ids with the block's). Anything malformed —
a record that is not JSON, not an object, missing fields — is skipped, never an exception: the cache starts with
what it can prove. Keys that are not the store's own (`tiers.parse_key`) are ignored. Namespaces whose form
fingerprints differ from the cache's are kept only to name the fields of identity misses. The store caps hold from
the start: a cache restarted with a smaller store budget evicts the excess (leaves first) before its first lookup.
"""

from __future__ import annotations

import collections
import json

import numpy as np

from kvjax.prefix.entry import Entry
from kvjax.prefix.identity import ROOT_KEY, Namespace, block_keys
from kvjax.prefix.layouts.llama import PATH
from kvjax.prefix.radix import RadixTree
from kvjax.prefix.tiers import STORE, parse_key


def _namespace(doc) -> Namespace | None:
    try:
        ns = Namespace(semantic=dict(doc["semantic"]), representation=dict(doc["representation"]),
                       tenant_salt=str(doc.get("tenant_salt", "")))
        ns.hex  # noqa: B018 - canonical encoding of a malformed record may fail: find out here
        return ns
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _record(raw, P: int) -> dict | None:
    """A block record {index, parent, tokens} if well formed, else None."""
    if raw.state != "value":
        return None
    try:
        rec = json.loads(bytes(raw.value))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("parent"), str) or not isinstance(rec.get("tokens"), list):
        return None
    if len(rec["tokens"]) != P or not all(isinstance(t, int) and not isinstance(t, bool) for t in rec["tokens"]):
        return None
    return rec


def load_store_index(pc) -> None:
    """Rebuild trees and store-tier availability from the store, then enforce the store caps."""
    by_ns = collections.defaultdict(list)
    for k in pc.store.list_keys():
        parsed = parse_key(k)
        if parsed is not None and parsed[0] != "marker":
            by_ns[parsed[1]].append(parsed)
    for ns_hex, keys in by_ns.items():
        ns = _namespace(pc.store.read_json(f"{ns_hex}/namespace.json"))
        if ns is None or ns.hex != ns_hex:
            continue  # a missing or tampered namespace record: nothing under it is trusted
        pc._store_ns.add(ns_hex)
        futs = {kh: pc.store.kv.read(f"{ns_hex}/blocks/{kh}") for kind, _, _, kh in keys if kind == "block"}
        recs = {kh: r for kh, f in futs.items() if (r := _record(f.result(), pc.P)) is not None}
        tree = RadixTree(pc.P)
        parents = {r["parent"] for r in recs.values()}
        for leaf in [k for k in recs if k not in parents]:
            chain, k, seen = [], leaf, set()
            while k in recs and k not in seen:
                seen.add(k)
                chain.append(k)
                k = recs[k]["parent"]
            if k != ROOT_KEY.hex():
                continue  # broken (or cyclic) chain: its blocks are unreachable
            chain.reverse()
            toks = np.asarray([t for c in chain for t in recs[c]["tokens"]], np.int64)
            if toks.size and (toks.min() < np.iinfo(np.int32).min or toks.max() > np.iinfo(np.int32).max):
                continue
            toks = toks.astype(np.int32)
            if [x.hex() for x in block_keys(ns.digest, toks, pc.P)] != chain:
                continue  # records that do not hash to their keys are not trusted
            tree.insert(toks, [bytes.fromhex(c) for c in chain], ROOT_KEY)
        by_key = {blk.key.hex(): blk for blk in tree.iter_blocks()}
        for blk in by_key.values():
            blk.recorded = True
        pc.trees[ns_hex] = (ns, tree)
        if ns.representation.get("formats") != {s.name: s.fingerprint for s in pc.forms.specs}:
            continue  # kept only to name identity misses
        for kind, _, form, kh in keys:
            spec = pc.specs.get(form) if kind == "entry" else None
            blk = by_key.get(kh)
            if spec is None or blk is None:
                continue
            where = blk.path if spec.kind == PATH else blk.snap
            e = where.get(form) or Entry(form, blk)
            where[form] = e
            e.in_store = True
            pc.members[form][STORE][e] = None
    with pc.lock:
        for name in pc.specs:
            over = len(pc.members[name][STORE]) - pc.caps[name][STORE]
            if over > 0:
                pc._evict(name, STORE, over)
