"""Benchmark: attention per layer and the verify step by the native kernel, XLA and PyTorch, in one run.

Why: the verify's cost in full-cache decode steps decides VeriCache's speedup; its attention is the bulk of it.
  1. per layer, for each row count and cache size (random keys, the model's heads), interleaved: the native kernel,
     the XLA path (`default_attention`: one-shot up to `ONE_SHOT_MAX_ROWS` rows, blocked above) and PyTorch's fused
     `scaled_dot_product_attention` (2 threads) -- `bench_attention_peers.compare`;
  2. the whole verify step (`decode.verify.verify_step`) of the checkpoint at each draft length and one full-cache
     decode step, with the native kernel and with XLA, interleaved (the jit caches are cleared between the modes):
     verify ms and verify / decode-step ratio per implementation. Each is timed as its loop runs it: calls chained
     on the cache the one before returned (a decode call is 32 steps), the first on a fresh copy, untimed. Beside each
     verify, its arithmetic floor: its attention's and products' multiply-adds over the machine's multiply-add rate
     on two threads (`pallas_kernels.native.multiply_add_rate`, measured before and after the timings, the faster
     taken) -- the verify is bound by arithmetic where a decode step is bound by memory, so this, not the bytes it
     reads, is what it cannot beat.

Usage: python scripts/bench_short_verify.py --context 32768 --draft-lens 8,32 --rows 1,5,9,17,33,256 [--json out.json]
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvjax  # noqa: E402
import pallas_kernels  # noqa: E402
from kvjax.decode import steps, vericache  # noqa: E402
from kvjax.decode import verify as verify_mod  # noqa: E402
from kvjax.models import attention as attn  # noqa: E402
import bench_common  # noqa: E402
from bench_attention_peers import compare  # noqa: E402


def arithmetic_floor(cfg, prompt_len: int, x: int, rate: float | None) -> dict | None:
    """A verify block of x drafts after `prompt_len` cached tokens: its multiply-adds (row t sees prompt_len + t + 1
    keys; every row runs the products) and the time they take at `rate` (None without a rate or a product count)."""
    products = bench_common.product_multiply_adds(cfg)
    if rate is None or products is None:
        return None
    seen = bench_common.causal_keys_seen(x + 1, prompt_len + 1)
    attention = bench_common.attention_multiply_adds(cfg.num_heads, cfg.head_dim, seen, layers=cfg.num_layers)
    total = attention + (x + 1) * products
    return dict(attention_multiply_adds=attention, product_multiply_adds=(x + 1) * products,
                multiply_adds_per_s=rate, ms=total / rate * 1e3)


def verify_steps(model, context: int, draft_lens: list[int], rounds: int, impls: list[str]) -> dict:
    cfg, fam = model.config, model.family
    prompt = np.random.default_rng(1).integers(5, cfg.vocab_size, context - 300).astype(np.int32)
    full, first = vericache.prefill_for(model, prompt, 256, max_draft=max(draft_lens))
    seed = jnp.zeros((1,), jnp.int32)
    qlog = jnp.zeros((1, 1, cfg.vocab_size), jnp.float32)

    def copy():
        return jax.block_until_ready(jax.tree.map(jnp.copy, full))

    vparams = model.verify_params()  # what VeriCache verifies with (and its reference reads)

    def chained_ms(step, calls: int) -> float:
        """Best wall time (ms) of calls 2..`calls` of `step` (cache -> (array to wait for, next cache)), each on the
        cache the one before returned -- the first on a fresh copy (it compiles) -- as VeriCache's rounds and a decode
        loop run. A fresh copy of the whole cache right before each timed call left ~L3's worth of dirty lines for
        the call to write back (measured, the bundled model's x = 8 verify at 32K, 16 calls each way in one process:
        median 15.9 ms after a fresh copy against 12.2 ms chained; minima 11.1 and 10.9 ms)."""
        c, times = copy(), []
        for _ in range(calls):
            t0 = time.perf_counter()
            ready, c = step(c)
            jax.block_until_ready(ready)
            times.append(time.perf_counter() - t0)
        return min(times[1:]) * 1e3

    def verify_ms(x, impl):
        drafts = jnp.zeros((1, x), jnp.int32)

        def step(c):
            out = verify_mod.verify_step(vparams, cfg, c, None, first, drafts, qlog, seed, family=fam, impl=impl)
            return out[0], out[2]
        return chained_ms(step, 4)

    loop = model.loop_params()  # what full-cache decoding runs with

    def decode_ms(impl, n=32):
        def step(c):
            return steps.decode(loop, cfg, c, first, seed, num_steps=n, family=fam, impl=impl)
        return chained_ms(step, 3) / n

    rate = bench_common.multiply_add_rate(2)
    res = {}
    for _ in range(rounds):  # interleaved: a load change on the shared machine hits every implementation alike
        for impl in impls:
            if len(impls) > 1:
                jax.clear_caches()  # one implementation's programs at a time
            res.setdefault(f"{impl} decode step", []).append(decode_ms(impl))
            for x in draft_lens:
                res.setdefault(f"{impl} verify x={x}", []).append(verify_ms(x, impl))
    jax.clear_caches()
    after = bench_common.multiply_add_rate(2)
    rate = None if rate is None or after is None else max(rate, after)
    best = {k: min(v) for k, v in res.items()}
    out = {}
    for name, v in res.items():
        impl = name.split()[0]
        rec = dict(ms=min(v), runs_ms=v)
        steps_ = ""
        if "decode" not in name:
            # best against best, and the median of each round's verify over the same round's decode step: the
            # machine's load drifts between rounds, a round's two timings are a few seconds apart
            per_round = [a / b for a, b in zip(v, res[f"{impl} decode step"])]
            rec.update(decode_steps=min(v) / best[f"{impl} decode step"], decode_steps_per_round=per_round,
                       decode_steps_median=float(np.median(per_round)))
            steps_ = (f"  = {rec['decode_steps']:5.2f} decode steps (median of rounds "
                      f"{rec['decode_steps_median']:.2f})")
            floor = arithmetic_floor(cfg, prompt.size, int(name.split("=")[1]), rate)
            if floor:
                floor["decode_steps"] = floor["ms"] / best[f"{impl} decode step"]
                rec["multiply_add_floor"] = floor
                steps_ += (f"; multiply-add floor {floor['ms']:.2f} ms = {floor['decode_steps']:.2f} decode steps "
                           f"(measured {min(v) / floor['ms']:.2f}x it)")
        out[name] = rec
        print(f"  {name:22s} {min(v):8.2f} ms{steps_}  (runs: {', '.join(f'{a:.2f}' for a in v)})", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/kvjax-code-tiny")
    ap.add_argument("--context", type=int, default=16384, help="prompt bucket of the verify-step timing")
    ap.add_argument("--draft-lens", default="8,32")
    ap.add_argument("--rows", default="1,5,9,17,33,256", help="query rows of the per-layer timing")
    ap.add_argument("--slots", default="9216,36864", help="cache sizes of the per-layer timing")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--impls", default="native,xla", help="implementations of the verify/decode-step timing")
    ap.add_argument("--skip-layer", action="store_true", help="only the verify/decode steps")
    ap.add_argument("--skip-steps", action="store_true", help="only the per-layer attention")
    ap.add_argument("--json", default=None, help="write the per-layer records and the verify/decode steps here")
    args = ap.parse_args(argv)
    try:
        xs = [int(a) for a in args.draft_lens.split(",")]
        rows = [int(a) for a in args.rows.split(",")]
        slots = [int(a) for a in args.slots.split(",")]
    except ValueError:
        ap.error("--draft-lens, --rows and --slots take comma-separated integers")
    if any(s % attn.BLOCK or s < 1024 for s in slots):
        ap.error(f"--slots must be multiples of the block size {attn.BLOCK}")
    model = kvjax.load(args.model)
    cfg = model.config
    print(f"[bench] {args.model}; XLA one-shot up to {attn.ONE_SHOT_MAX_ROWS} rows; native: "
          f"{pallas_kernels.native.status()}", flush=True)
    report = dict(bench_common.run_meta([__file__, *(sys.argv[1:] if argv is None else argv)]), model=args.model,
                  context=args.context, native=bench_common.native_status(),
                  dispatch=dict(native_max_rows=attn.NATIVE_MAX_ROWS, native_min_slots=attn.NATIVE_MIN_SLOTS))
    if not args.skip_layer:
        report["attention_per_layer"] = compare(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rows, slots, reps=5,
                                                log=lambda s: print(s, flush=True))
    if not args.skip_steps:
        report["steps"] = verify_steps(model, args.context, xs, args.rounds, args.impls.split(","))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
