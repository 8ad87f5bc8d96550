"""Benchmark: where each step's time goes, operation by operation, against each operation's memory floor.

On one held-out prompt: the prompt's last prefill chunk, a full-cache decode step, a draft token (x = 8, the named
drafter), an x = 8 verify and, for a refreshing drafter, its re-selection from that verify (`refresh_step`: the block
masses the verify rows put on the cache, the top blocks, their gather) are each traced with `jax.profiler` over a few
calls (`op_profile.py`); every traced operation is grouped by what it is -- a native kernel's custom-call target
(`kvjax_matmul_int_dot`, `kvjax_attend_int8`, ...) or an XLA instruction kind -- and reported per chunk, token or
verify with the bytes its operands hold and, for the kernels, the floor: one XLA reduction over the same number of
bytes in the same run (`bench_roofline.Floor`; a prefill chunk is arithmetic, so its ratios to that floor are large by
nature; a gather reads only its chosen rows, so it has none). The step's own time (untraced, best of the reps) is
printed beside the sum of its operations: the gap is dispatch and waiting (or, where XLA runs operations
concurrently, the sum is the larger).

Usage: python scripts/bench_step_ops.py --model smollm2-135m-instruct --context 8192 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import heldout_prompts, load_bench_model, parse_drafter_spec, run_meta  # noqa: E402
from bench_roofline import COMPRESSORS, Floor, copy  # noqa: E402
from op_profile import op_breakdown, trace_events  # noqa: E402

from kvjax.decode import draft as draft_mod  # noqa: E402
from kvjax.decode import refresh as refresh_mod  # noqa: E402
from kvjax.decode import steps  # noqa: E402
from kvjax.decode import verify as verify_mod  # noqa: E402
from kvjax.decode.draft_weights import draft_params  # noqa: E402
from kvjax.decode.vericache import capacity_for  # noqa: E402

X = 8  # the draft and verify length profiled
DECODE_STEPS = 8  # tokens per traced decode call
GATHERS = ("kvjax_gather_int8", "kvjax_gather_rows")  # kernels that read a few rows of their operands: no floor


def profile_step(name, unit, jitted, make_args, per_call, reps, floor):
    """Traces `reps` calls of `jitted(*args, **kw)` (args fresh from `make_args()` each call, outside the timing) and
    returns the step's record: its untraced time per `unit` (a call does `per_call` of them; best of `reps`), the sum
    of its operations per unit and the operations' rows."""
    args, kw = make_args()
    hlo = jitted.lower(*args, **kw).compile().as_text()  # before the call below donates (consumes) the arguments
    jax.block_until_ready(jitted(*args, **kw))  # compile and warm
    module = re.search(r"HloModule (\S+?),", hlo).group(1)
    best = float("inf")
    for _ in range(reps):
        args, kw = make_args()
        t = time.perf_counter()
        jax.block_until_ready(jitted(*args, **kw))
        best = min(best, time.perf_counter() - t)
    pending = [make_args() for _ in range(reps)]  # made before tracing: the trace holds only the step's calls
    events = trace_events(lambda: jitted(*pending.pop(0)[0], **kw), reps)
    rows = op_breakdown(events, hlo, module, reps * per_call)
    for r in rows:
        if r["op"] in GATHERS:  # their operands are the whole cache, of which they read only the selected rows
            r["bytes"] = 0
        if r["bytes"]:
            r["floor_ms"] = floor(r["bytes"]) * 1e3
            r["ratio"] = r["ms"] / r["floor_ms"]
    step_ms = best / per_call * 1e3
    ops_ms = sum(r["ms"] for r in rows)
    print(f"{name}: {step_ms:.3f} ms per {unit} untraced; its operations {ops_ms:.3f} ms traced", flush=True)
    for r in rows[:14]:
        fl = f"{r['bytes'] / 1e6:8.2f} MB  floor {r['floor_ms']:7.3f} ms  {r['ratio']:5.2f}x" if r["bytes"] else ""
        print(f"  {r['op']:40s} {r['ms']:8.3f} ms {100 * r['ms'] / max(ops_ms, 1e-12):5.1f}%  x{r['count']:6.1f}  "
              f"{fl}", flush=True)
    return dict(step=name, step_ms=step_ms, ops_ms=ops_ms, ops=rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/kvjax-code-tiny",
                    help="what kvjax.load reads: a model directory, a GGUF file or a named model")
    ap.add_argument("--context", type=int, default=8192, help="prompt length (tokens)")
    ap.add_argument("--compressor", default="refresh:draft_dtype=int8:max_kept=2048",
                    help="the drafter whose draft token is profiled (a bench_roofline drafter spec)")
    ap.add_argument("--reps", type=int, default=3, help="traced calls per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the records here")
    args = ap.parse_args(argv)
    if args.context < 64 or args.reps < 1:
        ap.error("--context must be at least 64 and --reps at least 1")
    comp_name, comp_kw = parse_drafter_spec(args.compressor, COMPRESSORS, None, ap.prog)

    model, name = load_bench_model(args.model, False)
    params, config, family, impl = model.params, model.config, model.family, model.attention
    prompts, _ = heldout_prompts(model, name, args.context, 1, args.seed)
    prompt = prompts[0]
    full = family.init_cache(config, 1, capacity_for(prompt.size, DECODE_STEPS * (args.reps + 2), X), model.cache_dtype)
    # the prompt's last chunk is profiled as a prefill chunk (a bulk chunk where the prompt has two)
    width = steps.BULK_CHUNK if prompt.size >= 2 * steps.BULK_CHUNK else max(prompt.size // 2, 1)
    n0 = prompt.size - width
    _, full = steps.prefill(model, full, prompt[:n0])
    measure = Floor()
    floors = {}

    def floor(nbytes):  # one measurement per byte count: the same bytes, the same floor in every step's table
        if nbytes not in floors:
            floors[nbytes] = measure(nbytes)
        return floors[nbytes]

    print(f"[bench] {name}, {prompt.size}-token prompt, backend {jax.default_backend()}, implementation {impl}",
          flush=True)
    records = []

    chunk = jnp.asarray(prompt[None, n0:], jnp.int32)
    records.append(profile_step(
        f"prefill chunk ({width} rows at {n0} cached)", "chunk", steps.prefill_chunk,
        lambda: ((params, config, copy(full), chunk, jnp.asarray([width], jnp.int32)), dict(family=family, impl=impl)),
        1, args.reps, floor))
    logits, full = steps.prefill(model, full, prompt[n0:])
    first = jnp.argmax(logits)[None].astype(jnp.int32)
    seed = jnp.zeros((1,), jnp.int32)

    loop = model.loop_params()
    records.append(profile_step(
        "full-cache decode", "token", steps.decode,
        lambda: ((loop, config, copy(full), first, seed),
                 dict(num_steps=DECODE_STEPS, family=family, impl=impl)), DECODE_STEPS, args.reps, floor))

    comp = family.make_compressor(comp_name, **comp_kw)
    dparams = draft_params(model, comp_kw.get("draft_weights", "float32"))
    dcache = jax.block_until_ready(comp(params, config, full, prompt, recent_slots=256))
    records.append(profile_step(
        f"draft token [{args.compressor}]", "token", draft_mod.draft_step,
        lambda: ((dparams, config, copy(dcache), first, seed), dict(x=X, family=family, impl=impl)), X, args.reps,
        floor))

    vparams = model.verify_params()
    drafts = jnp.zeros((1, X), jnp.int32)
    qlog = jnp.zeros((1, 1, config.vocab_size), jnp.float32)
    records.append(profile_step(
        f"verify x={X}", "verify", verify_mod.verify_step,
        lambda: ((vparams, config, copy(full), copy(dcache), first, drafts, qlog, seed),
                 dict(family=family, impl=impl)), 1, args.reps, floor))

    if getattr(dcache, "refresh", None) is not None:  # a refreshing drafter: its re-selection after that verify
        _, _, committed, _, _, aux = verify_mod.verify_step(vparams, config, copy(full), copy(dcache), first, drafts,
                                                            qlog, seed, family=family, impl=impl)
        records.append(profile_step(
            "re-selection", "call", refresh_mod.refresh_step,
            lambda: ((copy(dcache), committed, aux), dict(family=family)), 1, args.reps, floor))

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(meta=dict(model=name, context=int(prompt.size), compressor=args.compressor, x=X,
                                     floor="one jitted jnp.sum over the same number of f32 bytes, best of 5, same run",
                                     **run_meta()), records=records), f, indent=1)
        print(f"[bench] json -> {args.json}")
    return records


if __name__ == "__main__":
    main()
