"""Full-cache batched decoding under the same device-memory budget: the baseline the VeriCache scheduler is against.

As many requests as the budget holds decode together, each in a slot of one batched full cache (static slots, one
capacity bucket), with the plain one-token forward (`batch_steps.full_batch_step`, the fastest full-cache
decoder; it may differ from the verify-shape reference in the last float bits, so its identity is measured, not
assumed). Continuous batching: a finished request's slot is refilled from the queue. Prefilled requests (host-resident
full caches) are copied into their slot one layer at a time, so admission needs only one layer of scratch; requests
without a prefill are prefilled on the device, which needs one whole full cache of scratch.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.arrays import tree_nbytes
from kvjax.decode import offload as offl
from kvjax.decode import vericache as vc
from kvjax.scheduling import batch_steps as ss
from kvjax.scheduling.requests import Request, SchedulerResult
from kvjax.errors import BudgetError
from kvjax.scheduling.memory import DeviceMemory, device_stats_peak


class FullCacheScheduler:
    """Batched full-cache decoding of many requests within `budget_bytes` (weights excluded).

    Args:
        model: a `kvjax.Model` of any family.
        budget_bytes: device bytes for the batched full cache plus admission scratch.
        draft_len: only sets the cache capacity (`vericache.capacity_for`), so the caches match VeriCache's.
        max_slots: upper bound on the batch.
    """

    def __init__(self, model, *, budget_bytes: int, draft_len: int = 8, max_slots: int = 64,
                 temperature: float = 0.0):
        self.model = model
        self.temperature = temperature
        self.budget = int(budget_bytes)
        self.x = draft_len
        self.max_slots = max_slots

    def slots_for(self, requests: list[Request]) -> tuple[int, int, int, int]:
        """(slots, capacity, bytes per slot, admission scratch bytes) the budget allows for these requests."""
        cfg = self.model.config
        caps = {vc.capacity_for(len(r.prompt), r.max_new_tokens, self.x) for r in requests}
        if len(caps) != 1 and any(r.prefilled is not None for r in requests):
            raise ValueError(f"prefilled requests must share one capacity bucket, got {sorted(caps)}")
        cap = max(caps)  # ragged prompts share the largest bucket (a shorter row leaves its tail slots empty)
        fam, dtype = self.model.family, self.model.cache_dtype
        one = jax.eval_shape(lambda: fam.init_cache(cfg, 1, cap, dtype))
        # a slot is its layers plus the small per-slot vectors that live next to them on the device (its length, the
        # step's next token, the admitted first token: i32 each) — measured peaks counted them, the budget did not
        per = tree_nbytes(one.layers) + 3 * tree_nbytes(one.length)
        scratch = max(tree_nbytes(l) for l in one.layers)
        if any(r.prefilled is None for r in requests):
            scratch = per  # a device prefill holds a whole full cache
        n = (self.budget - scratch) // per
        n = int(min(n, self.max_slots, len(requests)))
        if n < 1:
            raise BudgetError(f"budget {self.budget} bytes cannot hold one full cache of {per} bytes "
                              f"+ admission scratch {scratch}")
        return n, cap, per, scratch

    def run(self, requests: list[Request]) -> SchedulerResult:
        """Decode every request; returns outputs in request order plus measurements.

        The same step-wise mechanism a server drives (`start`, `submit`, `step`), run until every request is done."""
        n, cap, per, scratch = self.slots_for(requests)
        t0 = time.perf_counter()
        self.start(slots=n, capacity=cap, prefilled_only=all(r.prefilled is not None for r in requests))
        for r in requests:
            self.submit(r)
        while self.busy:
            self.step()
        wall = time.perf_counter() - t0
        mem = self.mem
        self.close()
        return SchedulerResult(
            name="full", outputs={i: np.asarray(o, np.int32) for i, o in self.done.items()}, wall_s=wall,
            tokens=self.emitted, budget_bytes=self.budget, peak_measured_bytes=mem.peak_measured,
            peak_reserved_bytes=mem.peak_reserved, device_peak_bytes=device_stats_peak(), timeline=mem.timeline,
            stats=self.summary())

    def summary(self) -> dict:
        """Counts and times so far (`SchedulerResult.stats`)."""
        return dict(slots=self.n, steps=self.steps, iterations=self.it, admit_s=self.admit_s, full_bytes=self.per)

    # ------------------------------------------------------------ step-wise API (one mechanism for run and servers)

    def start(self, *, slots: int | None = None, capacity: int, prefilled_only: bool = False,
              memory: DeviceMemory | None = None) -> None:
        """Allocate the slot batch for an empty run: requests are then `submit`ted and decoded by `step` calls.

        Args:
            slots: batch size (default: as many as the budget left in `memory` holds, at most max_slots).
            capacity: cache capacity of every slot (requests with a larger `vericache.capacity_for` are refused).
            prefilled_only: every request comes prefilled (admission scratch is one layer, not a whole cache).
            memory: the budget accounting to reserve from (default: a new `DeviceMemory(budget_bytes)`).

        Raises:
            BudgetError: not even one slot fits.
        """
        cfg, fam = self.model.config, self.model.family
        self.mem = memory if memory is not None else DeviceMemory(self.budget)
        one = jax.eval_shape(lambda: fam.init_cache(cfg, 1, capacity, self.model.cache_dtype))
        per = tree_nbytes(one.layers) + 3 * tree_nbytes(one.length)
        scratch = max(tree_nbytes(l) for l in one.layers) if prefilled_only else per
        room = (self.mem.budget - self.mem.reserved - scratch) // per
        n = int(min(room, self.max_slots) if slots is None else min(slots, room))
        if n < 1:
            raise BudgetError(f"budget {self.mem.budget} bytes ({self.mem.reserved} reserved) cannot hold one full "
                              f"cache of {per} bytes + admission scratch {scratch}")
        self.n, self.cap, self.per = n, capacity, per
        self._held = n * per + scratch
        self.mem.reserve(self._held, "full-cache batch and admission scratch")
        self.cache = fam.init_cache(cfg, n, capacity, self.model.cache_dtype)
        self.queue: list[tuple[int, Request]] = []
        self.live: dict[int, tuple[int, Request, list]] = {}
        self.done: dict[int, list] = {}
        self.tok = np.zeros((n,), np.int32)
        self.active = np.zeros((n,), np.int32)
        self.seeds = np.zeros((n,), np.int32)
        self.emitted = self.it = self.steps = 0
        self.admit_s = 0.0
        self._next_id = 0
        self._sent: dict[int, int] = {}
        self._fresh_done: list[int] = []
        self.mem.sample(self.emitted)

    @property
    def busy(self) -> bool:
        """Requests are queued or decoding."""
        return bool(self.queue or self.live)

    def submit(self, req: Request) -> int:
        """Queue a request; returns its id (the index `run` reports it under)."""
        cap = vc.capacity_for(len(req.prompt), req.max_new_tokens, self.x)
        if cap > self.cap:
            raise BudgetError(f"request needs a cache of capacity {cap}, the slots hold {self.cap}")
        idx = self._next_id
        self._next_id += 1
        self.queue.append((idx, req))
        self.queue.sort(key=lambda p: (p[1].arrival, p[0]))
        return idx

    def cancel(self, idx: int) -> bool:
        """Drop a queued or running request (its slot is free for the next admission). Returns whether it was found."""
        for j, (i, _) in enumerate(self.queue):
            if i == idx:
                del self.queue[j]
                return True
        for s, (i, _, _) in list(self.live.items()):
            if i == idx:
                del self.live[s]
                self.active[s] = 0
                self._sent.pop(idx, None)
                return True
        return False

    def close(self) -> None:
        """Free the slot batch and release its reservation."""
        self.mem.release(self._held)
        self._held = 0
        self.cache = None
        self.queue, self.live = [], {}

    def step(self) -> list[tuple[int, list[int], bool]]:
        """Admit what fits, then one batched decode step. Returns (request id, new tokens, finished) for every
        request that emitted tokens or finished."""
        params, cfg, n = self.model.params, self.model.config, self.n
        if not self.live and self.queue and self.queue[0][1].arrival > self.it:
            self.it = self.queue[0][1].arrival
        while self.queue and self.queue[0][1].arrival <= self.it and len(self.live) < n:
            ta = time.perf_counter()
            idx, req = self.queue.pop(0)
            s = next(i for i in range(n) if i not in self.live)
            self.cache, first = self._admit(self.cache, req, s, self.mem, self.emitted)
            self.live[s] = (idx, req, [int(np.asarray(first)[0])])
            self.emitted += 1
            self.tok[s], self.active[s], self.seeds[s] = self.live[s][2][0], 1, req.seed
            if req.max_new_tokens <= 1:
                self._done(s)
            self.admit_s += time.perf_counter() - ta
        if self.live:
            nxt, self.cache = ss.full_batch_step(params, cfg, self.cache, self.tok.copy(), self.active.copy(),
                                                 self.seeds.copy(), temperature=self.temperature,
                                                 family=self.model.family, impl=self.model.attention)
            self.mem.sample(self.emitted)
            nxt = np.asarray(nxt)
            self.steps += 1
            for s in list(self.live):
                idx, req, out = self.live[s]
                out.append(int(nxt[s]))
                self.emitted += 1
                self.tok[s] = nxt[s]
                if len(out) >= req.max_new_tokens:
                    self._done(s)
        self.it += 1
        events = []
        for idx, _, out in self.live.values():
            k = self._sent.get(idx, 0)
            if len(out) > k:
                events.append((idx, out[k:], False))
                self._sent[idx] = len(out)
        for idx in self._fresh_done:
            events.append((idx, self.done[idx][self._sent.pop(idx, 0):], True))
        self._fresh_done = []
        return events

    def _done(self, s: int) -> None:
        idx, _, out = self.live.pop(s)
        self.done[idx] = out
        self._fresh_done.append(idx)
        self.active[s] = 0

    def _admit(self, cache, req: Request, s: int, mem: DeviceMemory, emitted: int):
        """Write a request's prefilled full cache into slot `s`, layer by layer (or prefill it on the device)."""
        slot = np.int32(s)
        if req.prefilled is not None:
            full, first = req.prefilled
        else:
            full, first = vc.prefill_for(self.model, req.prompt, req.max_new_tokens, max_draft=self.x,
                                         temperature=self.temperature, seed=req.seed)
        layers = list(cache.layers)
        for i, l in enumerate(full.layers):
            row = offl.fetch(l) if req.prefilled is not None else l  # one layer from host memory
            mem.sample(emitted)
            layers[i] = ss.put_layer_row(layers[i], row, slot)
            jax.block_until_ready(layers[i])  # one layer of scratch at a time
            del row
        length = ss.put_layer_row(cache.length, jnp.asarray(np.asarray(full.length)), slot)
        del full
        cache = dataclasses.replace(cache, layers=tuple(layers), length=length)
        jax.block_until_ready(cache)
        mem.sample(emitted)
        return cache, first
