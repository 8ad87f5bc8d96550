"""Lossy draft compressors behind one interface (`Compressor`): full cache -> `DraftCache`."""

from kvjax.compress.base import Compressor
from kvjax.compress.dropquant import DropQuantize
from kvjax.compress.kivi import KIVI
from kvjax.compress.kvzip import KVzipStyle
from kvjax.compress.refresh import Refresh
from kvjax.compress.snapkv import SnapKV
from kvjax.compress.streaming import StreamingLLM


COMPRESSORS = ("streaming", "snapkv", "kvzip", "kivi2", "kivi4", "dropquant", "refresh", "refresh_kivi2",
               "refresh_kivi4")
# the refreshing drafter over a quantized bulk: the full-precision selection shrinks so that selection + bulk stay
# within the other drafters' quarter of the full cache (a 2-bit bulk is ~1/8 of f32 K/V, a 4-bit one ~3/16)
BULK_RATIO = {2: 8.0, 4: 16.0}


def make_compressor(name: str, **kw) -> Compressor:
    """'streaming' | 'snapkv' | 'kvzip' | 'kivi2' | 'kivi4' | 'dropquant' | 'refresh' | 'refresh_kivi2' |
    'refresh_kivi4' -> a compressor (kw: its fields, e.g. `ratio=8.0`, or `draft_dtype="bfloat16"` to keep the
    draft's full-precision prompt parts in bf16)."""
    if name in ("kivi2", "kivi4"):
        return KIVI(bits=int(name[-1]), **kw)
    if name in ("refresh_kivi2", "refresh_kivi4"):
        bits = int(name[-1])
        return Refresh(**{"ratio": BULK_RATIO[bits], "bulk_bits": bits, **kw})
    table = {"streaming": StreamingLLM, "snapkv": SnapKV, "kvzip": KVzipStyle, "kivi": KIVI,
             "dropquant": DropQuantize, "refresh": Refresh}
    if name not in table:
        raise ValueError(f"unknown compressor {name!r}; expected one of {sorted(set(COMPRESSORS) | set(table))}")
    return table[name](**kw)


__all__ = ["COMPRESSORS", "Compressor", "DropQuantize", "KIVI", "KVzipStyle", "Refresh", "SnapKV", "StreamingLLM",
           "make_compressor"]
