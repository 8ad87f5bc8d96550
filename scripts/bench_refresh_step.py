"""Benchmark: the refreshing drafter's re-selection, native block masses against XLA's, in decode steps, one run.

On one held-out prompt of the checkpoint's corpus (default: the bundled model at 32K), after a real prefill, draft and
x = 32 verify (whose rows' queries score the cache, as in VeriCache):
  - the block masses alone, every full-attention layer in one jitted call, for R = 2 verify rows (a refresh) and
    R = `obs_window` prompt rows (the first selection): `block_mass` native vs the jnp reference (XLA);
  - the whole re-selection step (`kvjax.decode.refresh.refresh_step`, jitted as VeriCache calls it: masses, top-k,
    gather) with each implementation of the masses, and with the masses the verify handed out (VeriCache's path
    where the native kernel ran the verify: `attention_scores.attention_with_block_mass`, nothing scored apart);
  - one full-cache decode step (a 32-step loop, per step) in the same run, so a re-selection reads as decode steps;
  - `--smollm2-shape`: the masses alone at SmolLM2-135M's shape (30 layers, 9 query / 3 KV heads, D = 64) on random
    arrays of `--smollm2-slots` slots.
Contenders are interleaved round by round; each figure is the median of `--reps` rounds (a shared machine drifts).

Usage: python scripts/bench_refresh_step.py --json docs/results/refresh_step_tiny_32k.json --smollm2-shape
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

from kvjax.decode import draft as draft_mod  # noqa: E402
from kvjax.decode import refresh as refresh_mod  # noqa: E402
from kvjax.decode import steps  # noqa: E402
from kvjax.decode import verify as verify_mod  # noqa: E402
from kvjax.decode.vericache import capacity_for  # noqa: E402
from kvjax.models import attention_scores  # noqa: E402
from bench_common import heldout_prompts, load_bench_model, native_status, run_meta  # noqa: E402

IMPLS = ("native", "xla")
REFRESH_MASSES = IMPLS + ("verify",)  # the re-selection's contenders: each scoring, or the verify's own masses
X = 32  # the verify whose rows' queries score (VeriCache's refresh at x = 32)
DECODE_STEPS = 32


def copy(tree):
    return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


def timed(fn) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def masses_fn(impl: str, block: int):
    """One jitted call scoring every layer (k, k_pos, q, q_pos per layer) with `impl`."""
    return jax.jit(lambda layers: tuple(attention_scores.block_mass(q, k, qp, kp, block, implementation=impl)
                                        for q, k, qp, kp in layers))


def refresh_fn(impl: str):
    """`refresh_step` (donating the draft, as VeriCache runs it) traced with `impl` for the masses: a jitted function
    of its own per implementation, so neither reuses the other's program (a new Python function each: jax caches
    traces by function, so two jits of `refresh_step.__wrapped__` itself would share the first one's trace)."""
    def traced(dcache, full, aux, *, family):
        return refresh_mod.refresh_step.__wrapped__(dcache, full, aux, family=family)

    step = jax.jit(traced, static_argnames="family", donate_argnames="dcache")

    def run(dcache, full, aux, family):
        attention_scores.IMPLEMENTATION = None if impl == "verify" else impl  # read at trace time (the first call)
        try:
            return step(dcache, full, aux, family=family)
        finally:
            attention_scores.IMPLEMENTATION = None
    return run


def interleaved(contenders: dict, reps: int) -> dict:
    """{name: median seconds} of `reps` rounds, each round calling every contender once (after one warm-up call)."""
    for fn in contenders.values():
        fn()
    times = {k: [] for k in contenders}
    for _ in range(reps):
        for k, fn in contenders.items():
            times[k].append(fn())
    return {k: float(np.median(v)) for k, v in times.items()}


