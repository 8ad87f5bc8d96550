"""Benchmark the prefix cache: lookup latency vs prefix length, restore vs recompute, hit rate vs an oracle.

    python scripts/bench_prefix_cache.py --model checkpoints/kvjax-code-tiny --json docs/results/prefix_cache_tiny.json
    (--quick: small sizes; without --model, a tiny random Llama)

1. lookup + plan latency for 16K..128K-token cached prefixes (metadata only: the forms are synthetic);
2. restore time (device / host / store tiers) vs recomputing a 16K-token prefix, with a Llama-family model
   (a tiny random one unless --model names a checkpoint directory);
3. tokens reused on a shared-prefix workload (system prompts + multi-turn follow-ups) vs an oracle that reuses the
   longest block-aligned common prefix with any earlier request.

Prints a table and writes JSON records carrying prefix_tokens, lookup_ms, tier and speedup_vs_recompute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvjax.cache.dense import DenseKV, ModelCache, WindowKV
from kvjax.cache.capacity import pick_capacity
from kvjax.decode import steps
from kvjax.prefix.identity import make_namespace
from kvjax.families import forms_for
from kvjax.prefix.manager import PrefixCache
from kvjax.prefix.prefill import kv_dtype, model_namespace, prefill_with_prefix_cache
from kvjax.models.llama.config import ModelConfig
from kvjax.models.rope import RopeConfig
from bench_common import random_model  # noqa: E402
from kvjax.models.layer_types import FULL, SLIDING


def tiny_config(layer_types, *, window: int, kv_heads: int = 2, heads: int = 4, head_dim: int = 16,
                hidden: int = 64) -> ModelConfig:
    """A tiny random-weights Llama config (the lookup benchmark needs only its shapes)."""
    return ModelConfig(family="llama", vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_layers=len(layer_types), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       rms_norm_eps=1e-5, rope=RopeConfig(theta=10000.0), layer_types=tuple(layer_types),
                       sliding_window=window, max_position_embeddings=1 << 17)


def synthetic_cache(cfg, n, cap):
    K, D, W = cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window
    length = jnp.asarray([n], jnp.int32)
    layers = []
    for t in cfg.layer_types:
        if t == SLIDING:
            layers.append(WindowKV(k=jnp.ones((1, K, W, D)), v=jnp.ones((1, K, W, D)), seen=length, window=W))
        else:
            layers.append(DenseKV(k=jnp.ones((1, K, cap, D)), v=jnp.ones((1, K, cap, D)), length=length))
    return ModelCache(layers=tuple(layers), length=length)


def bench_lookup(lengths, P, reps):
    cfg = tiny_config((FULL, SLIDING), window=128, kv_heads=1, heads=1, head_dim=2, hidden=8)
    forms = forms_for(cfg, np.float32, P)
    ns = make_namespace(cfg, weights="synthetic", kv_dtype="float32",
                        formats={s.name: s.fingerprint for s in forms.specs}, block_size=P)
    out = []
    for n in lengths:
        n = min(n, 131072 - P)  # the prompt (prefix + 1 token) must fit the largest capacity bucket
        pc = PrefixCache(forms, device_bytes=64 << 20, host_bytes=0)
        rng = np.random.default_rng(n)
        toks = rng.integers(0, 50000, n + 1).astype(np.int32)
        cache = synthetic_cache(cfg, n, pick_capacity(n + 1))
        snap = forms.snapshot(cache)
        pc.insert(ns, toks[:n], cache, {e: snap for e in [*range(256, n + 1, 256), n]})
        # a second, diverging request so the tree has a split
        pc.insert(ns, np.concatenate([toks[: n // 2], toks[n // 2:n] + 1]), cache, {})
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            plan = pc.lookup(ns, toks)
            times.append((time.perf_counter() - t0) * 1e3)
            plan.lease.release()
        assert plan.boundary == n, plan.summary()
        out.append(dict(kind="lookup", prefix_tokens=n, block_size=P, blocks=n // P,
                        lookup_ms=statistics.median(times), lookup_ms_p90=sorted(times)[int(0.9 * len(times))],
                        tier="device"))
    return out


def _timed(fn, reps):
    jax.block_until_ready(fn())  # warm-up: compiles are not timed
    best = None
    for _ in range(reps):
        t0 = time.perf_counter()
        r = fn()
        jax.block_until_ready(r)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best, r


def bench_restore(model, n, P, chunk, reps):
    prompt = np.random.default_rng(7).integers(0, model.config.vocab_size, n + 1).astype(np.int32)
    cap = pick_capacity(n + 1)
    dt = kv_dtype(model)
    forms = forms_for(model.config, dt, P)

    def recompute(k=n):
        # the same chunked prefill a cold request runs
        cache = forms.new_cache(cap)
        for s in range(0, k, chunk):
            part = prompt[s:min(k, s + chunk)]
            buf = np.zeros((1, chunk), np.int32)
            buf[0, :part.size] = part
            _, _, cache = steps.prefill_chunk(model.params, model.config, cache, jnp.asarray(buf),
                                              jnp.asarray([part.size], jnp.int32), family=model.family,
                                              impl=model.attention)
        return cache.length

    jax.block_until_ready(recompute(chunk))  # compile on one chunk (same shapes), then time the whole prefix once
    t0 = time.perf_counter()
    jax.block_until_ready(recompute())
    steps_t = time.perf_counter() - t0
    out = []
    tmp = tempfile.mkdtemp()
    big = 4 << 30
    configs = [("device", dict(device_bytes=big, host_bytes=0)), ("host", dict(device_bytes=0, host_bytes=big)),
               ("store", dict(device_bytes=0, host_bytes=0, store_url=os.path.join(tmp, "store")))]
    for tier, kw in configs:
        pc = PrefixCache(forms, **kw)
        prefill_with_prefix_cache(model, prompt, pc, capacity=cap, chunk=chunk)
        pc.flush()
        if tier == "store":
            pc = PrefixCache(forms, **kw)  # a restarted process: only the store has the prefix
        ns = model_namespace(model, pc)

        def restore():
            plan = pc.lookup(ns, prompt)
            cache, plan = pc.execute(plan, forms.new_cache(cap))
            plan.lease.release()
            assert plan.boundary > 0 and set(plan.forms[pc.forms.specs[0].name].used) == {tier}, plan.summary()
            return cache.length

        t, _ = _timed(restore, reps)
        plan = pc.lookup(ns, prompt)
        plan.lease.release()
        out.append(dict(kind="restore", prefix_tokens=n, restored_tokens=plan.boundary, tier=tier, block_size=P,
                        restore_ms=t * 1e3, recompute_ms=steps_t * 1e3, speedup_vs_recompute=steps_t / t,
                        lookup_ms=plan.lookup_ms,
                        bytes=sum(s.nbytes for s in pc.forms.specs if s.kind == "path") * (plan.boundary // P)))
    return out


def bench_hit_rate(model, P, chunk, requests, seed=0):
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    systems = [rng.integers(0, V, int(rng.integers(300, 1200))) for _ in range(4)]
    prompts, history = [], []
    for _ in range(requests):
        if history and rng.random() < 0.4:  # a follow-up turn: previous prompt + an answer + a new question
            prev = history[int(rng.integers(len(history)))]
            p = np.concatenate([prev, rng.integers(0, V, int(rng.integers(20, 120)))])
        else:
            p = np.concatenate([systems[int(rng.integers(4))], rng.integers(0, V, int(rng.integers(30, 200)))])
        p = p[:2000].astype(np.int32)
        prompts.append(p)
        history.append(p)
    pc = PrefixCache(forms_for(model.config, kv_dtype(model), P), device_bytes=1 << 30, host_bytes=0)
    got = oracle = total = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            m = min(len(p), len(q))
            neq = np.nonzero(p[:m] != q[:m])[0]
            best = max(best, int(neq[0]) if neq.size else m)
        oracle += min((best // P) * P, len(p) - 1)
        _, _, plan = prefill_with_prefix_cache(model, p, pc, capacity=2048, chunk=chunk)
        got += plan.boundary
        total += len(p)
    return [dict(kind="hit_rate", requests=requests, prompt_tokens=total, reused_tokens=got, oracle_tokens=oracle,
                 hit_rate=got / total, oracle_hit_rate=oracle / total, vs_oracle=got / max(oracle, 1),
                 layer_types=list(model.config.layer_types), block_size=P, chunk=chunk)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="output path for the JSON records")
    ap.add_argument("--model", default=None, help="model directory (default: a tiny random Llama)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per block P (default: the family's, 64 for Llama)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--restore-tokens", type=int, default=16384)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = ap.parse_args()
    P = args.block_size or 64
    lengths = [1024, 4096] if args.quick else [16384, 32768, 65536, 131072]
    records = bench_lookup(lengths, P, reps=5 if args.quick else 30)
    if args.model:
        from kvjax.api import load

        model = load(args.model)
    else:
        model = random_model(tiny_config((FULL, SLIDING, FULL), window=128))
    n = 2048 if args.quick else args.restore_tokens
    Pm = forms_for(model.config, kv_dtype(model), args.block_size).block_size
    records += bench_restore(model, n, Pm, args.chunk, reps=1 if args.quick else 2)
    records += bench_hit_rate(model, Pm, args.chunk, requests=8 if args.quick else 24)
    model_name = args.model or "tiny random llama (full, sliding W=128, full; H=64, K=2, D=16)"
    for r in records:
        r["model"] = model_name
        r["backend"] = jax.default_backend()
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(records, f, indent=1)
    for r in records:
        if r["kind"] == "lookup":
            print(f"lookup   {r['prefix_tokens']:>7} tokens ({r['blocks']} blocks): {r['lookup_ms']:.3f} ms median")
        elif r["kind"] == "restore":
            print(f"restore  {r['restored_tokens']:>7} tokens from {r['tier']:<6}: {r['restore_ms']:.1f} ms vs "
                  f"recompute {r['recompute_ms']:.1f} ms -> {r['speedup_vs_recompute']:.1f}x")
        else:
            print(f"hit rate {r['hit_rate']:.3f} vs oracle {r['oracle_hit_rate']:.3f} "
                  f"({r['vs_oracle']:.3f} of the oracle) over {r['requests']} requests")


if __name__ == "__main__":
    main()
