"""Benchmark: one attention layer by the native kernel, by XLA, and by PyTorch's fused CPU attention, interleaved.

Per shape (query rows x cache slots, the model's heads, f32, B = 1, the cache filled to `slots - 300` and the rows at
its end, causal among themselves): kvjax's native kernel (`pallas_kernels.attend(..., implementation="native")`, whatever
the model's dispatch picks for the shape), kvjax's XLA path
(`kvjax.models.attention.default_attention`), and `torch.nn.functional.scaled_dot_product_attention` (GQA, the
occupied keys only, an explicit causal mask for the rows, `torch.set_num_threads(threads)`). Each repetition times
every contender once in turn, so a load change on a shared machine hits them alike; the best of the repetitions is
reported, with the ratios native/XLA and native/PyTorch. `scripts/bench_short_verify.py` and
`scripts/bench_roofline.py` call `compare`.

Usage: python scripts/bench_attention_peers.py --rows 1,5,9,17,33,256 --slots 9216,36864 [--json out.json]
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common

import bench_common  # noqa: E402
import pallas_kernels  # noqa: E402
from kvjax.models import attention as attn  # noqa: E402

ROWS = (1, 5, 9, 17, 33, 256)
SLOTS = (9216, 36864)


def _torch_sdpa(threads: int):
    """(callable(q, k, v, mask) -> out, torch module) or (None, reason)."""
    try:
        import torch
    except ImportError as e:
        return None, f"torch not installed ({e})"
    torch.set_num_threads(threads)
    return torch, None


def compare(num_heads: int, num_kv_heads: int, head_dim: int, rows=ROWS, slots=SLOTS, reps: int = 5,
            threads: int = 2, log=print) -> list[dict]:
    """Per-layer ms of native / XLA / PyTorch SDPA for every (slots, rows), interleaved; one record per shape."""
    N, K, D = num_heads, num_kv_heads, head_dim
    torch, why = _torch_sdpa(threads)
    if torch is None:
        log(f"  [peers] PyTorch skipped: {why}")
    native_ok = pallas_kernels.native.available()
    if not native_ok:
        log(f"  [peers] native kernel unavailable: {pallas_kernels.native.status()['reason']}")
    # the arithmetic floor of each shape: its multiply-adds (D for the score and D for the value of each visible
    # (row, key) pair per query head) at the machine's rate on `threads` threads, measured here
    rate = bench_common.multiply_add_rate(threads)
    rng = np.random.default_rng(0)
    out = []
    for S in slots:
        k_np = rng.standard_normal((1, K, S, D)).astype(np.float32)
        v_np = rng.standard_normal((1, K, S, D)).astype(np.float32)
        k, v = jnp.asarray(k_np), jnp.asarray(v_np)
        L = S - 300
        kpos = jnp.where(jnp.arange(S) < L, jnp.arange(S), -1)[None].astype(jnp.int32)
        for T in rows:
            q_np = rng.standard_normal((1, T, N, D)).astype(np.float32)
            q = jnp.asarray(q_np)
            qpos = (L - T + jnp.arange(T))[None].astype(jnp.int32)
            fns = {"xla": jax.jit(lambda q: attn.attention(q, k, v, qpos, kpos, implementation="xla"))}
            if native_ok:
                # the kernel itself (not `attention`, whose dispatch may hand this shape to XLA)
                fns["native"] = jax.jit(lambda q: pallas_kernels.attend(q, k, v, qpos, kpos, implementation="native"))
            calls = {name: (lambda f=f: jax.block_until_ready(f(q))) for name, f in fns.items()}
            if torch is not None:
                tq = torch.from_numpy(np.ascontiguousarray(q_np.transpose(0, 2, 1, 3)))
                tk = torch.from_numpy(np.ascontiguousarray(k_np[:, :, :L]))
                tv = torch.from_numpy(np.ascontiguousarray(v_np[:, :, :L]))
                # row t (position L - T + t) sees keys 0 .. L - T + t
                mask = None if T == 1 else torch.from_numpy(
                    np.arange(L)[None, :] <= (L - T + np.arange(T))[:, None])

                def sdpa(tq=tq, tk=tk, tv=tv, mask=mask):
                    with torch.no_grad():
                        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask,
                                                                                enable_gqa=True)
                calls["torch_sdpa"] = sdpa
            for c in calls.values():  # compile / warm up
                c()
            times = {name: [] for name in calls}
            for _ in range(reps):
                for name, c in calls.items():
                    t0 = time.perf_counter()
                    c()
                    times[name].append(time.perf_counter() - t0)
            rec = dict(heads=N, kv_heads=K, head_dim=D, slots=S, rows=T,
                       **{f"{n}_ms": min(t) * 1e3 for n, t in times.items()})
            if rate:
                seen = bench_common.causal_keys_seen(T, L - T + 1)  # row t sees keys 0 .. L - T + t
                macs = bench_common.attention_multiply_adds(N, D, seen)
                rec.update(multiply_adds_per_s=rate, multiply_add_floor_ms=macs / rate * 1e3)
                if "native_ms" in rec:
                    rec["native_over_floor"] = rec["native_ms"] / rec["multiply_add_floor_ms"]
            if "native_ms" in rec:
                rec["native_over_xla"] = rec["native_ms"] / rec["xla_ms"]
                if "torch_sdpa_ms" in rec:
                    rec["native_over_torch"] = rec["native_ms"] / rec["torch_sdpa_ms"]
            log(f"  attention per layer, {S} slots, {T:3d} rows: " + ", ".join(
                f"{n} {min(t) * 1e3:7.2f} ms" for n, t in times.items())
                + (f"  native/xla {rec['native_over_xla']:.2f}" if "native_over_xla" in rec else "")
                + (f"  native/torch {rec['native_over_torch']:.2f}" if "native_over_torch" in rec else "")
                + (f"  native/multiply-add floor {rec['native_over_floor']:.2f}" if "native_over_floor" in rec else ""))
            out.append(rec)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="8,4,32", help="N,K,D (default: the bundled checkpoint's)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--slots", default=",".join(map(str, SLOTS)))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="PyTorch threads")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        N, K, D = (int(a) for a in args.heads.split(","))
        rows = [int(a) for a in args.rows.split(",")]
        slots = [int(a) for a in args.slots.split(",")]
    except ValueError:
        ap.error("--heads, --rows and --slots take comma-separated integers")
    print(f"[bench] native: {pallas_kernels.native.status()}", flush=True)
    recs = compare(N, K, D, rows, slots, args.reps, args.threads, log=lambda s: print(s, flush=True))
    if args.json:
        import platform

        meta = dict(bench_common.run_meta([__file__, *(sys.argv[1:] if argv is None else argv)]),
                    native=bench_common.native_status(), machine=platform.machine(),
                    dispatch=dict(native_max_rows=attn.NATIVE_MAX_ROWS, native_min_slots=attn.NATIVE_MIN_SLOTS))
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, records=recs), f, indent=1)


if __name__ == "__main__":
    main()
