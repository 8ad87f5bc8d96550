"""Static cache capacities: a step compiles once per bucket, never per prompt length."""

from __future__ import annotations

from kvjax.errors import CapacityError

# Static capacities a DenseKV may have: a step compiles once per bucket, never per prompt length.
CAPACITY_BUCKETS = (256, 1024, 4096, 8192, 16384, 32768, 65536, 131072)



def pick_capacity(tokens_needed: int, buckets: tuple[int, ...] = CAPACITY_BUCKETS) -> int:
    """Smallest bucket holding `tokens_needed` tokens.

    Raises:
        CapacityError: if no bucket is large enough.
    """
    for b in buckets:
        if b >= tokens_needed:
            return b
    raise CapacityError(f"{tokens_needed} tokens exceed the largest cache capacity {buckets[-1]}")
