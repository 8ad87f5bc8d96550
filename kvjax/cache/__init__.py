"""Cache state (immutable pytrees) and the prefix cache that reuses it across requests."""

from kvjax.cache.forms import DenseKV, ModelCache, SwaWindow, init_cache, pick_capacity, CAPACITY_BUCKETS

__all__ = ["DenseKV", "ModelCache", "SwaWindow", "init_cache", "pick_capacity", "CAPACITY_BUCKETS"]

from kvjax.cache.manager import PrefixCache  # noqa: E402  (after the forms it builds on)

__all__ += ["PrefixCache"]
