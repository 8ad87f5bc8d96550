"""PrefixCache: lookup -> Plan (before any compute), leases, admission caps, per-form eviction, tiers, metrics.

Entries are per (block, form). A path form's entry is the block's slice of that form; a snapshot form's entry is the
form's state at the block's end. An entry is *available* in a tier only once its bytes are complete there: device
writes are ordered by JAX data dependencies; host copies (asynchronous `device_put` to "pinned_host") and store
writes (TensorStore futures) sit in a pending list and are published by `_drain` when done. Eviction only clears
availability of unpinned entries (a device entry is demoted to host when the host admits it) and bumps the entry's
generation; it never changes what an available entry means. Every state change happens under one lock.

Reliability rules (issue 17): a lookup decides with `planner.build_plan`, whose shortfalls count every prompt token
once; `execute` verifies everything it reads and turns any number of failures into re-plans and, at worst, a full
recompute, releasing every lease it abandons; admission never evicts the chain being inserted; a restarted cache
holds its store caps from the start (`store_index`).
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

from kvjax.errors import CorruptEntry, StaleLease
from kvjax.prefix.entry import Entry, Metrics
from kvjax.prefix.identity import ROOT_KEY, Namespace, block_keys
from kvjax.prefix.layouts.llama import PATH, SNAPSHOT, BlockLayout
from kvjax.prefix.plan import Lease, Plan
from kvjax.prefix.planner import build_plan, cold_plan
from kvjax.prefix.radix import Block, RadixTree
from kvjax.prefix.store_index import load_store_index
from kvjax.prefix.tiers import (DEVICE, HOST, STORE, TIERS, DevicePool, StaleEntry, StoreTier, admission_caps,
                                check_bytes, device_sharding, take_one, to_host)

MAX_REPLANS = 4  # re-plans one request may make; after that it reads nothing and recomputes its whole prompt


class _Replan(Exception):
    """Raised inside `execute` when what a plan reads failed a check; the plan is re-made without it.

    Attributes:
        cause: the event name ("corrupt", "tier timeout", "lease moved").
        tiers: the tiers the new plan may read (None: the same as the failed plan's).
        why: the cause the new plan reports for entries held only in the excluded tiers (None: unchanged).
    """

    def __init__(self, cause: str, tiers=None, why: str | None = None):
        super().__init__(cause)
        self.cause, self.tiers, self.why = cause, tiers, why


class PrefixCache:
    """A heterogeneous prefix cache over one model family's forms.

    Args:
        forms: the family's BlockLayout (`kvjax.families.forms_for(config, dtype, block_size)`).
        device_bytes, host_bytes, store_bytes: per-tier budgets, split per form by `admission_caps`.
        store_url: TensorStore kvstore URL or directory (`file://` default); None = no store tier. An empty location
            becomes a new store; a location that is not a kvjax store is refused (`tiers.StoreTier`).
        shares: form -> share of each tier's budget.
        store_timeout_s: a store read slower than this is a capacity miss ("tier timeout") and is recomputed.
    """

    def __init__(self, forms: BlockLayout, *, device_bytes: int = 64 << 20, host_bytes: int = 256 << 20,
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
        self._abandoned: collections.deque = collections.deque()  # leases of collected plans, released under the lock
        self.metrics = Metrics()
        self.tenant_metrics: dict[str, Metrics] = collections.defaultdict(Metrics)
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
            tokens: i32[T] prompt token ids (after chat templating); may be empty.
            prompt_logprobs: the request needs per-prompt-token outputs: bypass (boundary 0).
            tiers: tiers the plan may read.

        Returns:
            a Plan holding a Lease on every entry it reads (release it, or use `prefill`, which does; a plan that is
            dropped releases its lease when it is garbage collected). The request is counted here, once:
            `prompt_tokens` and `lookups`, and its tokens as hits or misses by (kind, cause); a re-plan inside
            `execute` replaces those counts.
        """
        t0 = time.perf_counter()
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        with self.lock:
            self._drain()
            plan = build_plan(self, ns, tokens, prompt_logprobs=prompt_logprobs, tiers=tuple(tiers),
                              excluded_why="tier excluded")
            plan.lookup_ms = ms = (time.perf_counter() - t0) * 1e3
            for m in self._metrics_for(ns):
                m.lookups += 1
                m.prompt_tokens += plan.prompt_tokens
                m.lookup_ms.append(ms)
                for s in plan.shortfalls:
                    for f in s.fields:
                        m.events[f"identity:{f}"] += 1
            self._count(plan, +1)
            return plan

    def _metrics_for(self, ns: Namespace) -> tuple[Metrics, Metrics]:
        return self.metrics, self.tenant_metrics[ns.tenant_salt]

    def _count(self, plan: Plan, sign: int) -> None:
        """Add (sign=+1) or take back (sign=-1) a plan's hit and miss tokens."""
        for m in self._metrics_for(plan.ns):
            m.hit_tokens += sign * plan.boundary
            for s in plan.shortfalls:
                if s.tokens:
                    m.misses[s.kind][s.cause] += sign * s.tokens

    def release(self, lease: Lease) -> None:
        """Unpin what `lease` pins (idempotent)."""
        with self.lock:
            if lease.released:
                return
            lease.released = True
            for e in lease.entries:
                e.pins -= 1

    def abandon(self, lease: Lease) -> None:
        """Release the lease of a plan that was garbage collected (its finalizer calls this).

        A finalizer runs wherever the collector happens to run, possibly inside code that holds other locks while
        another thread holds this cache's: so it never waits for the lock. If the lock is free (or held by this
        thread) the lease is released now, else at the start of the next operation that takes the lock.
        """
        if self.lock.acquire(blocking=False):
            try:
                self.release(lease)
            finally:
                self.lock.release()
        else:
            self._abandoned.append(lease)  # deque.append is atomic: no lock needed

    def _reap(self) -> None:
        while self._abandoned:
            self.release(self._abandoned.popleft())

    def pinned(self) -> int:
        """Pins held right now, over every entry (0 when no plan is alive)."""
        with self.lock:
            self._reap()
            return sum(e.pins for _, tree in self.trees.values() for blk in tree.iter_blocks()
                       for e in (*blk.path.values(), *blk.snap.values()))

    # ------------------------------------------------------------------------------------------------ execute
    def execute(self, plan: Plan, cache) -> tuple[Any, Plan]:
        """Restore every form of `plan` into `cache` (a fresh `init_cache(...)`, batch 1; donated).

        Re-checks the lease first (time of check = time of use) and verifies everything it reads: store entries
        (header, identity, token ids, checksum), host copies (dtype, shape, memory kind) and the token ids every
        entry was computed from. What fails is dropped from its tier ("corrupt", a capacity miss), a store read
        slower than the timeout is a "tier timeout"; either way the plan is re-made and the returned plan is the one
        executed. After `MAX_REPLANS` re-plans the request reads nothing (boundary 0): bad entries, however many,
        mean recompute, never an exception. Every abandoned plan's lease is released here, and so is the current
        one's if this raises; the returned plan's lease is the caller's to release.

        Returns:
            (cache with `plan.boundary` tokens restored, the executed plan).

        Raises:
            StaleLease: `plan`'s lease was released before it was executed.
        """
        replans = 0
        try:
            while True:
                try:
                    return self._execute_once(plan, cache), plan
                except _Replan as r:
                    replans += 1
                    plan = self._replan(plan, r, give_up=replans > MAX_REPLANS)
        except BaseException:
            plan.lease.release()
            raise

    def _replan(self, plan: Plan, r: _Replan, *, give_up: bool) -> Plan:
        with self.lock:
            for m in self._metrics_for(plan.ns):
                m.events["replan:" + r.cause] += 1
            self._count(plan, -1)
            plan.lease.release()
            if give_up:
                new = cold_plan(self, plan, MAX_REPLANS)
            else:
                self._drain()
                new = build_plan(self, plan.ns, plan.tokens, prompt_logprobs=False,
                                 tiers=plan.tiers if r.tiers is None else tuple(r.tiers),
                                 excluded_why=plan.excluded_why if r.why is None else r.why)
                new.lookup_ms = plan.lookup_ms
            self._count(new, +1)
            return new

    def _zero(self, key, shape, dtype):
        z = self._zeros.get(key)
        if z is None:
            z = self._zeros[key] = jnp.zeros(shape, dtype)
        return z

    @staticmethod
    def _entry(blk: Block, spec) -> Entry:
        return (blk.path if spec.kind == PATH else blk.snap)[spec.name]

    def _read_store(self, plan: Plan) -> dict:
        """Read and verify every store entry `plan` reads (outside the lock: they are pinned).

        All reads start first and proceed in parallel. Every entry that fails verification is dropped from the store
        tier ("corrupt") before the one re-plan is requested, so one request re-plans once for any number of them.

        Returns:
            (form name, index in the form's plan) -> verified entry.
        """
        futs = {}
        for spec in self.forms.specs:
            fp = plan.forms[spec.name]
            for j, (blk, tier) in enumerate(zip(fp.blocks, fp.tiers)):
                if tier == STORE:
                    futs[(spec.name, j)] = (blk, self.store.read_entry_async(plan.namespace, spec, blk.key))
        out, bad = {}, []
        for (name, j), (blk, fut) in futs.items():
            try:
                raw = fut.result(timeout=self.store.timeout_s)
            except TimeoutError:
                raise _Replan("tier timeout", tiers=tuple(t for t in plan.tiers if t != STORE),
                              why="tier timeout") from None
            try:
                out[(name, j)] = self.store.decode_entry(raw, plan.namespace, self.specs[name], blk)
            except StaleEntry as e:  # another store format's entry: a compatibility miss, left in the store
                bad.append((self.specs[name], blk, e.cause))
            except CorruptEntry:
                bad.append((self.specs[name], blk, "corrupt"))
        if bad:
            with self.lock:
                for spec, blk, why in bad:
                    self._drop(self._entry(blk, spec), STORE, why=why, delete=why == "corrupt")
            raise _Replan(bad[0][2])
        return out

    def _check_memory_tiers(self, plan: Plan) -> None:
        """Verify what the plan reads from the device and host tiers (call under the lock).

        Every entry's recorded token ids must be the prompt's at its block (one vectorised comparison per form), and
        host copies get the byte-level checks (dtype, shape, memory kind). A failing copy is dropped from its tier
        ("corrupt") and the plan re-made.
        """
        P, bad = self.P, []
        for spec in self.forms.specs:
            fp = plan.forms[spec.name]
            read = [(self._entry(blk, spec), tier) for blk, tier in zip(fp.blocks, fp.tiers) if tier != STORE]
            recorded = [(e, tier) for e, tier in read if e.tokens is not None]
            if recorded:
                got = np.stack([e.tokens for e, _ in recorded])  # [n, P]
                starts = np.asarray([e.block.index * P for e, _ in recorded])
                want = plan.tokens[starts[:, None] + np.arange(P)]
                bad += [recorded[i] for i in np.nonzero((got != want).any(axis=1))[0]]
            bad += [(e, tier) for e, tier in read if tier == HOST and check_bytes(e.host, spec, "pinned_host")]
        for e, tier in dict.fromkeys(bad):
            self._drop(e, tier, why="corrupt")
        if bad:
            raise _Replan("corrupt")

    def _execute_once(self, plan: Plan, cache):
        P, b = self.P, plan.boundary
        lease = plan.lease
        if lease is None or lease.released:
            raise StaleLease("plan's lease was released before the plan was executed")
        if not lease.valid():
            raise _Replan("lease moved")
        if b == 0:
            return cache  # nothing to restore: a fresh cache is exactly the state at boundary 0
        staged_np = self._read_store(plan) if STORE in plan.tiers else {}
        staged = {}
        with self.lock:
            if not lease.valid():
                raise _Replan("lease moved")  # an entry it reads was dropped (e.g. found corrupt) meanwhile
            self._check_memory_tiers(plan)
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
                        staged[spec.name] = jax.device_put(staged_np[(spec.name, 0)], device_sharding())
                    self._promote(spec, [e], [tier], staged[spec.name][None])
            for m in self._metrics_for(plan.ns):
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
            if entries[j].tokens is None:  # read from the store, whose header tokens were just verified
                entries[j].tokens = entries[j].block.tokens.copy()
            self.members[spec.name][DEVICE][entries[j]] = None
        self.metrics.events["promoted"] += len(idx)

    def _max_blocks(self, cache) -> int:
        return cache.capacity // self.P

    # ------------------------------------------------------------------------------------------------ insert
    def insert(self, ns: Namespace, tokens, cache, snapshots: dict | None = None, *, priority: int = 0) -> dict:
        """Admit the full blocks of `tokens` whose state `cache` holds, and the snapshots taken at block boundaries.

        Admission never evicts an entry of the chain being inserted (the prompt's own blocks, shared or new, every
        form): extending a cached prompt keeps its parents, so what both prompts can hit stays reachable. Snapshots
        are admitted deepest first (the next turn of a conversation resumes from the deepest one).

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
            chain = frozenset(blocks)
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
                    self._admit(ns, spec, need, src[spec.name], [e.block.index for e in need], stats, chain, tokens)
            for boundary, snap in sorted((snapshots or {}).items(), reverse=True):
                if boundary <= 0 or boundary % P or boundary // P > n_full:
                    continue
                blk = blocks[boundary // P - 1]
                for spec in self.snap_forms:
                    e = blk.snap.get(spec.name)
                    if e is None:
                        e = blk.snap[spec.name] = Entry(spec.name, blk)
                    e.last_access, e.priority = now, max(e.priority, priority)
                    if e.tier() is None and not e.pending:
                        self._admit(ns, spec, [e], snap[spec.name][None], [0], stats, chain, tokens)
            if tree.num_blocks > self.max_meta_blocks:
                self._prune(tree, chain)
        return dict(stats)

    def _prune(self, tree: RadixTree, keep=frozenset()) -> int:
        """Drop metadata of dead blocks (no tier, nothing pending, unpinned, not in `keep`) from the ends of leaves."""

        def dead(blk):
            return blk not in keep and all(e.tier() is None and not e.pending and not e.pins
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

    def _admit(self, ns, spec, entries, src, src_idx, stats, chain=frozenset(), tokens=None) -> None:
        """Place `entries` (rows `src_idx` of `src` [M, *entry]) in the first tier that takes all of them.

        `chain`: Blocks whose entries must not be evicted to make room (the request's own chain). `tokens`: the
        prompt the rows were computed from (each entry records its block's ids, compared on restore).
        """
        name = spec.name
        pool = self.pools[name]
        k = len(entries)
        if tokens is not None:
            P = self.P
            for e in entries:
                e.tokens = tokens[e.block.index * P:(e.block.index + 1) * P].copy()
        placed = False
        if pool.n >= k:
            short = k - len(pool.free)
            if short <= 0 or self._evict(name, DEVICE, short, chain, all_or_nothing=True):
                slots = pool.reserve(k)
                pool.put(src, src_idx, slots)
                for e, s in zip(entries, slots):
                    e.slot = s
                    self.members[name][DEVICE][e] = None
                stats[f"{name}:{DEVICE}"] += k
                placed = True
        if not placed and self._room(name, HOST, k, chain):
            for e, i in zip(entries, src_idx):
                e.pending += 1
                self.pending.append((HOST, e, to_host(take_one(src, jnp.int32(i)))))
            stats[f"{name}:{HOST}"] += k
            placed = True
        if self.store is not None and self._room(name, STORE, k, chain):
            for e, i in zip(entries, src_idx):
                data = np.asarray(take_one(src, jnp.int32(i)))
                e.pending += 1
                self.pending.append((STORE, e, self.store.write_entry(ns.hex, spec, e.block, data)))
            stats[f"{name}:{STORE}"] += k
            placed = True
        if not placed:
            for e in entries:
                e.why = "not admitted"
            stats[f"{name}:refused"] += k
            self.metrics.events["not_admitted"] += k

    def _used(self, name: str, tier: str) -> int:
        return len(self.members[name][tier]) + sum(1 for t, e, _ in self.pending if t == tier and e.form == name)

    def _room(self, name: str, tier: str, k: int, chain=frozenset()) -> bool:
        """Make room for `k` more entries of `name` in `tier` (host/store): all or nothing, never from `chain`."""
        cap = self.caps[name][tier]
        if k > cap:
            return False
        over = self._used(name, tier) + k - cap
        return over <= 0 or self._evict(name, tier, over, chain, all_or_nothing=True) > 0

    # ------------------------------------------------------------------------------------------------ eviction
    def _evict(self, name: str, tier: str, k: int, chain=frozenset(), *, all_or_nothing: bool = False) -> int:
        """Evict up to `k` unpinned entries of form `name` from `tier`: lowest priority, least recent, deepest first.

        Entries of Blocks in `chain` (the chain a request is reading or extending) are never taken. Within a chain
        ancestors are never older or of lower priority than descendants, so this order evicts leaves first and no
        entry is left behind an evicted parent. A device entry is demoted to the host when the host admits it.
        With `all_or_nothing`, nothing is evicted unless all `k` can be. Returns how many were evicted.
        """
        cands = [e for e in self.members[name][tier] if e.pins == 0 and e.block not in chain]
        if all_or_nothing and len(cands) < k:
            return 0
        cands.sort(key=lambda e: (e.priority, e.last_access, -e.block.index))
        done = 0
        for e in cands[:k]:
            if tier == DEVICE and e.host is None and not e.pending and self._room(name, HOST, 1, chain):
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

    def _drop(self, e: Entry, tier: str, why: str, delete: bool = True) -> None:
        """Remove `e`'s bytes from `tier` (availability only) and bump its generation; a store entry is deleted from
        the store unless `delete` is False (another format version's entry stays for its own processes)."""
        self.members[e.form][tier].pop(e, None)
        if tier == DEVICE and e.slot is not None:
            self.pools[e.form].release(e.slot)
            e.slot = None
        elif tier == HOST:
            e.host = None
        elif tier == STORE and e.in_store:
            e.in_store = False
            ns_hex = self._ns_of(e)
            if ns_hex is not None and delete:
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
        """Publish copies whose bytes are complete (host: `is_ready()`, store: future done); release abandoned leases."""
        self._reap()
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

    def stats(self, tenant: str | None = None) -> dict:
        """Counters (`entry.Metrics.as_dict`) plus entries per form and tier and the caps.

        Args:
            tenant: a tenant salt: only that tenant's requests (its hits, misses by cause, reuse and re-plans), and
                nothing about the cache's contents or other tenants.
        """
        with self.lock:
            self._reap()
            if tenant is not None:
                m = self.tenant_metrics.get(tenant)
                return (m or Metrics()).as_dict()
            d = self.metrics.as_dict()
            d["entries"] = {n: {t: len(self.members[n][t]) for t in TIERS} for n in self.specs}
            d["caps"] = self.caps
            return d