def bench_model(model, prompt, reps: int, log) -> tuple[list, dict]:
    params, config, family, impl = model.params, model.config, model.family, model.attention
    L = prompt.size
    cap = capacity_for(L, 256, X)
    full = family.init_cache(config, 1, cap, model.cache_dtype)
    logits, full = steps.prefill(model, full, prompt)
    first = jnp.argmax(logits)[None].astype(jnp.int32)
    seed = jnp.zeros((1,), jnp.int32)
    comp = family.make_compressor("refresh")
    dcache = jax.block_until_ready(comp(params, config, full, prompt, recent_slots=256))
    spec = dcache.refresh
    drafts, qlog, dcache = draft_mod.draft_step(params, config, dcache, first, seed, x=X, family=family, impl=impl)
    _, _, full, dcache, _, aux = verify_mod.verify_step(model.verify_params(), config, full, dcache, first, drafts,
                                                        qlog, seed, family=family, impl=impl)
    jax.block_until_ready((full, dcache, aux))
    dense = [i for i, q in enumerate(aux[0]) if q is not None]
    log(f"context {L}, {cap} slots, {len(dense)} scored layers, block {spec.block}, budget {spec.budget} tokens")

    # inputs of the masses alone: the verify's two rows (a refresh) and obs_window prompt-like rows (the first
    # selection; random queries of the verify rows' scale: the cost does not depend on their values)
    rng = np.random.default_rng(0)
    R0 = comp.obs_window
    two = [(aux[0][i], full.layers[i].k, aux[1], full.layers[i].key_positions()) for i in dense]
    q_scale = float(np.std(np.asarray(aux[0][dense[0]])))
    many = [(jnp.asarray(rng.normal(size=(1, R0) + aux[0][i].shape[2:]) * q_scale, jnp.float32), full.layers[i].k,
             full.length[:, None] - R0 + jnp.arange(R0, dtype=jnp.int32)[None], full.layers[i].key_positions())
            for i in dense]
    rows, summary = [], {}
    keys = [full.layers[i].k for i in dense]
    floor = jax.jit(lambda ks: [jnp.sum(k) for k in ks])  # the floor: one XLA reduction over the same keys
    for R, layers in ((2, two), (R0, many)):
        fns = {i: masses_fn(i, spec.block) for i in IMPLS}
        got = {i: [np.asarray(m) for m in fns[i](layers)] for i in IMPLS}
        err = max(float(np.max(np.abs(a - b))) for a, b in zip(got["native"], got["xla"]))
        contenders = {i: (lambda f=fns[i]: timed(lambda: f(layers))) for i in IMPLS}
        contenders["floor"] = lambda: timed(lambda: floor(keys))
        med = interleaved(contenders, reps)
        for i in IMPLS:
            rows.append(dict(step=f"block masses R={R}", implementation=i, ms=med[i] * 1e3, layers=len(dense),
                             slots=cap, rows=R, max_abs_diff_native_vs_xla=err, vs_floor=med[i] / med["floor"]))
        rows.append(dict(step=f"floor: jnp.sum over the keys (R={R} round)", ms=med["floor"] * 1e3,
                         bytes=sum(k.nbytes for k in keys)))
        summary[f"masses_R{R}_native_vs_xla"] = med["native"] / med["xla"]
        log(f"  block masses, {len(dense)} layers, R = {R:2d}: native {med['native'] * 1e3:7.2f} ms, "
            f"XLA {med['xla'] * 1e3:7.2f} ms ({med['xla'] / med['native']:.1f}x), floor (a sum over the "
            f"{sum(k.nbytes for k in keys) >> 20} MiB of keys) {med['floor'] * 1e3:.2f} ms, max |diff| {err:.2e}")

    steps_fn = {i: refresh_fn(i) for i in REFRESH_MASSES}
    # the native / XLA contenders score the queries themselves: the verify's own masses taken out of its aux
    scored_aux = (aux[0], aux[1], (None,) * len(aux[2]))

    def refresh_once(i):
        fresh = copy(dcache)  # donated by the step: a fresh copy each time, made outside the timed region
        return timed(lambda: steps_fn[i](fresh, full, aux if i == "verify" else scored_aux, family))

    def decode_once():
        fresh = copy(full)
        return timed(lambda: steps.decode(model.loop_params(), config, fresh, first, seed, num_steps=DECODE_STEPS, family=family,
                                          impl=impl)[0]) / DECODE_STEPS

    contenders = {f"refresh {i}": (lambda i=i: refresh_once(i)) for i in REFRESH_MASSES}
    contenders["decode"] = decode_once
    med = interleaved(contenders, reps)
    dec = med["decode"]
    rows.append(dict(step="full-cache decode", ms=dec * 1e3, per="token", slots=cap))
    log(f"  full-cache decode step {dec * 1e3:.2f} ms")
    for i in REFRESH_MASSES:
        r = med[f"refresh {i}"]
        rows.append(dict(step="re-selection (refresh_step)", implementation=i, ms=r * 1e3, decode_steps=r / dec,
                         slots=cap))
        log(f"  re-selection, {i:6s} masses: {r * 1e3:7.2f} ms = {r / dec:.2f} decode steps")
    summary["reselect_decode_steps"] = {i: med[f"refresh {i}"] / dec for i in REFRESH_MASSES}
    summary["reselect_native_vs_xla"] = med["refresh native"] / med["refresh xla"]
    return rows, summary


