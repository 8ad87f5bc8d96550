"""Many long requests on one device: batched drafting, staggered verification, a device-memory budget.

VeriCache (arXiv 2605.17613) pays most when many long requests share a device: their full caches do not fit, their
draft caches do. Each admitted request holds on the device a row of one static-shape draft-cache batch (its
compressed prompt + recent ring) and a small tail (its decoded tokens' exact KV); its prompt's full KV lives in pinned
host memory. One iteration of the scheduler:

1. verify the requests that are due, each through the B = 1 offloaded verify step (`decode.verify.verify_offloaded`)
   on its full cache, fetched beforehand; accepted tokens refresh its draft state (both in `batch_steps.verify_row`);
2. admit waiting requests that fit the budget and a free slot (continuous batching; requests arrive at iterations);
3. start the host->device copies of the full caches of the requests due next (asynchronous `jax.device_put`, at most
   `verify_slots` full caches on the device at once), then dispatch one batched draft call over all slots
   (`batch_steps.draft_slots`, masked: slots waiting, empty or finished do not move). The copies run while the
   drafting does — the overlap VeriCache's staggering is for.

Modes. "staggered": one drafted token per iteration, and each new request's rounds are offset from the others' so
that rounds end at different iterations — about 1/x of the requests verify per iteration (the paper's staggering; the
offset is picked where the fewest other requests are due, by holding the request back a few iterations, or by
shortening its first round: `stagger`). "lockstep": every slot drafts x tokens in one call, then
every request verifies in turn, nothing overlapped: the comparison point.

Exactness. Every request's tokens equal `vericache.reference_decode` of its prompt (greedy; position-keyed sampling
too): verification is the single-request verify step, a partial round pads its drafts with -1 (never accepted), and
the batch only ever drafts.

On the CPU there is no host link: a verify is lent the request's host copy and reads it in place
(`kvjax.decode.offload.lends`; a prefilled request's host cache is copied once at admission, since verifies write
into what they are lent), so there are no copies for staggering to hide, and the lock-step run's own per-phase costs
bound staggering's gain over lock-step (scripts/bench_scheduler.py prints that bound) while the per-iteration
overhead of one-token draft calls costs it (`draft_chunk` drafts k tokens per iteration to amortise it). The schedule
is for accelerators, where drafting reads device memory while the copies use the interconnect.

Budget (`kvjax.scheduling.memory`): admission reserves the request's decoded-token tail; the first admission sizes the slot
batch (static slots of the first request's draft-cache shape) and the verification pool (`verify_slots` full caches
plus one draft row of admission scratch) to fit `budget_bytes`. Requests that do not fit wait.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.arrays import tree_nbytes
from kvjax.cache.capacity import CAPACITY_BUCKETS, pick_capacity
from kvjax.decode import offload as offl
from kvjax.decode import vericache as vc
from kvjax.decode.draft_weights import draft_params
from kvjax.decode.refresh import refresh_step
from kvjax.errors import BudgetError, InputError
from kvjax.scheduling import batch_steps as ss
from kvjax.scheduling.memory import DeviceMemory, device_stats_peak
from kvjax.scheduling.requests import Request, SchedulerResult

MODES = ("staggered", "lockstep")


# An admission sizes a request's parts by tracing the family's split over every layer (SmolLM2: ~20-28 ms a trace, two
# per admission of ~300-500 ms at 8K); the sizes depend on the shapes alone, so each shape is traced once.
@functools.lru_cache(maxsize=64)
def _abstract_parts(family, config, capacity: int, tail_capacity: int, dtype):
    return jax.eval_shape(lambda: family.offload_split(family.init_cache(config, 1, capacity, dtype), tail_capacity))


@functools.lru_cache(maxsize=64)
def _host_part_bytes(family, treedef, shapes) -> int:
    abstract = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes])
    return tree_nbytes(jax.eval_shape(lambda full: family.offload_split(full, 1), abstract)[0])


@dataclasses.dataclass
class _Live:
    """Host-side bookkeeping of one admitted request (arrays: its host full KV and its device tail)."""

    idx: int
    req: Request
    slot: int
    host_kv: object  # the family's offloaded part of the full cache, in pinned host memory
    tail: object  # the family's on-device part (decoded tokens' state, rings)
    length: int  # tokens in the full cache (prompt + emitted - 1)
    prompt_len: int
    tail_bytes: int
    out: list
    since_refresh: tuple = (0, 0)  # (verifications, drafted tokens) since a refreshing draft last re-selected

    @property
    def need(self) -> int:
        return self.req.max_new_tokens - len(self.out)


class VeriCacheScheduler:
    """Runs many requests with VeriCache under a device-memory budget (see the module docstring).

    Args:
        model: a `kvjax.Model` of any family with offload and draft caches.
        budget_bytes: device bytes for per-request state (weights excluded).
        compressor: a draft maker or one of `model.family.compressors`; compressor_kw its fields.
        draft_len: x, drafts per round (static).
        mode: "staggered" or "lockstep".
        stagger: how a new request's rounds are offset in staggered mode: "delay" (hold it back up to x - 1
            iterations) or "shorten" (a shorter first round: one extra verification).
        draft_chunk: tokens each slot drafts per staggered iteration (1 = the paper's schedule; k > 1 verifies
            ~k/x of the requests per iteration, with k times fewer iterations and so less per-iteration overhead).
        max_slots: upper bound on the draft-batch slots (the budget may allow fewer).
        verify_slots: full caches allowed on the device at once (being fetched or verified).
        recent_slots: draft ring slots for decoded tokens (default max_new + x + 2, at least 64).
        tail_capacity: slots of each request's decoded-token tail (default: the bucket for max_new + x + 2); fixing
            it (and recent_slots) lets a short warm-up run compile the shapes of a long one.
        temperature: 0 = greedy, > 0 = position-keyed sampling (exact in the same sense).
        slot_prompt_len: size the draft slots for prompts up to this length (a server's context), instead of for the
            first admitted request's prompt; give `recent_slots` too, so every request's ring fits the slots.
    """

    def __init__(self, model, *, budget_bytes: int, compressor=None,
                 compressor_kw: dict | None = None, draft_len: int = 8, mode: str = "staggered", stagger: str = "delay",
                 draft_chunk: int = 1, max_slots: int = 16, verify_slots: int = 1, recent_slots: int | None = None,
                 tail_capacity: int | None = None, temperature: float = 0.0, slot_prompt_len: int | None = None):
        if mode not in MODES:
            raise InputError(f"mode must be one of {MODES}, got {mode!r}")
        if stagger not in ("delay", "shorten"):
            raise InputError(f"stagger must be 'delay' or 'shorten', got {stagger!r}")
        if verify_slots < 1 or max_slots < 1:
            raise InputError(f"verify_slots and max_slots must be >= 1, got {verify_slots}, {max_slots}")
        vc.check_draft_len(model, draft_len)
        for field in ("offload_split", "draft_split"):
            model.family.require(field, "the VeriCache scheduler")
        self.model = model
        self.budget = int(budget_bytes)
        self.comp = model.family.make_compressor(compressor, model=model, **(compressor_kw or {}))
        # what drafting reads: the model's weights, or their bf16 copy (`kvjax.decode.draft_weights`)
        self.draft_params = draft_params(model, self.comp.draft_weights)
        self.x = draft_len
        self.mode = mode
        self.stagger = stagger
        if not 1 <= draft_chunk <= draft_len:
            raise InputError(f"draft_chunk must be in 1..draft_len={draft_len}, got {draft_chunk}")
        self.chunk = draft_chunk if mode == "staggered" else draft_len
        self.max_slots = max_slots
        self.verify_slots = verify_slots
        self.recent_slots = recent_slots
        self.tail_capacity = tail_capacity
        self.temperature = temperature
        self.slot_prompt_len = slot_prompt_len

    # ------------------------------------------------------------ run

    def run(self, requests: list[Request]) -> SchedulerResult:
        """Decode every request; returns outputs in request order plus measurements.

        The same step-wise mechanism a server drives (`start`, `submit`, `step`), run until every request is done."""
        if not requests:
            raise ValueError("no requests")
        self.start()
        for r in requests:
            self.submit(r)
        t0 = time.perf_counter()
        while self.busy:
            self.step()
        wall = time.perf_counter() - t0
        return SchedulerResult(
            name=f"vericache-{self.mode}", outputs={i: np.asarray(o[:requests[i].max_new_tokens], np.int32)
                                                    for i, o in self.done.items()},
            wall_s=wall, tokens=self.emitted, budget_bytes=self.budget, peak_measured_bytes=self.mem.peak_measured,
            peak_reserved_bytes=self.mem.peak_reserved, device_peak_bytes=device_stats_peak(),
            timeline=self.mem.timeline, stats=self.summary())

    def summary(self) -> dict:
        """Per-phase times and counts so far (`SchedulerResult.stats`)."""
        self.stats.update(iterations=self.it, slots=self.n_slots, mode=self.mode, draft_len=self.x,
                          draft_chunk=self.chunk, compressor=getattr(self.comp, "name", type(self.comp).__name__),
                          verify_slots=self.verify_slots,
                          mean_accepted_per_round=float(np.mean(self.accepted)) if self.accepted else 0.0,
                          verifications=len(self.accepted), row_bytes=self.row_bytes, full_bytes=self.pool_full,
                          verifies_per_iteration=list(self.verifies_per_iteration))
        return self.stats

    # ------------------------------------------------------------ step-wise API (one mechanism for run and servers)

    def start(self, *, memory: DeviceMemory | None = None, expected: int = 0) -> None:
        """Begin an empty run: requests are then `submit`ted and decoded by `step` calls.

        Args:
            memory: the budget accounting to reserve from (default: a new `DeviceMemory(budget_bytes)`); a server
                shares one between schedulers.
            expected: requests the slot batch should be sized for beyond those queued at the first admission (a
                server passes max_slots: more requests will come).
        """
        self._reset([])
        if memory is not None:
            self.mem = memory
        self.expected = expected

    @property
    def busy(self) -> bool:
        """Requests are queued or decoding."""
        return bool(self.queue or self.live)

    def submit(self, req: Request) -> int:
        """Queue a request; returns its id (the index `run` reports it under)."""
        idx = self._next_id
        self._next_id += 1
        self.queue.append((idx, req))
        self.queue.sort(key=lambda p: (p[1].arrival, p[0]))
        return idx

    def step(self) -> list[tuple[int, list[int], bool]]:
        """One scheduler iteration. Returns (request id, tokens emitted since the last step, finished) for every
        request that emitted tokens or finished — tokens are reported only once their round is verified."""
        if not self.live and self.queue and self.queue[0][1].arrival > self.it:
            self.it = self.queue[0][1].arrival  # idle until the next arrival
        if self.mode == "staggered":
            self._iteration_staggered(self.it)
        else:
            self._iteration_lockstep(self.it)
        self.it += 1
        return self._collect()

    def cancel(self, idx: int) -> bool:
        """Drop a queued or running request and free what it holds (its slot, tail, pending full-cache copy).
        Returns whether it was found."""
        for j, (i, _) in enumerate(self.queue):
            if i == idx:
                del self.queue[j]
                return True
        for s, r in list(self.live.items()):
            if r.idx == idx:
                self.inflight.pop(s, None)
                self._finish(s)
                self.done.pop(idx, None)
                self._sent.pop(idx, None)
                self._fresh_done.remove(idx)
                return True
        return False

    def close(self) -> None:
        """Release every reservation this scheduler holds (its slot batch and verification pool) and its arrays."""
        for s in list(self.live):
            self.cancel(self.live[s].idx)
        self.mem.release(self._held)
        self._held = 0
        self.batch = self.drafts = None
        self.queue, self.inflight = [], {}

    def _reset(self, requests):
        self.queue = sorted(enumerate(requests), key=lambda p: (p[1].arrival, p[0]))
        self.live: dict[int, _Live] = {}  # slot -> request
        self.done: dict[int, list] = {}
        self.inflight: dict[int, tuple] = {}  # slot -> fetched full KV (device)
        self.mem = DeviceMemory(self.budget)
        self.batch = None
        self.n_slots = 0
        self.row_bytes = 0
        self.pool_full = 0
        self.accepted: list[int] = []
        self.verifies_per_iteration: list[int] = []
        self.emitted = 0
        self.stats = dict(draft_s=0.0, draft_calls=0, draft_steps=0, fetch_s=0.0, verify_s=0.0, admit_s=0.0,
                          admissions=0)
        self.it = 0
        self.expected = 0
        self._next_id = len(self.queue)
        self._sent: dict[int, int] = {}  # request id -> tokens already reported by `step`
        self._fresh_done: list[int] = []  # finished since the last `step`
        self._max_new: dict[int, int] = {}
        self._held = 0  # bytes reserved for the batch and pool (released by `close`)

    def _collect(self) -> list[tuple[int, list[int], bool]]:
        events = []
        for r in self.live.values():
            k = self._sent.get(r.idx, 0)
            if len(r.out) > k:
                events.append((r.idx, r.out[k:], False))
                self._sent[r.idx] = len(r.out)
        for idx in list(self._fresh_done):
            out = self.done[idx][: self._max_new[idx]]
            k = self._sent.pop(idx, 0)
            events.append((idx, out[k:], True))
        self._fresh_done = []
        return events

    # ------------------------------------------------------------ iterations

    def _iteration_staggered(self, it: int) -> None:
        self._verify_due()
        self._admit(it)
        if not self.live:
            return
        upcoming = [s for s in self._order() if self._remaining(s) <= 1]
        self._prefetch(upcoming)
        t = time.perf_counter()
        self._draft(steps=self.chunk)  # allocates nothing new (donated)
        self.hold = np.maximum(self.hold - 1, 0).astype(np.int32)
        self.stats["draft_s"] += time.perf_counter() - t  # dispatch only: the drafting overlaps the copies

    def _iteration_lockstep(self, it: int) -> None:
        self._admit(it)
        if not self.live:
            return
        t = time.perf_counter()
        self._draft(steps=self.x)
        jax.block_until_ready(self.drafts)
        self.stats["draft_s"] += time.perf_counter() - t
        self.mem.sample(self.emitted)
        self._verify_due(blocking_fetch=True)

    def _order(self) -> list[int]:
        """Occupied slots, soonest due first."""
        return sorted(self.live, key=lambda s: (self._remaining(s), s))

    def _remaining(self, s: int) -> int:
        """Iterations until slot s is due for verification (0 = due now)."""
        return int(self.hold[s] + -(-max(self.limit[s] - self.count[s], 0) // self.chunk))

    # ------------------------------------------------------------ drafting

    def _draft(self, steps: int) -> None:
        limit = np.where(self.hold > 0, self.count, self.limit).astype(np.int32)  # held slots wait
        if not any(self.count[s] < limit[s] for s in self.live):
            return
        b, d = self.batch, self.drafts
        # small per-call arrays go in as numpy: jit transfers them with its arguments (a jnp.asarray each would be
        # one more dispatch, a measurable share of a one-token draft iteration). Copies: on the CPU a numpy argument
        # may be used in place, and these host arrays are updated while the call may still be running.
        self.batch, self.drafts, _ = ss.draft_slots(
            self.draft_params, self.model.config, b, self.last.copy(), d, self.count.copy(),
            limit, self.seeds.copy(), steps=steps, temperature=self.temperature, family=self.model.family,
            impl=self.model.attention)
        moving = self.count < limit
        self.count = np.where(moving, np.minimum(self.count + steps, limit), self.count).astype(np.int32)
        self.stats["draft_calls"] += 1
        self.stats["draft_steps"] += steps

    # ------------------------------------------------------------ verification

    def _prefetch(self, slots, busy: int = 0) -> None:
        """Start host->device copies of the next full caches, at most `verify_slots` on the device at once
        (`busy` = full caches already on the device outside `inflight`, i.e. being verified); on the CPU a host copy
        is lent instead (`offload.lends`)."""
        issued = False
        for s in slots:
            if len(self.inflight) + busy >= self.verify_slots:
                break
            r = self.live[s]
            if s not in self.inflight and r.host_kv is not None:
                if offl.lends(r.host_kv):  # (the CPU) the verify reads the host copy itself and hands it back
                    self.inflight[s], r.host_kv = r.host_kv, None
                    continue
                self.inflight[s] = offl.fetch(r.host_kv)
                issued = True
        if issued:  # (sampling walks every live array: only when the device memory grew)
            self.mem.sample(self.emitted)

    def _verify_due(self, blocking_fetch: bool = False) -> None:
        """Verify every due slot. A verification that reads a lent host copy (`offload.lends`: the CPU) holds no
        device memory of its own, so the next one is dispatched before this one's result is read: the host's
        bookkeeping and the next call's dispatch overlap the verifications instead of running between them
        (measured, the bundled model's 8 x 16K lock-step run, 5 alternated runs each in one process: wall 0.92x,
        verification phase 0.90x). Their order, and so every bit, is unchanged: each reads the draft batch the
        previous one wrote. A fetched copy (an accelerator) is one of `verify_slots`, so its result is read, and its
        copy freed, before the next fetch."""
        due = [s for s in self._order() if self._remaining(s) == 0]
        self.verifies_per_iteration.append(len(due))
        due.sort(key=lambda s: (s not in self.inflight, s))  # prefetched ones first
        t0, fetch0, pending = time.perf_counter(), self.stats["fetch_s"], []
        for i, s in enumerate(due):
            if s not in self.inflight:
                self._prefetch([s])
            fetched = self.inflight.pop(s)
            lent = offl.lends(fetched)
            if blocking_fetch and not lent:
                t = time.perf_counter()
                jax.block_until_ready(fetched)
                self.stats["fetch_s"] += time.perf_counter() - t
            elif not blocking_fetch:
                # the next due request's copy goes out while this one verifies (if a verify slot is free)
                self._prefetch(due[i + 1:], busy=1)
            pending.append((s, self._dispatch_verify(s, fetched)))
            del fetched
            if not lent:
                self._collect_verify(*pending.pop())
        for s, out in pending:
            self._collect_verify(s, out)
        self.stats["verify_s"] += time.perf_counter() - t0 - (self.stats["fetch_s"] - fetch0)
        self.mem.sample(self.emitted)

    def _dispatch_verify(self, s: int, fetched) -> tuple:
        """Slot s's verification (and re-selection, when due) dispatched; returns (emitted, n) to collect."""
        r = self.live[s]
        cfg, params = self.model.config, self.model.verify_params()
        fam = self.model.family
        # the slot's row verified and its accepted tokens written back into the batch, in one call
        emitted, n, tail, self.batch, row, aux, scratch = ss.verify_row(
            params, cfg, fetched, r.tail, np.asarray([r.length], np.int32), np.asarray([r.prompt_len], np.int32),
            self.batch, self.drafts, self.count.copy(), np.int32(s), self.last[s:s + 1].copy(), self.qdummy,
            self.seeds[s:s + 1].copy(), temperature=self.temperature, family=fam, impl=self.model.attention)
        spec = getattr(self.batch, "refresh", None)
        reselect = False
        if spec is not None:
            reselect, r.since_refresh = spec.after_verify(r.since_refresh, self.x)
        if reselect:
            # re-select from the full cache just fetched for the verification (no extra transfer): only the prompt
            # parts change (`refresh_draft`), and the row's changing state is in the batch already
            row = refresh_step(row, scratch, aux, family=fam)
            self.batch = ss.put_parts(self.batch, row, np.int32(s), family=fam)
        del row
        if r.host_kv is None:  # lent (`offload.lends`): the verify hands the host copy back
            r.host_kv = offl.take_back(fam, scratch)
        r.tail = tail
        return emitted, n

    def _collect_verify(self, s: int, out: tuple) -> None:
        """Slot s's verified tokens read back (waiting for its verification) and booked."""
        emitted, n = out
        r = self.live[s]
        n_host = int(np.asarray(n)[0])  # waits for the verification: its full-cache slot is free after this
        new = np.asarray(emitted)[0, :n_host + 1]  # on the host: a device slice compiles per length
        r.length += n_host + 1
        r.out.extend(int(t) for t in new)
        self.emitted += len(new)
        self.accepted.append(n_host)
        self.last[s] = int(new[-1])
        self.count[s] = 0
        if r.need <= 0:
            self._finish(s)
        else:
            # a last round shorter than x ends off-phase; shortening it further to dodge other requests' rounds
            # would cost a whole extra verification, more than a collision does
            self.limit[s] = min(self.x, r.need - 1)

    def _finish(self, s: int) -> None:
        r = self.live.pop(s)
        self.done[r.idx] = r.out
        self._fresh_done.append(r.idx)
        self._max_new[r.idx] = r.req.max_new_tokens
        self.emitted -= max(len(r.out) - r.req.max_new_tokens, 0)  # the last round may overshoot; not emitted
        self.mem.release(r.tail_bytes)
        r.tail = r.host_kv = None
        self.count[s] = self.limit[s] = self.hold[s] = 0

    # ------------------------------------------------------------ admission

    def _admit(self, it: int) -> None:
        """Admit arrived requests while a slot and the budget allow (the verify pool is free here)."""
        while self.queue and self.queue[0][1].arrival <= it:
            idx, req = self.queue[0]
            if self.batch is not None and len(self.live) >= self.n_slots:
                return
            if not self._admit_one(idx, req):
                if not self.live:
                    raise BudgetError(f"request {idx} cannot fit the device budget {self.budget} even alone")
                return
            self.queue.pop(0)

    def _parts_abstract(self, req):
        """Abstract (host part, device tail) of a request's offloaded full cache: shapes only, nothing allocated."""
        cap = vc.capacity_for(len(req.prompt), req.max_new_tokens, self.x)
        return _abstract_parts(self.model.family, self.model.config, cap, self._tail_cap(req), self.model.cache_dtype)

    def _full_bytes(self, req) -> int:
        if req.prefilled is not None:
            full = req.prefilled[0]
            shapes = tuple((a.shape, a.dtype) for a in jax.tree.leaves(full))
            return _host_part_bytes(self.model.family, jax.tree.structure(full), shapes)
        return tree_nbytes(self._parts_abstract(req)[0])

    def _tail_cap(self, req) -> int:
        need = req.max_new_tokens + self.x + 2
        if self.tail_capacity is not None:
            if self.tail_capacity < need:
                raise ValueError(f"tail_capacity {self.tail_capacity} < {need} (max_new_tokens + x + 2)")
            return self.tail_capacity
        return pick_capacity(need, CAPACITY_BUCKETS)

    def _admit_one(self, idx: int, req: Request) -> bool:
        t0 = time.perf_counter()
        cfg = self.model.config
        F = self._full_bytes(req)
        if self.batch is not None:
            grow = self.verify_slots * max(F - self.pool_full, 0)
            if not self.mem.fits(grow + self._tail_bytes_estimate(req)):
                return False
            if grow:
                self.mem.reserve(grow, "verification pool")
                self._held += grow
                self.pool_full = F
        elif not self.mem.fits(F):
            raise BudgetError(f"one full cache ({F} bytes, the verification slot) exceeds the budget {self.budget}")
        if req.max_new_tokens < 1:
            raise ValueError(f"request {idx}: max_new_tokens must be >= 1")

        # full cache on the device (it occupies the verification slot), compressed into a draft row
        prompt = np.asarray(req.prompt, np.int32).reshape(-1)
        masses = req.prompt_masses
        if req.prefilled is not None:
            full, first = req.prefilled
            # compressed where it lies if the drafter reads lent host memory (the CPU), else from a device copy
            if not (offl.lends(full) and getattr(self.comp, "reads_host_memory", False)):
                full = offl.fetch(full)
        else:
            # the drafter's prompt scores from the prefill's own attention where it scores that way (no second pass)
            full, first, *scored = vc.prefill_for(self.model, prompt, req.max_new_tokens, max_draft=self.x,
                                                  temperature=self.temperature, seed=req.seed,
                                                  scoring=self.comp.prompt_scoring)
            masses = scored[0] if scored else None
            # committed to the device like a fetched prefix (no copy: it is there already): jit keys on
            # committedness, and every state derived from `full` must reach the steps as one kind of argument
            full = offl.fetch(full)
        R = self.recent_slots or max(64, req.max_new_tokens + self.x + 2)
        row = self.comp(self.model.params, cfg, full, prompt, recent_slots=max(R, self.x + 1),
                        **vc.scored(self.comp, masses))
        self.mem.sample(self.emitted)
        host_part, tail = self.model.family.offload_split(full, self._tail_cap(req))
        tail_bytes = tree_nbytes(tail)
        if self.batch is None:
            self._make_batch(self._slot_shape(row, prompt.size, R), F, tail_bytes, n_requests=max(len(self.queue), self.expected))
        if not self.mem.fits(tail_bytes):
            return False  # (only reachable for later admissions; their full cache copy is dropped below)
        self.mem.reserve(tail_bytes, f"request {idx} tail")
        if req.prefilled is not None:
            host_kv = self.model.family.offload_split(req.prefilled[0], 1)[0]  # already in host memory
            if offl.lends(host_kv) and not req.own_prefilled:  # verifies write into it: not the caller's
                host_kv = offl.to_host(host_kv, copy=True)
        else:
            host_kv = offl.to_host(host_part)
        del host_part
        prompt_len = int(full.length[0])
        del full
        s = next(i for i in range(self.n_slots) if i not in self.live)
        if getattr(row, "refresh", None) is not None:  # one static refresh shape per batch: the slots'
            row = dataclasses.replace(row, refresh=self.batch.refresh)
        self.batch = ss.put_slot_row(self.batch, ss.pad_row(row, self.batch), np.int32(s))
        del row
        r = _Live(idx=idx, req=req, slot=s, host_kv=host_kv, tail=tail, length=prompt_len, prompt_len=prompt_len,
                  tail_bytes=tail_bytes, out=[int(np.asarray(first)[0])])
        self.live[s] = r
        self.emitted += 1
        self.last[s] = r.out[0]
        self.seeds[s] = req.seed
        self.count[s] = 0
        if r.need <= 0:
            self._finish(s)
        else:
            self.limit[s] = min(self.x, r.need - 1)
            if self.mode == "staggered":
                self._stagger_start(s)
        jax.block_until_ready(self.batch)
        self.mem.sample(self.emitted)
        self.stats["admit_s"] += time.perf_counter() - t0
        self.stats["admissions"] += 1
        return True

    def _slot_shape(self, row, prompt_len: int, R: int):
        """A draft row shaped for the longest prompt the slots must hold (`slot_prompt_len`), else `row` itself:
        a server sizes its slots once for its context, so later, longer prompts still pad into them."""
        L = self.slot_prompt_len
        if L is None or L <= prompt_len:
            return row
        fam, cfg = self.model.family, self.model.config
        shape_full = fam.init_cache(cfg, 1, vc.capacity_for(L, 1, self.x), self.model.cache_dtype)
        shape_full = dataclasses.replace(shape_full, length=jnp.full((1,), L, jnp.int32))
        return self.comp(self.model.params, cfg, shape_full, np.zeros((L,), np.int32), recent_slots=max(R, self.x + 1))

    def _tail_bytes_estimate(self, req) -> int:
        return tree_nbytes(self._parts_abstract(req)[1])

    def _make_batch(self, row, F: int, tail_bytes: int, n_requests: int) -> None:
        """Size and allocate the slot batch and the verification pool from the first request's shapes."""
        self.row_bytes = tree_nbytes(row)
        self.pool_full = F
        pool = self.verify_slots * F + self.row_bytes  # + one draft row of admission scratch
        n = (self.mem.budget - self.mem.reserved - pool) // (self.row_bytes + tail_bytes)
        n = int(min(n, self.max_slots, max(n_requests, 1)))
        if n < 1:
            raise BudgetError(f"budget {self.budget} bytes cannot hold {self.verify_slots} verification slot(s) of "
                              f"{F} bytes + admission scratch {self.row_bytes} + one draft row {self.row_bytes} "
                              f"+ tail {tail_bytes}")
        self.n_slots = n
        self.mem.reserve(pool + n * self.row_bytes, "verification pool and draft slots")
        self._held += pool + n * self.row_bytes
        self.batch = ss.empty_slots(row, n)
        self.drafts = jnp.zeros((n, self.x), jnp.int32)
        self.last = np.zeros((n,), np.int32)
        self.seeds = np.zeros((n,), np.int32)
        self.count = np.zeros((n,), np.int32)
        self.limit = np.zeros((n,), np.int32)
        self.hold = np.zeros((n,), np.int32)  # staggered "delay": iterations a new request waits before drafting
        self.qdummy = jnp.zeros((1, 1, self.model.config.vocab_size), jnp.float32)

    def _stagger_start(self, s: int) -> None:
        """Offset a new request's rounds from the others': its first verification lands on the iteration (within the
        next x) where the fewest other requests verify. "delay" holds it back a few iterations (its slot drafts
        nothing meanwhile; no extra verification); "shorten" makes its first round shorter (an extra verification,
        no waiting)."""
        L = int(self.limit[s])
        if L <= 1:
            return
        k = self.chunk
        period = -(-self.x // k)  # iterations per full round
        load = np.zeros(2 * period + 2, np.int64)
        for o in self.live:
            if o != s:
                load[min(self._remaining(o), 2 * period + 1)] += 1
        if self.stagger == "shorten":
            cand = np.arange(1, L + 1)  # first-round length
            self.limit[s] = int(cand[np.lexsort((-cand, load[-(-cand // k)]))[0]])
        else:
            cand = np.arange(0, period)  # iterations held
            self.hold[s] = int(cand[np.lexsort((cand, load[cand + -(-L // k)]))[0]])
