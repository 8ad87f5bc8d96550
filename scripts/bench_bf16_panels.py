"""Benchmark: products reading a bf16 checkpoint's f32 weights as bf16 panels vs as f32 panels, one run.

`pallas_kernels.linear.pack_f32` keeps a matrix whose weights are all exactly bf16 values in bf16 panels (the same bits
at half the bytes). For each context: the full-cache decode step (`steps.decode`, 16 steps a call) and the verify step
(`verify_step`, x drafts) of the model's loop layout as packed, against the same tree with every bf16 panel widened to
f32 -- interleaved `--reps` times, each call chained on the cache the one before returned. Reports medians, the ratio
and whether the decoded tokens and the verify logits are the same bits (they must be: the script exits 1 otherwise).

Usage: python scripts/bench_bf16_panels.py --context 4096,8192,32768 --reps 15 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvjax.arrays import tree_nbytes  # noqa: E402
from kvjax.decode import steps, vericache  # noqa: E402
from kvjax.decode import verify as verify_mod  # noqa: E402
from pallas_kernels.linear import PackedF32  # noqa: E402
from bench_common import load_bench_model, parse_contexts, run_meta  # noqa: E402

STEPS = 16


def _is_packed(a) -> bool:
    return isinstance(a, PackedF32)


def widened(params):
    """`params` with every bf16 panel stored as f32 (what packing did before bf16 panels)."""
    return jax.tree.map(lambda a: PackedF32(a.panels.astype(jnp.float32)) if _is_packed(a) else a, params,
                        is_leaf=_is_packed)


def measure(model, context: int, x: int, reps: int) -> dict:
    cfg, fam, impl = model.config, model.family, model.attention
    layouts = {"bf16 panels": model.loop_params()}
    layouts["f32 panels"] = widened(layouts["bf16 panels"])
    prompt = np.random.default_rng(1).integers(5, cfg.vocab_size, context - 300).astype(np.int32)
    # room for every timed call: each decode call adds STEPS tokens, each verify up to x + 1 (a call past the cache's
    # capacity would overwrite its last slot instead)
    full, first = vericache.prefill_for(model, prompt, (reps + 3) * 2 * (STEPS + x + 1), max_draft=x)
    seed, last = jnp.zeros((1,), jnp.int32), np.asarray(first)
    qlog = jnp.zeros((1, 1, cfg.vocab_size), jnp.float32)
    drafts = jnp.asarray(np.random.default_rng(2).integers(5, cfg.vocab_size, (1, x)).astype(np.int32))
    state = {"full": full}

    def decode(p):
        t = time.perf_counter()
        out, state["full"] = steps.decode(p, cfg, state["full"], last, seed, num_steps=STEPS, family=fam, impl=impl)
        out = np.asarray(out)
        return (time.perf_counter() - t) / STEPS, out

    def verify(p):
        t = time.perf_counter()
        out = verify_mod.verify_step(p, cfg, state["full"], None, last, drafts, qlog, seed, family=fam, impl=impl)
        logits = np.asarray(out[4])
        state["full"] = out[2]
        return time.perf_counter() - t, logits

    for p in layouts.values():  # compile
        decode(p), verify(p)
    base = jax.tree.map(jnp.copy, state["full"])
    same = {}
    for kind, fn in (("decode", decode), ("verify", verify)):
        got = []
        for p in layouts.values():
            state["full"] = jax.tree.map(jnp.copy, base)
            got.append(fn(p)[1])
        same[kind] = bool(np.array_equal(got[0].view(np.uint32), got[1].view(np.uint32)))
    times = {(k, n): [] for k in ("decode", "verify") for n in layouts}
    for r in range(reps):
        for name in (list(layouts) if r % 2 == 0 else list(layouts)[::-1]):
            times[("decode", name)].append(decode(layouts[name])[0])
            times[("verify", name)].append(verify(layouts[name])[0])
    rec = dict(context=context, x=x, weight_bytes={n: tree_nbytes(p) for n, p in layouts.items()}, same_bits=same)
    for kind in ("decode", "verify"):
        a, b = (float(np.median(times[(kind, n)])) for n in layouts)
        rec[kind] = dict(bf16_ms=a * 1e3, f32_ms=b * 1e3, ratio=a / b)
        print(f"  {context:6d} {kind:6s} bf16 panels {a * 1e3:8.3f} ms  f32 panels {b * 1e3:8.3f} ms  ratio {a / b:.3f}"
              f"  same bits: {same[kind]}", flush=True)
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/kvjax-code-tiny")
    ap.add_argument("--context", default="4096,8192,32768")
    ap.add_argument("--draft-len", type=int, default=8, help="the verify's drafts x")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model, name = load_bench_model(args.model, False)
    packed = [a for a in jax.tree.leaves(model.loop_params(), is_leaf=_is_packed) if _is_packed(a)]
    if not any(a.panels.dtype == jnp.bfloat16 for a in packed):
        raise SystemExit(f"bench_bf16_panels: error: {name} has no matrix of exactly-bf16 weights packed as bf16 "
                         f"(packed natively: {bool(packed)})")
    print(f"[bench] {name}: {sum(a.panels.dtype == jnp.bfloat16 for a in packed)} of {len(packed)} packed matrices "
          f"in bf16 panels", flush=True)
    records = [measure(model, c, args.draft_len, args.reps) for c in parse_contexts(ap, args.context, 512)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=name, records=records, meta=run_meta(argv)), f, indent=1)
    if not all(all(r["same_bits"].values()) for r in records):
        print("[bench] bf16 and f32 panels gave different bits", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