def bench_smollm2_shape(slots: int, reps: int, log, obs_window: int = 16, block: int = 16) -> list:
    """The masses alone at SmolLM2-135M's attention shape (30 layers, 9 / 3 heads, D = 64) on random arrays."""
    layers_n, N, K, D = 30, 9, 3, 64
    rng = np.random.default_rng(1)
    L = slots - 300
    kp = jnp.asarray(np.where(np.arange(slots) < L, np.arange(slots), -1)[None], jnp.int32)
    ks = [jnp.asarray(rng.normal(size=(1, K, slots, D)), jnp.float32) for _ in range(layers_n)]
    rows = []
    for R in (2, obs_window):
        qp = jnp.asarray(L - R + np.arange(R)[None], jnp.int32)
        layers = [(jnp.asarray(rng.normal(size=(1, R, N, D)), jnp.float32), k, qp, kp) for k in ks]
        fns = {i: masses_fn(i, block) for i in IMPLS}
        contenders = {i: (lambda f=fns[i]: timed(lambda: f(layers))) for i in IMPLS}
        floor = jax.jit(lambda ks: [jnp.sum(k) for k in ks])
        contenders["floor"] = lambda: timed(lambda: floor(ks))
        med = interleaved(contenders, reps)
        for i in IMPLS:
            rows.append(dict(step=f"block masses R={R} (SmolLM2-135M shape, random arrays)", implementation=i,
                             ms=med[i] * 1e3, layers=layers_n, slots=slots, rows=R, vs_floor=med[i] / med["floor"]))
        rows.append(dict(step=f"floor: jnp.sum over the keys (SmolLM2-135M shape, R={R} round)",
                         ms=med["floor"] * 1e3, bytes=sum(k.nbytes for k in ks)))
        log(f"  SmolLM2 shape, {layers_n} layers, {slots} slots, R = {R:2d}: native {med['native'] * 1e3:7.2f} ms, "
            f"XLA {med['xla'] * 1e3:7.2f} ms ({med['xla'] / med['native']:.1f}x), floor {med['floor'] * 1e3:.2f} ms")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/kvjax-code-tiny")
    ap.add_argument("--context", type=int, default=32768 - 512, help="prompt tokens (32K slots with the new tokens)")
    ap.add_argument("--reps", type=int, default=7, help="interleaved rounds; medians are reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smollm2-shape", action="store_true", help="also the masses alone at SmolLM2-135M's shape")
    ap.add_argument("--smollm2-slots", type=int, default=8192)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    log = lambda s: print(s, flush=True)  # noqa: E731
    model, name = load_bench_model(args.model, False)
    log(f"[bench] {name}, backend {jax.default_backend()}, {os.cpu_count()} CPUs, native: {native_status()}")
    prompt, source = heldout_prompts(model, name, args.context, 1, args.seed)
    rows, summary = bench_model(model, prompt[0], args.reps, log)
    if args.smollm2_shape:
        rows += bench_smollm2_shape(args.smollm2_slots, args.reps, log)
    if args.json:
        meta = dict(model=name, context=args.context, prompt_source=source, reps=args.reps, x=X,
                    statistic="median of interleaved rounds", native=native_status(), **run_meta())
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(meta=meta, summary=summary, records=rows), f, indent=1)
        log(f"[bench] json -> {args.json}")
    return rows, summary


if __name__ == "__main__":
    main()
