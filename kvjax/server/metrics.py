"""The server's measurements in the Prometheus text exposition format (`GET /metrics`).

Counters and histograms are updated from the HTTP handlers and the engine thread (one lock); the prefix cache's own
counters (hit tokens by form, missed tokens by kind and cause) are read from it at scrape time.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ACCEPT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
RATE_WINDOW_S = 10.0  # tokens/s is measured over this trailing window


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: `le` buckets, `_sum`, `_count`)."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return out


class ServerMetrics:
    """Everything `/metrics` reports."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = collections.Counter()  # (endpoint, status) -> count
        self.finished = collections.Counter()  # finish reason ("stop", "length", "cancelled", "error") -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.accepted = Histogram(ACCEPT_BUCKETS)
        self._recent: collections.deque = collections.deque()  # (time, tokens)
        self.queue_depth = lambda: 0
        self.running = lambda: 0
        self.prefix_stats = lambda: None
        self.memory = lambda: (0, 0, 0)  # (budget, reserved, peak measured) bytes

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def tokens(self, n: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.generation_tokens += n
            self._recent.append((now, n))

    def finish(self, reason: str, prompt_tokens: int, ttft: float | None, tpot: float | None) -> None:
        with self.lock:
            self.finished[reason] += 1
            self.prompt_tokens += prompt_tokens
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)

    def verification(self, accepted: int) -> None:
        with self.lock:
            self.accepted.observe(accepted)

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self) -> str:
        """The text exposition format (version 0.0.4)."""
        L = []

        def metric(name, kind, help_, samples):
            """One metric family: its HELP/TYPE lines, then `samples` — a value, or (labels dict, value) pairs."""
            L.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
            if not isinstance(samples, list):
                samples = [({}, samples)]
            for labels, v in samples:
                lab = ",".join(f'{k}="{_esc(x)}"' for k, x in labels.items())
                L.append(f"{name}{{{lab}}} {v}" if lab else f"{name} {v}")

        def histogram(name, help_, h):
            L.extend([f"# HELP {name} {help_}", f"# TYPE {name} histogram"])
            L.extend(h.lines(name))

        with self.lock:
            metric("kvjax_requests_total", "counter", "HTTP requests by endpoint and status",
                   [({"endpoint": ep, "status": st}, n) for (ep, st), n in sorted(self.requests.items())])
            metric("kvjax_requests_finished_total", "counter", "generations by finish reason",
                   [({"reason": r}, n) for r, n in sorted(self.finished.items())])
            metric("kvjax_queue_depth", "gauge", "requests waiting for a batch slot", self.queue_depth())
            metric("kvjax_requests_running", "gauge", "requests decoding", self.running())
            metric("kvjax_prompt_tokens_total", "counter", "prompt tokens of finished requests", self.prompt_tokens)
            metric("kvjax_generation_tokens_total", "counter", "tokens streamed to clients", self.generation_tokens)
            metric("kvjax_generation_tokens_per_second", "gauge", f"tokens/s over the last {RATE_WINDOW_S:g} s",
                   self.tokens_per_s())
            histogram("kvjax_time_to_first_token_seconds", "request arrival to its first token", self.ttft)
            histogram("kvjax_time_per_output_token_seconds", "mean time per output token after the first",
                      self.tpot)
            histogram("kvjax_accepted_tokens_per_verification", "drafts accepted per VeriCache verification",
                      self.accepted)
            budget, reserved, peak = self.memory()
            metric("kvjax_device_budget_bytes", "gauge", "device bytes the schedulers may hold", budget)
            metric("kvjax_device_reserved_bytes", "gauge", "device bytes reserved now", reserved)
            metric("kvjax_device_peak_measured_bytes", "gauge", "peak measured per-request device bytes", peak)
        st = self.prefix_stats()
        if st is not None:
            metric("kvjax_prefix_lookups_total", "counter", "prefix-cache lookups", st["lookups"])
            metric("kvjax_prefix_prompt_tokens_total", "counter", "prompt tokens looked up", st["prompt_tokens"])
            metric("kvjax_prefix_hit_tokens_total", "counter", "prompt tokens restored from the prefix cache",
                   st["hit_tokens"])
            metric("kvjax_prefix_reused_tokens_total", "counter", "tokens reused by form and tier",
                   [({"form": f, "tier": t}, n) for f, tiers in sorted(st["reused_tokens"].items())
                    for t, n in sorted(tiers.items())])
            metric("kvjax_prefix_miss_tokens_total", "counter", "prompt tokens recomputed, by miss kind and cause",
                   [({"kind": k, "cause": c}, n) for k, causes in sorted(st["misses"].items())
                    for c, n in sorted(causes.items())])
        return "\n".join(L) + "\n"


def _esc(s: str) -> str:
    return str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
