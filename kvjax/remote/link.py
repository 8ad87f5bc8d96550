"""A model of a network link for one machine: a serialised, rate-capped pipe (token bucket with no burst credit).

A store read of `n` bytes is released to its reader no earlier than `n / rate` seconds after the link became free
(reads queue one behind another, as on one connection), plus an optional fixed per-request latency. The bytes
themselves come from the local store at local speed; the link only DELAYS them (sleeping, so a capped transfer
costs no CPU, as a real NIC would not). This is a model of the link, not a measurement of one: it has no congestion,
packet loss, slow start or contention with other tenants. Default: uncapped (rate None, latency 0).
"""

from __future__ import annotations

import threading
import time


class Link:
    """Rate cap in bytes/s shared by every reader of one `RemoteStore`.

    Args:
        gbytes_per_s: link bandwidth in GB/s (1e9 bytes/s); None = uncapped.
        latency_s: fixed delay added to each request (round trip), default 0.
    """

    def __init__(self, gbytes_per_s: float | None = None, latency_s: float = 0.0):
        if gbytes_per_s is not None and gbytes_per_s <= 0:
            raise ValueError(f"link bandwidth must be > 0 GB/s, got {gbytes_per_s}")
        self.rate = None if gbytes_per_s is None else float(gbytes_per_s) * 1e9
        self.latency_s = float(latency_s)
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.bytes = 0
        self.busy_s = 0.0

    def reserve(self, nbytes: int) -> float:
        """Book `nbytes` on the link; returns the monotonic time at which they have arrived."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            cost = self.latency_s + (nbytes / self.rate if self.rate else 0.0)
            self._free_at = start + cost
            self.bytes += nbytes
            self.busy_s += cost
            return self._free_at

    def transfer(self, nbytes: int) -> None:
        """Block the calling thread until `nbytes` booked now have crossed the link."""
        self.wait_until(self.reserve(nbytes))

    @staticmethod
    def wait_until(done: float) -> None:
        """Sleep until the monotonic time `done` (a `reserve` result)."""
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)
