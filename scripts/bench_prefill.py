"""Benchmark: prompt prefill, kvjax as shipped vs its earlier form vs transformers, interleaved in one run.

Contenders, on the same checkpoint and held-out prompt, each run `--reps` times in turn:
  - kvjax: `steps.prefill` as shipped (1024-token chunks while that many tokens remain, then 256-token ones; key
    blocks of `PREFILL_BLOCK` for chunk-sized queries; the vocabulary projection of the last row only);
  - kvjax (before): 256-token chunks with every row's logits computed and 1024-slot key blocks (the form before
    `PREFILL_BLOCK`; the jit caches are cleared between the two);
  - transformers: Hugging Face `LlamaForCausalLM` in PyTorch (CPU, f32, eager), one forward over the prompt with a
    `DynamicCache`, as a user would prefill.
Reports tokens/s (best of the reps) and the ratios; `--json` writes them.

Usage: python scripts/bench_prefill.py --context 8192,32768 --reps 2 --json docs/results/prefill_tiny.json
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

from kvjax.decode import steps  # noqa: E402
from kvjax.decode.vericache import capacity_for  # noqa: E402
from kvjax.models import attention as attn  # noqa: E402
from bench_common import bench_prompts, load_bench_model, parse_contexts, run_meta, transformers_model  # noqa: E402


def kvjax_prefill(model, prompt, before: bool, capacity: int | None = None) -> float:
    """Seconds one prefill of `prompt` takes into a cache of `capacity` slots (default: `prompt`'s own bucket)."""
    capacity = capacity or capacity_for(prompt.size, 256, 32)
    cache = model.family.init_cache(model.config, 1, capacity, model.cache_dtype)
    if not before:  # as shipped: `steps.prefill` (bulk chunks, then DEFAULT_CHUNK pieces)
        t = time.perf_counter()
        jax.block_until_ready(steps.prefill(model, cache, prompt))
        return time.perf_counter() - t
    chunk = steps.DEFAULT_CHUNK
    t = time.perf_counter()
    for start in range(0, prompt.size, chunk):
        part = prompt[start:start + chunk]
        buf = np.zeros((1, chunk), np.int32)
        buf[0, :part.size] = part
        last, _, cache = steps.prefill_chunk(model.params, model.config, cache, jnp.asarray(buf),
                                             jnp.asarray([part.size], jnp.int32), family=model.family,
                                             impl=model.attention, all_logits=before)
    jax.block_until_ready((last, cache))
    return time.perf_counter() - t


SHIPPED_BLOCK = attn.PREFILL_BLOCK


def set_mode(before: bool):
    attn.PREFILL_BLOCK = attn.BLOCK if before else SHIPPED_BLOCK
    jax.clear_caches()


def transformers_prefill(hf, prompt) -> float:
    import torch
    from transformers import DynamicCache

    ids = torch.tensor(prompt[None, :].astype(np.int64))
    with torch.no_grad():
        t = time.perf_counter()
        hf(ids, past_key_values=DynamicCache(), use_cache=True)
        return time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/kvjax-code-tiny")
    ap.add_argument("--context", default="8192,32768", help="comma-separated prompt lengths")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-peers", action="store_true", help="skip transformers")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    contexts = parse_contexts(ap, args.context, steps.DEFAULT_CHUNK)
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    model, name = load_bench_model(args.model, False)
    hf = None
    if not args.no_peers:
        try:
            import torch

            torch.set_num_threads(max(1, os.cpu_count() or 1))
            hf = transformers_model(args.model)  # a GGUF model from its file, as kvjax loads it
        except (ImportError, OSError) as e:
            print(f"[bench] transformers: skipped ({e})")
    records = []
    for L in contexts:
        prompt = bench_prompts(model, L, 1, 0)[0][0]
        times = {"kvjax": [], "kvjax (before)": [], "transformers": []}
        for _ in range(args.reps):
            for mode, before in (("kvjax", False), ("kvjax (before)", True)):
                set_mode(before)
                # compile: one chunk into a cache of the timed run's capacity (the cache's shape is part of what a
                # chunk's program is compiled for; a smaller warm-up cache left the timed run compiling)
                kvjax_prefill(model, prompt[:steps.BULK_CHUNK + 1], before, capacity_for(prompt.size, 256, 32))
                times[mode].append(kvjax_prefill(model, prompt, before))
            if hf is not None:
                transformers_prefill(hf, prompt[:256])
                times["transformers"].append(transformers_prefill(hf, prompt))
        set_mode(False)
        best = {k: min(v) for k, v in times.items() if v}
        rec = dict(context=L, seconds={k: v for k, v in times.items() if v},
                   tokens_per_s={k: L / s for k, s in best.items()},
                   shipped_vs_before=best["kvjax (before)"] / best["kvjax"])
        if "transformers" in best:
            rec["kvjax_vs_transformers"] = best["transformers"] / best["kvjax"]
        records.append(rec)
        print(f"context {L}: " + ", ".join(f"{k} {L / s:.0f} tokens/s" for k, s in best.items())
              + f"; shipped {rec['shipped_vs_before']:.2f}x before"
              + (f", {rec['kvjax_vs_transformers']:.2f}x transformers" if "transformers" in best else ""),
              flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(meta=dict(model=name, chunk=steps.DEFAULT_CHUNK, bulk_chunk=steps.BULK_CHUNK,
                                     prefill_block=SHIPPED_BLOCK, reps=args.reps, **run_meta()),
                           records=records), f, indent=1)
        print(f"[bench] json -> {args.json}")
    return records


if __name__ == "__main__":
    main()
