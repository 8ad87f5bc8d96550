"""Benchmark: one-shot vs blocked XLA attention by query rows, and the verify step with each, in one run.

Why: `kvjax.models.attention.default_attention` attends in one shot up to `ONE_SHOT_MAX_ROWS` query rows and in the
blocked online-softmax loop above; this measures both sides of that rule on the bundled model's shape.
  1. per layer: `attend` vs `attend_blocked` for each row count and cache size (random keys, the model's heads);
  2. the whole verify step (`decode.verify.verify_step`) of the bundled checkpoint at each draft length, with the
     rule as shipped and with every row count blocked, interleaved (the jit caches are cleared between the modes);
     one full-cache decode step for scale.

Usage: python scripts/bench_short_verify.py --context 16384 --draft-lens 2,4,8 --rows 1,3,5,9,17,33
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvjax  # noqa: E402
from kvjax.decode import steps, vericache  # noqa: E402
from kvjax.decode import verify as verify_mod  # noqa: E402
from kvjax.models import attention as attn  # noqa: E402
from bench_common import best_of  # noqa: E402


def best_ms(fn, reps: int) -> float:
    """Best of `reps` timed calls after one untimed (compiling) call, in ms."""
    jax.block_until_ready(fn())
    return best_of(fn, reps) * 1e3


def per_layer(config, slots: int, rows: list[int], reps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    K, N, D = config.num_kv_heads, config.num_heads, config.head_dim
    k, v = (jnp.asarray(rng.standard_normal((1, K, slots, D)), jnp.float32) for _ in range(2))
    L = slots - 300
    kpos = jnp.where(jnp.arange(slots) < L, jnp.arange(slots), -1)[None].astype(jnp.int32)
    out = []
    for T in rows:
        q = jnp.asarray(rng.standard_normal((1, T, N, D)), jnp.float32)
        qpos = (L - T + jnp.arange(T))[None].astype(jnp.int32)
        one = jax.jit(lambda q: attn.attend(q, k, v, qpos, kpos))
        blk = jax.jit(lambda q: attn.attend_blocked(q, k, v, qpos, kpos, block=attn.BLOCK))
        rec = dict(slots=slots, rows=T, one_shot_ms=best_ms(lambda: one(q), reps),
                   blocked_ms=best_ms(lambda: blk(q), reps))
        print(f"  attention per layer, {slots} slots, {T:3d} rows: one-shot {rec['one_shot_ms']:7.2f} ms, "
              f"blocked {rec['blocked_ms']:7.2f} ms", flush=True)
        out.append(rec)
    return out


def verify_steps(model, context: int, draft_lens: list[int], rounds: int) -> dict:
    cfg, fam = model.config, model.family
    prompt = np.random.default_rng(1).integers(5, cfg.vocab_size, context - 300).astype(np.int32)
    full, first = vericache.prefill_for(model, prompt, 256, max_draft=max(draft_lens))
    seed = jnp.zeros((1,), jnp.int32)
    qlog = jnp.zeros((1, 1, cfg.vocab_size), jnp.float32)

    def copy():
        return jax.block_until_ready(jax.tree.map(jnp.copy, full))

    def verify_ms(x):
        drafts = jnp.zeros((1, x), jnp.int32)
        times = []
        for _ in range(4):
            c = copy()
            t0 = time.perf_counter()
            jax.block_until_ready(verify_mod.verify_step(model.params, cfg, c, None, first, drafts, qlog, seed,
                                                         family=fam, impl=model.attention)[0])
            times.append(time.perf_counter() - t0)
        return min(times[1:]) * 1e3  # the first call compiles

    shipped = attn.ONE_SHOT_MAX_ROWS
    res = {}
    for _ in range(rounds):  # interleaved: a load change on the shared machine hits both modes alike
        for mode, rows in (("shipped", shipped), ("all_blocked", 0)):
            attn.ONE_SHOT_MAX_ROWS = rows
            jax.clear_caches()
            for x in draft_lens:
                res.setdefault(f"{mode} x={x}", []).append(verify_ms(x))
    attn.ONE_SHOT_MAX_ROWS = shipped
    jax.clear_caches()

    def decode():
        return steps.decode(model.params, cfg, copy(), first, seed, num_steps=32, family=fam, impl=model.attention)[0]

    res["decode step"] = [best_ms(decode, 2) / 32]
    for name, v in res.items():
        print(f"  {name:18s} {min(v):7.2f} ms  (runs: {', '.join(f'{a:.2f}' for a in v)})", flush=True)
    return {k: min(v) for k, v in res.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/kvjax-code-tiny")
    ap.add_argument("--context", type=int, default=16384, help="prompt bucket of the verify-step timing")
    ap.add_argument("--draft-lens", default="2,4,8")
    ap.add_argument("--rows", default="1,3,5,9,17,33", help="query rows of the per-layer timing")
    ap.add_argument("--slots", default="9216,36864", help="cache sizes of the per-layer timing")
    ap.add_argument("--rounds", type=int, default=3)
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
    print(f"[bench] {args.model}; one-shot up to {attn.ONE_SHOT_MAX_ROWS} rows as shipped", flush=True)
    for s in slots:
        per_layer(model.config, s, rows, reps=5)
    verify_steps(model, args.context, xs, args.rounds)


if __name__ == "__main__":
    main()
