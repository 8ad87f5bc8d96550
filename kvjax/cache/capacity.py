"""Static cache capacities: a step compiles once per bucket, never per prompt length.

Buckets grow by an eighth from 8192 slots on (eight per octave) so a prompt's cache is at most 12.5% larger than it
(a 32K prompt got a 65,536-slot cache when buckets doubled; every one-query step reads the whole capacity's mask and
the offloaded verify moves it). Below 8192 they step by 1024 (from 1024) and every bucket from 4096 on is a multiple
of 1024, the blocked attention's block (`kvjax.models.attention.BLOCK`), and of every draft compressor's chunk.
"""

from __future__ import annotations

from kvjax.errors import CapacityError


def _buckets() -> tuple[int, ...]:
    small = (256, 512, 1024, 2048, 3072, 4096, 5120, 6144, 7168)
    octaves = tuple(base + j * (base // 8) for base in (8192 << i for i in range(4)) for j in range(8))
    return small + octaves + (131072,)


# Static capacities a DenseKV may have: a step compiles once per bucket, never per prompt length.
CAPACITY_BUCKETS = _buckets()


def pick_capacity(tokens_needed: int, buckets: tuple[int, ...] = CAPACITY_BUCKETS) -> int:
    """Smallest bucket holding `tokens_needed` tokens.

    Raises:
        CapacityError: if no bucket is large enough.
    """
    for b in buckets:
        if b >= tokens_needed:
            return b
    raise CapacityError(f"{tokens_needed} tokens exceed the largest cache capacity {buckets[-1]}")
