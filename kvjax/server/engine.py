"""The one scheduler loop behind the HTTP server: a background thread that owns the model and the schedulers.

Requests (`Job`s) arrive from the HTTP handlers through a bounded inbox; the thread hands them to a scheduler of
`kvjax.scheduling` (VeriCache or full cache — the same step-wise `submit` / `step` / `cancel` mechanism their `run()`
uses), steps every busy scheduler, and turns each verified piece of output into a `Delta` for its client. The
thread stops a request at its stop rule (cancelling it in the scheduler frees its slot at once), when its client
goes away, or when it fails.

Sampling configurations are static in the compiled steps, so requests are grouped by theirs: one scheduler per
configuration in use (greedy requests all share one), all reserving from one device-memory budget
(`kvjax.scheduling.memory.DeviceMemory`); an idle scheduler is closed and its memory released. A group that cannot get
memory while others hold it waits for them.

With a `PrefixCache`, every prompt is prefilled through it under its tenant's namespace (the tenant salt keeps
tenants' entries apart) before it joins a scheduler; the prefilled full cache waits in host memory like any
prefix hit.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback

import jax.numpy as jnp
import numpy as np

from kvjax.decode import offload as offl
from kvjax.decode import vericache as vc
from kvjax.errors import BudgetError, KvjaxError
from kvjax.generation import DeltaBuilder
from kvjax.scheduling.full_scheduler import FullCacheScheduler
from kvjax.scheduling.memory import DeviceMemory
from kvjax.scheduling.requests import Request
from kvjax.scheduling.vericache_scheduler import VeriCacheScheduler
from kvjax.server.schemas import ApiError, GenRequest

MODES = ("vericache", "full")


class Job:
    """One request in the engine. `sink(kind, value)` is called from the engine thread with ("delta", Delta),
    then ("done", final dict) or ("error", ApiError) — exactly one of the last two."""

    def __init__(self, req: GenRequest, sink, tenant: str = ""):
        self.req, self.sink, self.tenant = req, sink, tenant
        self.builder = DeltaBuilder(req.rule, req.max_tokens)
        self.tokens: list[int] = []
        self.t0 = time.monotonic()
        self.t_first: float | None = None
        self.cancelled = False
        self.finished = False
        self.where: tuple | None = None  # (scheduler key, request id) once submitted


class Engine:
    """The scheduler loop (see the module docstring).

    Args:
        model: the served `kvjax.Model`.
        mode: "vericache" or "full".
        context: most tokens a request holds (prompt + max_tokens): sizes the slots.
        max_tokens_limit: largest max_tokens (sizes VeriCache's decoded-token rings).
        budget_bytes: device bytes for per-request state (weights excluded).
        max_queue: most requests waiting for a slot; more are refused at once (429).
        max_slots: most requests decoding at once.
        draft_len, compressor: VeriCache's x and draft maker.
        prefix_cache: a shared `kvjax.PrefixCache`, or None.
        metrics: a `ServerMetrics` to update.
    """

    def __init__(self, model, *, mode: str = "vericache", context: int = 2048, max_tokens_limit: int = 256,
                 budget_bytes: int, max_queue: int = 64, max_slots: int = 16, draft_len: int = 8,
                 compressor=None, prefix_cache=None, metrics=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.model, self.mode, self.context, self.max_tokens_limit = model, mode, context, max_tokens_limit
        self.max_queue, self.max_slots, self.x, self.compressor = max_queue, max_slots, draft_len, compressor
        self.prefix_cache, self.metrics = prefix_cache, metrics
        self.mem = DeviceMemory(budget_bytes)
        self.cv = threading.Condition()
        self.inbox: collections.deque = collections.deque()
        self.waiting: collections.deque = collections.deque()  # jobs whose sampling group has no memory yet
        self.scheds: dict = {}
        self.jobs: dict[tuple, Job] = {}
        self.unfinished = 0
        self.running = 0
        self.accepting = True
        self._stop = False
        self._namespaces: dict[str, object] = {}
        self._accepted_seen: dict = {}
        self.thread = threading.Thread(target=self._loop, name="kvjax-engine", daemon=True)
        if metrics is not None:
            metrics.queue_depth = lambda: max(self.unfinished - self.running, 0)
            metrics.running = lambda: self.running
            metrics.memory = lambda: (self.mem.budget, self.mem.reserved, self.mem.peak_measured)
            if prefix_cache is not None:
                metrics.prefix_stats = prefix_cache.stats

    # ------------------------------------------------------------ called from the HTTP side

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise ApiError 429 (queue full) / 503 (shutting down) at once."""
        with self.cv:
            if not self.accepting:
                raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
            if self.unfinished - self.running >= self.max_queue:
                raise ApiError(429, f"the request queue is full ({self.max_queue} waiting): retry later",
                               type="rate_limit_error", code="queue_full")
            self.unfinished += 1
            self.inbox.append(job)
            self.cv.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: stop the job and free what it holds (done by the engine thread)."""
        job.cancelled = True
        with self.cv:
            self.cv.notify()

    def shutdown(self, grace_s: float = 10.0) -> int:
        """Stop accepting; let in-flight jobs finish for up to `grace_s`, then fail the rest (their clients see an
        error, never a complete response); stop the thread. Returns how many jobs were cut off."""
        with self.cv:
            self.accepting = False
        end = time.monotonic() + grace_s
        while self.unfinished and time.monotonic() < end:
            time.sleep(0.02)
        with self.cv:
            self._stop = True
            self.cv.notify()
        self.thread.join(timeout=60)
        return self._cut_off

    _cut_off = 0

    def warmup(self, prompt_len: int = 8, max_tokens: int = 8) -> None:
        """Compile the steps of a short request before serving (runs one through the loop and waits)."""
        from kvjax.generation import StopRule  # noqa: PLC0415
        from kvjax.decode.sampling import Sampling  # noqa: PLC0415

        done = threading.Event()
        req = GenRequest(kind="completions", model="", prompt=np.arange(1, prompt_len + 1, dtype=np.int32),
                         max_tokens=max_tokens, sampling=Sampling(), seed=0,
                         rule=StopRule((), None, ignore_eos=True), logprobs=False, stream=False, include_usage=False)
        self.submit(Job(req, lambda kind, v: done.set() if kind in ("done", "error") else None, tenant="\0warmup"))
        done.wait()

    # ------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not (self.inbox or self._stop or self._has_work()):
                    self.cv.wait(0.5)
                if self._stop:
                    break
                new = list(self.inbox)
                self.inbox.clear()
            for job in new:
                self._enqueue(job)
            self._reap_cancelled()
            for key, sched in list(self.scheds.items()):
                if sched.busy:
                    self._step(key, sched)
            self._close_idle()
            self.running = sum(len(s.live) for s in self.scheds.values())
        for job in list(self.jobs.values()) + list(self.waiting) + list(self.inbox):
            if not job.finished:
                self._cut_off += 1
                self._fail(job, ApiError(503, "the server shut down before this request finished",
                                         type="server_error", code="shutting_down"))
        for s in self.scheds.values():
            s.close()
        self.scheds.clear()

    def _has_work(self) -> bool:
        return any(s.busy for s in self.scheds.values()) or any(j.cancelled for j in self.jobs.values())

    def _scheduler(self, key):
        """The scheduler of sampling configuration `key`, started on the shared budget (BudgetError if no room)."""
        s = self.scheds.get(key)
        if s is not None:
            return s
        x = self.x
        if self.mode == "full":
            s = FullCacheScheduler(self.model, budget_bytes=self.mem.budget, draft_len=x, max_slots=self.max_slots,
                                   temperature=key)
            s.start(capacity=vc.capacity_for(self.context, 0, x), memory=self.mem,
                    prefilled_only=self.prefix_cache is not None)
        else:
            ring = max(64, self.max_tokens_limit + x + 2)
            s = VeriCacheScheduler(self.model, budget_bytes=self.mem.budget, compressor=self.compressor,
                                   draft_len=x, max_slots=self.max_slots, temperature=key, recent_slots=ring,
                                   tail_capacity=None, slot_prompt_len=self.context)
            s.start(memory=self.mem, expected=self.max_slots)
            self._accepted_seen[key] = 0
        self.scheds[key] = s
        return s

    def _enqueue(self, job: Job) -> None:
        if job.cancelled:
            return self._drop(job)
        key = job.req.sampling
        try:
            sched = self._scheduler(key)
        except BudgetError as e:
            if self.scheds:  # others hold the memory: wait for them
                self.waiting.append(job)
                return None
            return self._fail(job, ApiError(500, f"the request does not fit the device budget: {e}",
                                            type="server_error"))
        try:
            r = Request(prompt=job.req.prompt, max_new_tokens=job.req.max_tokens, seed=job.req.seed)
            if self.prefix_cache is not None:
                r.prefilled, r.own_prefilled = self._prefill(job), True  # a copy of its own (`_prefill`)
            idx = sched.submit(r)
        except Exception as e:  # noqa: BLE001 - one request's failure is that request's
            return self._fail(job, self._error(e))
        job.where = (key, idx)
        self.jobs[job.where] = job
        return None

    def _prefill(self, job: Job):
        """The prompt prefilled through the prefix cache under the tenant's namespace: (host full cache, first)."""
        from kvjax.prefix.prefill import model_namespace, prefill_with_prefix_cache  # noqa: PLC0415

        ns = self._namespaces.get(job.tenant)
        if ns is None:
            ns = self._namespaces[job.tenant] = model_namespace(self.model, self.prefix_cache,
                                                                tenant_salt=job.tenant)
        ids = job.req.prompt
        last, full, _ = prefill_with_prefix_cache(self.model, ids, self.prefix_cache, namespace=ns,
                                                  capacity=vc.capacity_for(ids.size, job.req.max_tokens, self.x))
        first = vc.first_token(last, int(ids.size), jnp.asarray([job.req.seed], jnp.int32), job.req.sampling)
        return offl.to_host(full, copy=True), first  # the request's own: its verifies may write into it

    def _step(self, key, sched) -> None:
        try:
            events = sched.step()
        except Exception as e:  # noqa: BLE001 - fail this scheduler's requests, never the server
            jobs = [j for (k, _), j in list(self.jobs.items()) if k == key]
            sched.close()
            del self.scheds[key]
            for j in jobs:
                del self.jobs[j.where]
                j.where = None
                if isinstance(e, BudgetError) and self.scheds:
                    self.waiting.append(j)  # no memory while other groups run: retry when they are done
                else:
                    self._fail(j, self._error(e))
            return
        for idx, toks, finished in events:
            job = self.jobs.get((key, idx))
            if job is None:
                continue
            d = job.builder.add(toks)
            if d is not None and (d.token_ids or d.text or d.finish_reason):
                if d.token_ids and job.t_first is None:
                    job.t_first = time.monotonic()
                job.tokens += d.token_ids
                if self.metrics is not None:
                    self.metrics.tokens(len(d.token_ids))
                job.sink("delta", d)
            if job.builder.ended or finished:
                if not finished:
                    sched.cancel(idx)  # stopped early: its slot and memory are free now
                self._finish(job, d.finish_reason if d is not None and d.finish_reason else "length")
        if self.metrics is not None and self.mode == "vericache":
            seen = self._accepted_seen.get(key, 0)
            for a in sched.accepted[seen:]:
                self.metrics.verification(a)
            self._accepted_seen[key] = len(sched.accepted)

    def _close_idle(self) -> None:
        for key, s in list(self.scheds.items()):
            if not s.busy:
                s.close()
                del self.scheds[key]
                self._accepted_seen.pop(key, None)
        retry, self.waiting = list(self.waiting), collections.deque()
        for job in retry:
            self._enqueue(job)

    def _reap_cancelled(self) -> None:
        for where, job in list(self.jobs.items()):
            if job.cancelled:
                sched = self.scheds.get(where[0])
                if sched is not None:
                    sched.cancel(where[1])
                self._drop(job)
        for job in [j for j in self.waiting if j.cancelled]:
            self.waiting.remove(job)
            self._drop(job)

    # ------------------------------------------------------------ endings (each job ends exactly once)

    def _end(self, job: Job) -> bool:
        if job.finished:
            return False
        job.finished = True
        if job.where is not None:
            self.jobs.pop(job.where, None)
        with self.cv:
            self.unfinished -= 1
        return True

    def _finish(self, job: Job, reason: str) -> None:
        if not self._end(job):
            return
        now = time.monotonic()
        n = len(job.tokens)
        final = dict(finish_reason=reason, prompt_tokens=int(job.req.prompt.size), completion_tokens=n,
                     token_ids=list(job.tokens))
        if job.req.logprobs:
            try:
                final["logprobs"] = self._logprobs(job)
            except Exception as e:  # noqa: BLE001
                return self._sink_error(job, self._error(e))
        if self.metrics is not None:
            ttft = None if job.t_first is None else job.t_first - job.t0
            tpot = (now - job.t_first) / (n - 1) if job.t_first is not None and n > 1 else None
            self.metrics.finish(reason, int(job.req.prompt.size), ttft, tpot)
        job.sink("done", final)
        return None

    def _logprobs(self, job: Job) -> list[float]:
        """Each output token's log-probability under the model's raw distribution (one full forward pass)."""
        from kvjax.api import logits  # noqa: PLC0415

        ids = np.concatenate([job.req.prompt, np.asarray(job.tokens, np.int32)])
        rows = np.asarray(logits(self.model, ids[:-1]), np.float64)[job.req.prompt.size - 1:]
        m = rows.max(axis=1, keepdims=True)
        lse = (m + np.log(np.exp(rows - m).sum(axis=1, keepdims=True)))[:, 0]
        return [float(rows[i, t] - lse[i]) for i, t in enumerate(job.tokens)]

    def _fail(self, job: Job, err: ApiError) -> None:
        if self._end(job):
            self._sink_error(job, err)

    def _sink_error(self, job: Job, err: ApiError) -> None:
        if self.metrics is not None:
            self.metrics.finish("error", int(job.req.prompt.size), None, None)
        job.sink("error", err)

    def _drop(self, job: Job) -> None:
        if self._end(job) and self.metrics is not None:
            self.metrics.finish("cancelled", int(job.req.prompt.size), None, None)

    @staticmethod
    def _error(e: Exception) -> ApiError:
        if isinstance(e, ApiError):
            return e
        if isinstance(e, KvjaxError):
            return ApiError(400, str(e), code="invalid_value")
        traceback.print_exc()
        return ApiError(500, f"the request failed: {type(e).__name__}: {e}", type="server_error")
