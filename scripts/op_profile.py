"""Where a jitted step's time goes, per operation: a `jax.profiler` trace of a few calls, each traced operation mapped
to what it is in the compiled HLO (a native custom call's target, or an XLA fusion) and to the bytes its operands
hold.

XLA:CPU's thunk runtime records one trace event per HLO instruction it runs, named as in the compiled module
(`ffi_call.3249`, `multiply_add_fusion.29`); the compiled text names each custom call's target and operand shapes.
Used by `bench_step_ops.py`.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

import jax
import numpy as np

_DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1,
                "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(f32|s32|u32|f16|bf16|s16|u16|s8|u8|pred|f64|s64|u64)\[([0-9,]*)\]")
_CUSTOM = re.compile(r"%([\w.\-]+) = .*? custom-call\(.*custom_call_target=\"([\w.\-]+)\"")


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in `text` (`f32[1,9,64]`, `u8[15,288,64]`, ...)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def custom_calls(hlo_text: str) -> dict[str, tuple[str, int]]:
    """{instruction name: (custom-call target, bytes of its operands)} of a compiled module's text; the operand bytes
    come from its `operand_layout_constraints` (the shapes it reads)."""
    calls = {}
    for line in hlo_text.splitlines():
        m = _CUSTOM.search(line)
        if not m:
            continue
        calls[m.group(1)] = (m.group(2), shape_bytes(_braced(line, "operand_layout_constraints={")))
    return calls


def _braced(line: str, opener: str) -> str:
    """The text inside the braces `opener` opens (nested braces included), or "" where `line` has no `opener`."""
    start = line.find(opener)
    if start < 0:
        return ""
    i = start + len(opener)
    depth = 1
    for j in range(i, len(line)):
        depth += {"{": 1, "}": -1}.get(line[j], 0)
        if depth == 0:
            return line[i:j]
    return line[i:]


def trace_events(fn, reps: int) -> list[dict]:
    """The complete ('X') events of a `jax.profiler` trace of `reps` calls of `fn` (already compiled and warm), each
    call blocked on before the next."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(reps):
                jax.block_until_ready(fn())
        files = glob.glob(os.path.join(d, "plugins", "profile", "*", "*.trace.json.gz"))
        if not files:
            raise RuntimeError("jax.profiler wrote no trace.json.gz (is this jaxlib's profiler available?)")
        with gzip.open(files[0]) as f:
            doc = json.load(f)
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"]


# Instructions whose events span the ones they run (a loop's body, a branch): counted through their contents.
CONTAINERS = ("while", "conditional", "call")


def group_of(name: str, calls: dict) -> str | None:
    """An event's group: a custom call's target, "xla: <kind>" for an XLA instruction (its name without the number),
    or None for spans that contain other events (`CONTAINERS`) and the runtime's own."""
    if name in calls:
        return calls[name][0]
    base = name.split(".")[0]
    if not re.fullmatch(r"[a-z][\w\-]*", base) or base in CONTAINERS:
        return None
    return "xla: " + base


def op_breakdown(events: list[dict], hlo_text: str, module: str, calls_per_rep: int) -> list[dict]:
    """Per group, the time per call of the step (ms), the number of operations per call and, for custom calls, the
    operand bytes they read per call; sorted by time. Only events of the named HLO module count."""
    calls = custom_calls(hlo_text)
    names = set(re.findall(r"%([\w.\-]+) = ", hlo_text))
    acc = collections.defaultdict(lambda: [0.0, 0, 0])
    for e in events:
        if e.get("args", {}).get("hlo_module", module) != module or e["name"] not in names:
            continue
        g = group_of(e["name"], calls)
        if g is None:
            continue
        acc[g][0] += e["dur"] * 1e-3
        acc[g][1] += 1
        acc[g][2] += calls.get(e["name"], ("", 0))[1]
    rows = [dict(op=g, ms=t / calls_per_rep, count=n / calls_per_rep, bytes=b / calls_per_rep)
            for g, (t, n, b) in acc.items()]
    return sorted(rows, key=lambda r: -r["ms"])
