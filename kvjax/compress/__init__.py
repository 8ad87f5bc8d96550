"""Lossy draft compressors behind one interface (`Compressor`): full cache -> `DraftCache`."""

from kvjax.compress.base import Compressor
from kvjax.compress.dropquant import DropQuantize
from kvjax.compress.kivi import KIVI
from kvjax.compress.kvzip import KVzipStyle
from kvjax.compress.refresh import Refresh
from kvjax.compress.snapkv import SnapKV
from kvjax.compress.streaming import StreamingLLM


COMPRESSORS = ("streaming", "snapkv", "kvzip", "kivi2", "kivi4", "dropquant", "refresh")


def make_compressor(name: str, **kw) -> Compressor:
    """'streaming' | 'snapkv' | 'kvzip' | 'kivi2' | 'kivi4' | 'dropquant' | 'refresh' -> a compressor (kw: its
    fields)."""
    if name in ("kivi2", "kivi4"):
        return KIVI(bits=int(name[-1]), **kw)
    table = {"streaming": StreamingLLM, "snapkv": SnapKV, "kvzip": KVzipStyle, "kivi": KIVI,
             "dropquant": DropQuantize, "refresh": Refresh}
    if name not in table:
        raise ValueError(f"unknown compressor {name!r}; expected one of {sorted(table) + ['kivi2', 'kivi4']}")
    return table[name](**kw)


__all__ = ["COMPRESSORS", "Compressor", "DropQuantize", "KIVI", "KVzipStyle", "Refresh", "SnapKV", "StreamingLLM",
           "make_compressor"]
