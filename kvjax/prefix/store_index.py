"""Rebuild a PrefixCache's trees and store-tier availability from its store: the cache survives a restart.

Only what verifies is trusted: a namespace record must hash to its directory name, a chain of block records must
hash (`identity.block_keys`) to the keys it is stored under, and an entry's bytes are verified when read
(`tiers.StoreTier.decode_entry`). Namespaces whose form fingerprints differ from the cache's are kept only to name
the fields of identity misses.
"""

from __future__ import annotations

import collections
import json

import numpy as np

from kvjax.prefix.entry import Entry
from kvjax.prefix.identity import ROOT_KEY, Namespace, block_keys
from kvjax.prefix.layouts.llama import PATH
from kvjax.prefix.radix import RadixTree
from kvjax.prefix.tiers import STORE


def load_store_index(pc) -> None:
    """Rebuild trees and store-tier availability from the store (the cache survives a restart)."""
    keys = pc.store.list_keys()
    by_ns = collections.defaultdict(list)
    for k in keys:
        ns_hex, _, rest = k.partition("/")
        by_ns[ns_hex].append(rest)
    for ns_hex, rests in by_ns.items():
        doc = pc.store.read_json(f"{ns_hex}/namespace.json")
        if doc is None:
            continue
        ns = Namespace(semantic=doc["semantic"], representation=doc["representation"],
                       tenant_salt=doc.get("tenant_salt", ""))
        if ns.hex != ns_hex:
            continue  # a tampered namespace record is ignored
        pc._store_ns.add(ns_hex)
        recs = {}
        futs = {r[len("blocks/"):]: pc.store.kv.read(f"{ns_hex}/{r}") for r in rests if r.startswith("blocks/")}
        for kh, f in futs.items():
            raw = f.result()
            if raw.state == "value":
                try:
                    recs[kh] = json.loads(bytes(raw.value))
                except ValueError:
                    continue
        tree = RadixTree(pc.P)
        parents = {r["parent"] for r in recs.values()}
        for leaf in [k for k in recs if k not in parents]:
            chain, k = [], leaf
            while k in recs:
                chain.append(k)
                k = recs[k]["parent"]
            if k != ROOT_KEY.hex():
                continue  # broken chain: its blocks are unreachable
            chain.reverse()
            toks = np.asarray([t for c in chain for t in recs[c]["tokens"]], np.int32)
            if toks.size != len(chain) * pc.P or [x.hex() for x in block_keys(ns.digest, toks, pc.P)] != chain:
                continue  # records that do not hash to their keys are not trusted
            tree.insert(toks, [bytes.fromhex(c) for c in chain], ROOT_KEY)
        by_key = {blk.key.hex(): blk for blk in tree.iter_blocks()}
        for blk in by_key.values():
            blk.recorded = True
        pc.trees[ns_hex] = (ns, tree)
        formats_ok = ns.representation.get("formats") == {s.name: s.fingerprint for s in pc.forms.specs}
        if not formats_ok:
            continue  # kept only to name identity misses
        for r in rests:
            form, _, kh = r.partition("/")
            spec = pc.specs.get(form)
            blk = by_key.get(kh)
            if spec is None or blk is None:
                continue
            where = blk.path if spec.kind == PATH else blk.snap
            e = where.get(form) or Entry(form, blk)
            where[form] = e
            e.in_store = True
            pc.members[form][STORE][e] = None
