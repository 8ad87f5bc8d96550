"""PrefixCache: lookup -> Plan (before any compute), leases, admission caps, per-form eviction, tiers, metrics.

Entries are per (block, form). A path form's entry is the block's slice of that form; a snapshot form's entry is the
form's state at the block's end. An entry is *available* in a tier only once its bytes are complete there: device
writes are ordered by JAX data dependencies; host copies (asynchronous `device_put` to "pinned_host") and store
writes (TensorStore futures) sit in a pending list and are published by `_drain` when done. Eviction only clears
availability of unpinned entries (a device entry is demoted to host when the host admits it) and bumps the entry's
generation; it never changes what an available entry means. Every state change happens under one lock.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.prefix.entry import Entry, Metrics
from kvjax.prefix.identity import ROOT_KEY, Namespace, block_keys
from kvjax.prefix.layouts.llama import PATH, SNAPSHOT, FormSet
from kvjax.prefix.plan import CAPACITY, COMPATIBILITY, FormPlan, Lease, Plan, Shortfall
from kvjax.prefix.radix import Block, RadixTree
from kvjax.prefix.store_index import load_store_index
from kvjax.prefix.tiers import (DEVICE, HOST, STORE, TIERS, DevicePool, StoreTier, admission_caps, check_bytes,
    device_sharding, take_one, to_host)
from kvjax.errors import CorruptEntry, StaleLease



class _Replan(Exception):
    def __init__(self, cause: str, tiers=TIERS):
        super().__init__(cause)
        self.cause, self.tiers = cause, tiers


class PrefixCache:
    """A heterogeneous prefix cache over one model family's forms.

    Args:
        forms: the family's FormSet (`layout.forms_for(config, dtype, block_size)`).
        device_bytes, host_bytes, store_bytes: per-tier budgets, split per form by `admission_caps`.
        store_url: TensorStore kvstore URL or directory (`file://` default); None = no store tier.
        shares: form -> share of each tier's budget.
        store_timeout_s: a store read slower than this is a capacity miss ("tier timeout") and is recomputed.
    """

    def __init__(self, forms: FormSet, *, device_bytes: int = 64 << 20, host_bytes: int = 256 << 20,
                 store_url: str | None = None, store_bytes: int = 16 << 30, shares: dict | None = None,
                 store_timeout_s: float = 10.0, max_meta_blocks: int = 1 << 20):
        self.forms = forms
        self.P = forms.block_size
        self.specs = {s.name: s for s in forms.specs}
        self.path_forms = [s for s in forms.specs if s.kind == PATH]
        self.snap_forms = [s for s in forms.specs if s.kind == SNAPSHOT]
        self.align = math.lcm(*(s.align for s in self.path_forms)) if self.path_forms else 1
        budgets = {DEVICE: device_bytes, HOST: host_bytes, STORE: store_bytes if store_url else 0}
        self.caps = admission_caps(forms.specs, budgets, shares)
        self.pools = {n: DevicePool(s, self.caps[n][DEVICE]) for n, s in self.specs.items()}
        self.members = {n: {t: {} for t in TIERS} for n in self.specs}  # ordered sets of entries per tier
        self.trees: dict[str, tuple[Namespace, RadixTree]] = {}
        self.lock = threading.RLock()
        self.pending: list = []
        self.metrics = Metrics()
        self._clock = itertools.count(1)
        self._zeros: dict = {}
        self.max_meta_blocks = max_meta_blocks
        self.store = StoreTier(store_url, store_timeout_s) if store_url else None
        self._store_ns: set[str] = set()
        if self.store is not None:
            self._load_store_index()

    # ------------------------------------------------------------------------------------------------ lookup
    def lookup(self, ns: Namespace, tokens, *, prompt_logprobs: bool = False, tiers=TIERS) -> Plan:
        """Decide, before any compute, what of `tokens` is restored and from where.

        Args:
            ns: the request's namespace.
            tokens: i32[T] prompt token ids (after chat templating).
            prompt_logprobs: the request needs per-prompt-token outputs: bypass (boundary 0).
            tiers: tiers the plan may read.

        Returns:
            a Plan holding a Lease on every entry it reads (release it, or use `prefill`, which does).
        """
        t0 = time.perf_counter()
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        T, P = tokens.size, self.P
        with self.lock:
            self._drain()
            fplans = {n: FormPlan(n, s.kind) for n, s in self.specs.items()}
            shortfalls: list[Shortfall] = []
            blocks, div = [], None
            if prompt_logprobs:
                shortfalls.append(Shortfall(COMPATIBILITY, "bypass", "prompt log-probs need every prompt token's "
                                            "output", tokens=T))
            else:
                tree = self.trees.get(ns.hex)
                if tree is not None:
                    blocks, div = tree[1].match(tokens)
                if not blocks and T >= P:
                    fields = self._identity_miss(ns, tokens)
                    if fields:
                        shortfalls.append(Shortfall(COMPATIBILITY, "identity", f"fields {fields}", tokens=T))
                        for f in fields:
                            self.metrics.misses[COMPATIBILITY][f"identity:{f}"] += T
            matched = len(blocks) * P
            if div is not None:
                shortfalls.append(Shortfall(COMPATIBILITY, "token divergence", f"token divergence at index {div}",
                                            tokens=T - matched))
            elif matched < T and not shortfalls:
                shortfalls.append(Shortfall(COMPATIBILITY, "not cached", f"tokens [{matched}, {T}) not cached",
                                            tokens=T - matched))
            upper = min(T - 1, matched)  # the last prompt token is always recomputed: its logits are the output
            now = next(self._clock)
            # Per path form: leading available entries and their tiers, gathered in one pass. Only a few objects are
            # allocated per lookup (parallel lists, no per-block tuples) so a 2048-block walk does not wake the GC.
            avail = {}
            for spec in self.path_forms:
                name, ents, tl = spec.name, [], []
                for blk in blocks:
                    e = blk.path.get(name)
                    t = None if e is None else e.tier(tiers)
                    if t is None:
                        n = len(ents)
                        why = "not admitted" if e is None else ("tier excluded" if e.tier() else e.why)
                        shortfalls.append(Shortfall(CAPACITY, why, f"block {n} (tokens {n * P}..) {why}",
                                                    name, matched - n * P))
                        break
                    e.last_access = now
                    ents.append(e)
                    tl.append(t)
                avail[name] = (ents, tl)
                fplans[name].reusable = len(ents) * P
                upper = min(upper, len(ents) * P)
            for spec in self.snap_forms:
                fplans[spec.name].reusable = self._last_snapshot(blocks, (spec,), min(T - 1, matched), 1, tiers)
            if self.snap_forms:
                b = self._last_snapshot(blocks, self.snap_forms, upper, self.align, tiers)
                if b < upper:
                    shortfalls.append(Shortfall("boundary", "no snapshot", f"no snapshot of "
                                                f"{[s.name for s in self.snap_forms]} in ({b}, {upper}]",
                                                tokens=upper - b))
            else:
                b = (upper // self.align) * self.align
            if matched >= T and T > 0 and not prompt_logprobs:
                shortfalls.append(Shortfall("boundary", "last token", "exact whole-prompt hit: the last token is "
                                            "recomputed for its logits", tokens=T - upper))
            pins = []
            nb = -(-b // P)
            for spec in self.path_forms:
                ents, tl = avail[spec.name]
                fp = fplans[spec.name]
                fp.blocks, fp.tiers = blocks[:nb], tl[:nb]
                pins += ents[:nb]
            if b > 0:
                for spec in self.snap_forms:
                    blk = blocks[b // P - 1]
                    e = blk.snap[spec.name]
                    fplans[spec.name].blocks, fplans[spec.name].tiers = [blk], [e.tier(tiers)]
                    pins.append(e)
            for fp in fplans.values():
                fp.used = dict(collections.Counter(fp.tiers))
            for e in pins:
                e.pins += 1
            lease = Lease(self, pins, [e.generation for e in pins])
            ms = (time.perf_counter() - t0) * 1e3
            m = self.metrics
            m.lookups += 1
            m.prompt_tokens += T
            m.lookup_ms.append(ms)
            for s in shortfalls:
                if s.kind != COMPATIBILITY or s.cause != "identity":
                    m.misses[s.kind][s.cause] += s.tokens
            return Plan(namespace=ns.hex, prompt_tokens=T, matched=matched, boundary=b, forms=fplans,
                        shortfalls=shortfalls, lease=lease, lookup_ms=ms, ns=ns, tokens=tokens, tiers=tuple(tiers))

    def _last_snapshot(self, blocks, specs, upper: int, align: int, tiers) -> int:
        """Largest boundary <= upper (multiple of P and `align`) where every spec has an available snapshot."""
        P = self.P
        for i in range(min(len(blocks), upper // P) - 1, -1, -1):
            if ((i + 1) * P) % align:
                continue
            if all((e := blocks[i].snap.get(s.name)) is not None and e.tier(tiers) for s in specs):
                return (i + 1) * P
        return 0

    def _identity_miss(self, ns: Namespace, tokens) -> list[str]:
        """Fields by which `ns` differs from namespaces whose trees hold the prompt's first block."""
        out = set()
        for other, tree in self.trees.values():
            if other.hex != ns.hex and tree.match(tokens[: self.P])[0]:
                out.update(ns.diff(other))
        return sorted(out)

    def release(self, lease: Lease) -> None:
        with self.lock:
            if lease.released:
                return
            lease.released = True
            for e in lease.entries:
                e.pins -= 1

    # ------------------------------------------------------------------------------------------------ execute
    def execute(self, plan: Plan, cache) -> tuple[Any, Plan]:
        """Restore every form of `plan` into `cache` (a fresh `init_cache(...)`, batch 1; donated).

        Re-checks the lease first. A store entry that fails verification is marked corrupt (a capacity miss), a
        store read slower than the timeout is a "tier timeout"; either way the plan is re-made and the returned
        plan is the one executed.

        Returns:
            (cache with `plan.boundary` tokens restored, the executed plan).
        """
        for _ in range(4):
            try:
                return self._execute_once(plan, cache), plan
            except _Replan as r:
                self.metrics.events["replan:" + r.cause] += 1
                plan.lease.release()
                plan = self.lookup(plan.ns, plan.tokens, tiers=r.tiers)
        raise RuntimeError("prefix cache: plan kept failing verification")

    def _zero(self, key, shape, dtype):
        z = self._zeros.get(key)
        if z is None:
            z = self._zeros[key] = jnp.zeros(shape, dtype)
        return z

    def _read_store(self, plan: Plan, spec, blk: Block, fut) -> np.ndarray:
        """Wait for one store read started with `read_entry_async` and verify it (raises _Replan on failure)."""
        try:
            raw = fut.result(timeout=self.store.timeout_s)
        except TimeoutError:
            self.metrics.misses[CAPACITY]["tier timeout"] += self.P
            raise _Replan("tier timeout", tiers=tuple(t for t in plan.tiers if t != STORE)) from None
        try:
            return self.store.decode_entry(raw, plan.namespace, spec, blk.key)
        except CorruptEntry as err:
            with self.lock:
                e = (blk.path if spec.kind == PATH else blk.snap)[spec.name]
                self._drop(e, STORE, why="corrupt")  # counts events["corrupt"]
                self.metrics.misses[CAPACITY]["corrupt"] += self.P
            raise _Replan(f"corrupt ({err})") from None

    def _execute_once(self, plan: Plan, cache):
        P, b = self.P, plan.boundary
        lease = plan.lease
        if lease is None or lease.released:
            raise StaleLease("plan's lease was released before the plan was executed")
        if not lease.valid():
            raise _Replan("lease moved")
        staged_np: dict[str, Any] = {}
        # store reads happen outside the lock (the entries are pinned); everything else under it
        for spec in self.forms.specs:
            fp = plan.forms[spec.name]
            for j, (blk, tier) in enumerate(zip(fp.blocks, fp.tiers)):
                if tier == STORE:  # start every read first: they proceed in parallel
                    staged_np[(spec.name, j)] = (blk, self.store.read_entry_async(plan.namespace, spec, blk.key))
        for (name, j), (blk, fut) in staged_np.items():
            staged_np[(name, j)] = self._read_store(plan, self.specs[name], blk, fut)
        staged = {}
        with self.lock:
            if not lease.valid():
                raise _Replan("lease moved")  # an entry it reads was dropped (e.g. found corrupt) meanwhile
            maxB = None
            for spec in self.forms.specs:
                fp = plan.forms[spec.name]
                if spec.kind == PATH:
                    maxB = maxB or self._max_blocks(cache)
                    slots = np.full((maxB,), -1, np.int32)
                    from_staged = np.zeros((maxB,), bool)
                    host_rows = {}
                    for j, (blk, tier) in enumerate(zip(fp.blocks, fp.tiers)):
                        e = blk.path[spec.name]
                        if tier == DEVICE:
                            slots[j] = e.slot
                        elif tier == HOST:
                            bad = check_bytes(e.host, spec, "pinned_host")
                            if bad:
                                raise RuntimeError(f"host entry of {spec.name} failed byte checks: {bad}")
                            host_rows[j] = e.host
                        else:
                            host_rows[j] = staged_np[(spec.name, j)]
                        from_staged[j] = tier != DEVICE
                    pool = self.pools[spec.name]
                    if (from_staged == 0).any() and (pool.array.dtype != np.dtype(spec.dtype)
                                                     or pool.array.shape[1:] != spec.entry_shape):
                        raise RuntimeError(f"device pool of {spec.name} does not hold {spec.dtype}{spec.entry_shape}")
                    if host_rows:
                        buf = np.empty((maxB,) + spec.entry_shape, spec.dtype)  # unused rows are never selected
                        for j, x in host_rows.items():
                            buf[j] = np.asarray(x)
                        rows = jax.device_put(buf, device_sharding())
                    else:
                        rows = self._zero((spec.name, maxB), (maxB,) + spec.entry_shape, spec.dtype)
                    staged[spec.name] = self.pools[spec.name].gather(slots, rows, from_staged)
                    self._promote(spec, [blk.path[spec.name] for blk in fp.blocks], fp.tiers, staged[spec.name])
                else:
                    if not fp.blocks:
                        staged[spec.name] = self._zero(spec.name, spec.entry_shape, spec.dtype)
                        continue
                    blk, tier = fp.blocks[0], fp.tiers[0]
                    e = blk.snap[spec.name]
                    if tier == DEVICE:
                        staged[spec.name] = take_one(self.pools[spec.name].array, jnp.int32(e.slot))
                    elif tier == HOST:
                        staged[spec.name] = jax.device_put(e.host, device_sharding())
                    else:
                        x = staged_np[(spec.name, 0)]
                        bad = check_bytes(x, spec)
                        if bad:
                            raise RuntimeError(f"store entry of {spec.name} failed byte checks: {bad}")
                        staged[spec.name] = jax.device_put(x, device_sharding())
                    self._promote(spec, [e], [tier], staged[spec.name][None])
            m = self.metrics
            m.hit_tokens += b
            for spec in self.forms.specs:
                fp = plan.forms[spec.name]
                for tier, k in collections.Counter(fp.tiers).items():
                    m.reused_blocks[spec.name][tier] += k
                    m.reused_tokens[spec.name][tier] += k * P if spec.kind == PATH else b
                if spec.kind == PATH and fp.tiers and b % P:  # the last block is used in part
                    m.reused_tokens[spec.name][fp.tiers[-1]] -= P - b % P
        return self.forms.restore(cache, staged, b)

    def _promote(self, spec, entries, tiers_read, rows) -> None:
        """Give entries just read from host/store a device copy too, if free slots allow it (no eviction for it).

        `rows` [M, *entry] holds entry j at row j (already on the device). All or nothing, like every allocation.
        """
        idx = [j for j, (e, t) in enumerate(zip(entries, tiers_read)) if t != DEVICE and e.slot is None]
        pool = self.pools[spec.name]
        if not idx or len(idx) > len(pool.free):
            return
        slots = pool.reserve(len(idx))
        pool.put(rows, idx, slots)
        for j, s in zip(idx, slots):
            entries[j].slot = s
            self.members[spec.name][DEVICE][entries[j]] = None
        self.metrics.events["promoted"] += len(idx)

    def _max_blocks(self, cache) -> int:
        return cache.capacity // self.P

    # ------------------------------------------------------------------------------------------------ insert
    def insert(self, ns: Namespace, tokens, cache, snapshots: dict | None = None, *, priority: int = 0) -> dict:
        """Admit the full blocks of `tokens` whose state `cache` holds, and the snapshots taken at block boundaries.

        Args:
            ns: namespace of the computation that produced `cache`.
            tokens: i32[T] the prompt (its trailing partial block is not cached).
            cache: batch-1 cache after prefilling `tokens` (its first `length` tokens are valid).
            snapshots: boundary -> {snapshot form: entry}, from `forms.snapshot(cache)` at that boundary.
            priority: eviction priority (higher survives longer).

        Returns:
            counts of new entries per form and tier, and of refused ones.
        """
        self._check_formats(ns)
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        P = self.P
        valid = min(tokens.size, int(np.asarray(cache.length)[0]))
        n_full = valid // P
        tokens = tokens[: n_full * P]
        keys = block_keys(ns.digest, tokens, P)
        stats = collections.Counter()
        src = None
        with self.lock:
            self._drain()
            tree = self._tree(ns)
            blocks = tree.insert(tokens, keys, ROOT_KEY)
            now = next(self._clock)
            if self.store is not None:
                self._record_blocks(ns, blocks)
            for spec in self.path_forms:
                need = []
                for blk in blocks:
                    e = blk.path.get(spec.name)
                    if e is None:
                        e = blk.path[spec.name] = Entry(spec.name, blk)
                    e.last_access, e.priority = now, max(e.priority, priority)
                    if e.tier() is None and not e.pending:
                        need.append(e)
                if need:
                    src = src or self.forms.blocks(cache)
                    self._admit(ns, spec, need, src[spec.name], [e.block.index for e in need], stats)
            if tree.num_blocks > self.max_meta_blocks:
                self._prune(tree)
            for boundary, snap in sorted((snapshots or {}).items()):
                if boundary <= 0 or boundary % P or boundary // P > n_full:
                    continue
                blk = blocks[boundary // P - 1]
                for spec in self.snap_forms:
                    e = blk.snap.get(spec.name)
                    if e is None:
                        e = blk.snap[spec.name] = Entry(spec.name, blk)
                    e.last_access, e.priority = now, max(e.priority, priority)
                    if e.tier() is None and not e.pending:
                        self._admit(ns, spec, [e], snap[spec.name][None], [0], stats)
        return dict(stats)

    def _prune(self, tree: RadixTree) -> int:
        """Drop metadata of dead blocks (no tier, nothing pending, unpinned) from the ends of leaves."""

        def dead(blk):
            return all(e.tier() is None and not e.pending and not e.pins
                       for e in (*blk.path.values(), *blk.snap.values()))

        removed, changed = 0, True
        while changed and tree.num_blocks > self.max_meta_blocks:
            changed = False
            for leaf in tree.leaves():
                n = 0
                while n < len(leaf.blocks) and dead(leaf.blocks[-1 - n]):
                    n += 1
                if n:
                    tree.remove_tail(leaf, n)
                    removed += n
                    changed = True
        self.metrics.events["pruned_blocks"] += removed
        return removed

    def _check_formats(self, ns: Namespace) -> None:
        want = {s.name: s.fingerprint for s in self.forms.specs}
        got = dict(ns.representation.get("formats", {}))
        if got != want or ns.representation.get("block_size") != self.P:
            raise ValueError(f"namespace formats/block size {got}, P={ns.representation.get('block_size')} do not "
                             f"match this cache's forms {want}, P={self.P}")

    def _tree(self, ns: Namespace) -> RadixTree:
        t = self.trees.get(ns.hex)
        if t is None:
            t = self.trees[ns.hex] = (ns, RadixTree(self.P))
        if self.store is not None and ns.hex not in self._store_ns:
            self.store.write_namespace(ns)
            self._store_ns.add(ns.hex)
        return t[1]

    def _record_blocks(self, ns: Namespace, blocks) -> None:
        for blk in blocks:
            if not getattr(blk, "recorded", False):
                blk.recorded = True
                fut = self.store.write_block_record(ns.hex, blk.key, blk.parent_key, blk.index, blk.tokens)
                self.pending.append(("record", None, fut))

    def _admit(self, ns, spec, entries, src, src_idx, stats) -> None:
        """Place `entries` (rows `src_idx` of `src` [M, *entry]) in the first tier that takes all of them."""
        name = spec.name
        pool = self.pools[name]
        k = len(entries)
        placed = False
        if pool.n >= k:
            short = k - len(pool.free)
            if short > 0:
                self._evict(name, DEVICE, short, protect=set(entries))
            slots = pool.reserve(k)
            if slots is not None:
                pool.put(src, src_idx, slots)
                for e, s in zip(entries, slots):
                    e.slot = s
                    self.members[name][DEVICE][e] = None
                stats[f"{name}:{DEVICE}"] += k
                placed = True
        if not placed and self._room(name, HOST, k, protect=set(entries)):
            for e, i in zip(entries, src_idx):
                e.pending += 1
                self.pending.append((HOST, e, to_host(take_one(src, jnp.int32(i)))))
            stats[f"{name}:{HOST}"] += k
            placed = True
        if self.store is not None and self._room(name, STORE, k, protect=set(entries)):
            for e, i in zip(entries, src_idx):
                data = np.asarray(take_one(src, jnp.int32(i)))
                e.pending += 1
                self.pending.append((STORE, e, self.store.write_entry(ns.hex, spec, e.block.key, data)))
            stats[f"{name}:{STORE}"] += k
            placed = True
        if not placed:
            for e in entries:
                e.why = "not admitted"
            stats[f"{name}:refused"] += k
            self.metrics.events["not_admitted"] += k

    def _room(self, name: str, tier: str, k: int, protect=frozenset()) -> bool:
        """Make room for `k` more entries of `name` in `tier` (host/store): all or nothing."""
        cap = self.caps[name][tier]
        if k > cap:
            return False
        used = len(self.members[name][tier]) + sum(1 for t, e, _ in self.pending if t == tier and e.form == name)
        if used + k > cap:
            self._evict(name, tier, used + k - cap, protect)
            used = len(self.members[name][tier]) + sum(1 for t, e, _ in self.pending if t == tier and e.form == name)
        return used + k <= cap

    # ------------------------------------------------------------------------------------------------ eviction
    def _evict(self, name: str, tier: str, k: int, protect=frozenset()) -> int:
        """Evict up to `k` unpinned entries of form `name` from `tier`: lowest priority, least recent, deepest first.

        A device entry is demoted to the host when the host admits it. Returns how many were evicted.
        """
        cands = [e for e in self.members[name][tier] if e.pins == 0 and e not in protect]
        cands.sort(key=lambda e: (e.priority, e.last_access, -e.block.index))
        done = 0
        for e in cands[:k]:
            if tier == DEVICE and e.host is None and not e.pending and self._room(name, HOST, 1, protect | {e}):
                row = take_one(self.pools[name].array, jnp.int32(e.slot))
                row.block_until_ready()  # the slot is reused only after its bytes were read
                e.pending += 1
                self.pending.append((HOST, e, to_host(row)))
                self.metrics.events["demoted"] += 1
            self._drop(e, tier, why="evicted")
            done += 1
        return done

    def evict(self, form: str, tier: str, k: int) -> int:
        """Public: evict up to `k` unpinned entries of `form` from `tier` (tests, memory pressure)."""
        with self.lock:
            self._drain()
            return self._evict(form, tier, k)

    def _drop(self, e: Entry, tier: str, why: str) -> None:
        """Remove `e`'s bytes from `tier` (availability only) and bump its generation."""
        self.members[e.form][tier].pop(e, None)
        if tier == DEVICE and e.slot is not None:
            self.pools[e.form].release(e.slot)
            e.slot = None
        elif tier == HOST:
            e.host = None
        elif tier == STORE and e.in_store:
            e.in_store = False
            ns_hex = self._ns_of(e)
            if ns_hex is not None:
                self.pending.append(("delete", None, self.store.delete_entry(ns_hex, e.form, e.block.key)))
        e.generation += 1
        if e.tier() is None:
            e.why = why
            self.metrics.events[why] += 1

    def _ns_of(self, e: Entry) -> str | None:
        node = e.block.node
        while node.parent is not None:
            node = node.parent
        for ns_hex, (_, tree) in self.trees.items():
            if tree.root is node:
                return ns_hex
        return None

    # ------------------------------------------------------------------------------------------------ publishing
    def _drain(self, wait: bool = False) -> None:
        """Publish copies whose bytes are complete (host: `is_ready()`, store: future done)."""
        keep = []
        for kind, e, obj in self.pending:
            if kind == HOST:
                if wait:
                    obj.block_until_ready()
                if not obj.is_ready():
                    keep.append((kind, e, obj))
                    continue
                e.pending -= 1
                e.host = obj  # adding a copy moves nothing a lease reads: no generation bump
                self.members[e.form][HOST][e] = None
            else:
                if not wait and not obj.done():
                    keep.append((kind, e, obj))
                    continue
                try:
                    obj.result()
                    ok = True
                except Exception:  # noqa: BLE001 - a failed write is just not published
                    ok = False
                    self.metrics.events["store_write_failed"] += 1
                if kind == STORE:
                    e.pending -= 1
                    if ok:
                        e.in_store = True
                        self.members[e.form][STORE][e] = None
        self.pending = keep

    def flush(self) -> None:
        """Wait until every copy in flight is complete and published."""
        with self.lock:
            self._drain(wait=True)

    # ------------------------------------------------------------------------------------------------ restart
    def _load_store_index(self) -> None:
        load_store_index(self)

    # ------------------------------------------------------------------------------------------------ integration
    def prefill(self, model, prompt, **kw):
        """lookup -> execute -> prefill the rest -> insert. See `kvjax.prefix.prefill.prefill_with_prefix_cache`."""
        from kvjax.prefix.prefill import prefill_with_prefix_cache

        return prefill_with_prefix_cache(model, prompt, self, **kw)

    def stats(self) -> dict:
        with self.lock:
            d = self.metrics.as_dict()
            d["entries"] = {n: {t: len(self.members[n][t]) for t in TIERS} for n in self.specs}
            d["caps"] = self.caps
            return d
