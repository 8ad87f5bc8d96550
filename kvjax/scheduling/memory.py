"""Device-memory budget of the scheduler: reservations decided before allocating, and measured live bytes.

Reservations (accounting): a request is admitted only when what it will hold on the device — its draft-cache slot,
its decoded-token tail and a share of the verification slots — fits `budget` together with everything already
reserved; otherwise it waits in the queue. On a GPU the budget is the real limit; on the CPU it is enforced by this
accounting alone.

Measurement: `sample()` sums the bytes of every live, not-deleted JAX array in the device memory kind that did not
exist when the tracker was created (model weights and the caller's own arrays are excluded; host-resident full caches
in "pinned_host" never count). Sampled after every dispatch the scheduler makes, this is the peak of the per-request
state the scheduler holds; compiled computations' temporaries (activations) are not live arrays and are not counted —
on a GPU, `device_stats_peak()` reports the allocator's own peak as well.
"""

from __future__ import annotations

import time
import weakref

import jax

from kvjax.errors import BudgetError

# Share of free device memory a default budget takes (the rest stays for weights, activations and the allocator).
DEFAULT_BUDGET_SHARE = 0.5


def default_budget(device=None) -> int:
    """A device-memory budget for per-request state when the caller names none: half of what is free.

    On a GPU/TPU: the allocator's limit minus its bytes in use (`memory_stats`). On the CPU, where device memory is
    host memory: half of the host's available memory (`/proc/meminfo` MemAvailable, else total physical pages).
    """
    dev = device or jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    else:
        free = _host_available()
    return max(1 << 20, int(free * DEFAULT_BUDGET_SHARE))


def _host_available() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class DeviceMemory:
    """Budget accounting plus a measured timeline of live device bytes.

    Attributes:
        budget: bytes the per-request state may occupy on the device (weights excluded).
        reserved: bytes currently reserved; peak_reserved, peak_measured: their maxima.
        timeline: list of (seconds since start, measured bytes, reserved bytes, tokens emitted so far).
    """

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.reserved = 0
        self.peak_reserved = 0
        self.peak_measured = 0
        self.timeline: list[tuple[float, int, int, int]] = []
        # weak references keyed by id: a baseline array that dies frees its id for new arrays, which then count
        self._baseline = {id(a): weakref.ref(a) for a in jax.live_arrays()}
        self._t0 = time.perf_counter()

    def fits(self, nbytes: int) -> bool:
        return self.reserved + nbytes <= self.budget

    def reserve(self, nbytes: int, what: str) -> None:
        """Reserve `nbytes`; raises BudgetError if that would exceed the budget (callers check `fits` first)."""
        if not self.fits(nbytes):
            raise BudgetError(f"{what}: {nbytes} bytes do not fit the device budget {self.budget} "
                              f"({self.reserved} reserved)")
        self.reserved += int(nbytes)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def release(self, nbytes: int) -> None:
        self.reserved -= int(nbytes)
        assert self.reserved >= 0, "released more device memory than was reserved"

    def measure(self) -> int:
        """Live bytes of new (not baseline, not deleted) arrays in the device memory kind."""
        total = 0
        for a in jax.live_arrays():
            ref = self._baseline.get(id(a))
            if (ref is not None and ref() is a) or a.is_deleted():
                continue
            if getattr(a.sharding, "memory_kind", "device") in ("device", None):
                total += a.size * a.dtype.itemsize
        return int(total)

    def sample(self, tokens: int = 0) -> int:
        """Measure now, update the peak, append to the timeline; returns the measured bytes."""
        m = self.measure()
        self.peak_measured = max(self.peak_measured, m)
        self.timeline.append((time.perf_counter() - self._t0, m, self.reserved, int(tokens)))
        return m


def device_stats_peak(device=None) -> int | None:
    """The allocator's peak bytes in use where the backend reports it (GPU); None on the CPU."""
    dev = device or jax.devices()[0]
    try:
        stats = dev.memory_stats()
    except Exception:  # noqa: BLE001 - backends without allocator statistics
        return None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None
