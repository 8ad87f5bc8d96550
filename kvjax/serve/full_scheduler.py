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
from kvjax.serve import batch_steps as ss
from kvjax.serve.requests import Request, SchedulerResult
from kvjax.errors import BudgetError
from kvjax.serve.memory import DeviceMemory, device_stats_peak


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
        """Decode every request; returns outputs in request order plus measurements."""
        params, cfg = self.model.params, self.model.config
        n, cap, per, scratch = self.slots_for(requests)
        mem = DeviceMemory(self.budget)
        t0 = time.perf_counter()
        mem.reserve(n * per + scratch, "full-cache batch and admission scratch")
        cache = self.model.family.init_cache(cfg, n, cap, self.model.cache_dtype)
        queue = sorted(enumerate(requests), key=lambda p: (p[1].arrival, p[0]))
        live: dict[int, tuple[int, Request, list]] = {}
        done: dict[int, list] = {}
        tok = np.zeros((n,), np.int32)
        active = np.zeros((n,), np.int32)
        seeds = np.zeros((n,), np.int32)
        emitted, it, steps, admit_s = 0, 0, 0, 0.0
        mem.sample(emitted)
        while queue or live:
            if not live and queue and queue[0][1].arrival > it:
                it = queue[0][1].arrival
            while queue and queue[0][1].arrival <= it and len(live) < n:
                ta = time.perf_counter()
                idx, req = queue.pop(0)
                s = next(i for i in range(n) if i not in live)
                cache, first = self._admit(cache, req, s, mem, emitted)
                live[s] = (idx, req, [int(np.asarray(first)[0])])
                emitted += 1
                tok[s], active[s], seeds[s] = live[s][2][0], 1, req.seed
                if req.max_new_tokens <= 1:
                    done[idx] = live.pop(s)[2]
                    active[s] = 0
                admit_s += time.perf_counter() - ta
            if live:
                nxt, cache = ss.full_batch_step(params, cfg, cache, tok.copy(), active.copy(), seeds.copy(),
                                                temperature=self.temperature, family=self.model.family,
                                                impl=self.model.attention)
                mem.sample(emitted)
                nxt = np.asarray(nxt)
                steps += 1
                for s in list(live):
                    idx, req, out = live[s]
                    out.append(int(nxt[s]))
                    emitted += 1
                    tok[s] = nxt[s]
                    if len(out) >= req.max_new_tokens:
                        done[idx] = live.pop(s)[2]
                        active[s] = 0
            it += 1
        wall = time.perf_counter() - t0
        del cache
        return SchedulerResult(
            name="full", outputs={i: np.asarray(o, np.int32) for i, o in done.items()}, wall_s=wall, tokens=emitted,
            budget_bytes=self.budget, peak_measured_bytes=mem.peak_measured, peak_reserved_bytes=mem.peak_reserved,
            device_peak_bytes=device_stats_peak(), timeline=mem.timeline,
            stats=dict(slots=n, steps=steps, iterations=it, admit_s=admit_s, full_bytes=per))

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
