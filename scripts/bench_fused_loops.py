"""Benchmark: the one-token loops with the family's fused loop layout (`Family.loop_params`) vs without, one run.

For each context: full-cache decode (`steps.decode`, 32 steps) and a draft step (`draft_step`, x = 32, the
refreshing drafter's first selection) of the bundled checkpoint, each with and without `loop_params`, interleaved
`--reps` times (best of 3 calls each time); reports ms per token, the ratio, and whether the tokens agree.

Usage: python scripts/bench_fused_loops.py --context 64,8192,32768 --reps 5 --json docs/results/fused_loops_tiny.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvjax.decode import draft as draft_mod  # noqa: E402
from kvjax.decode import steps  # noqa: E402
from kvjax.decode.vericache import capacity_for  # noqa: E402
from bench_common import bench_prompts, best_of, load_bench_model, parse_contexts  # noqa: E402

STEPS = 32


def copy(tree):
    return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/kvjax-code-tiny")
    ap.add_argument("--context", default="64,8192,32768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    contexts = parse_contexts(ap, args.context, 64)
    model, name = load_bench_model(args.model, False)
    fam = model.family
    if fam.loop_params is None:
        sys.exit(f"the {fam.name} family has no loop_params: nothing to compare")
    modes = {"fused": fam, "unfused": dataclasses.replace(fam, loop_params=None)}
    params, cfg, impl = model.params, model.config, model.attention
    records = []
    for L in contexts:
        prompt = bench_prompts(model, L, 1, 0)[0][0]
        cache = fam.init_cache(cfg, 1, capacity_for(L, STEPS * 8, STEPS), model.cache_dtype)
        logits, cache = steps.prefill(model, cache, prompt)
        first = jnp.argmax(logits)[None].astype(jnp.int32)
        seed = jnp.zeros((1,), jnp.int32)
        dc0 = None
        if L >= 1024:
            dc0 = fam.make_compressor("refresh")(params, cfg, cache, prompt, recent_slots=256)
        copy_s = best_of(lambda: copy(cache), 3)
        times = {f"{k} {m}": [] for m in modes for k in ("decode", "draft") if k == "decode" or dc0 is not None}
        tokens = {}
        for m, f in modes.items():
            tokens[m] = np.asarray(steps.decode(params, cfg, copy(cache), first, seed, num_steps=STEPS, family=f,
                                                impl=impl)[0])
        for _ in range(args.reps):
            for m, f in modes.items():
                t = best_of(lambda: steps.decode(params, cfg, copy(cache), first, seed, num_steps=STEPS, family=f,
                                                 impl=impl)[0], 3)
                times[f"decode {m}"].append((t - copy_s) / STEPS)
                if dc0 is not None:
                    def one():  # the draft cache is donated: each call drafts from a fresh copy (timed apart)
                        return draft_mod.draft_step(params, cfg, copy(dc0), first, seed, x=STEPS, family=f,
                                                    impl=impl)[0]

                    jax.block_until_ready(one())
                    dc_copy = best_of(lambda: copy(dc0), 3)
                    times[f"draft {m}"].append((best_of(one, 3) - dc_copy) / STEPS)
        best = {k: min(v) * 1e3 for k, v in times.items()}
        rec = dict(context=L, ms_per_token=best, tokens_agree=bool((tokens["fused"] == tokens["unfused"]).all()),
                   decode_unfused_vs_fused=best["decode unfused"] / best["decode fused"])
        if dc0 is not None:
            rec["draft_unfused_vs_fused"] = best["draft unfused"] / best["draft fused"]
        records.append(rec)
        print(f"context {L}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in best.items())
              + f"; fused decode {rec['decode_unfused_vs_fused']:.2f}x faster"
              + (f", draft {rec['draft_unfused_vs_fused']:.2f}x" if dc0 is not None else "")
              + f"; tokens agree: {rec['tokens_agree']}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(dict(meta=dict(model=name, backend=jax.default_backend(), cpus=os.cpu_count(), steps=STEPS,
                                     reps=args.reps), records=records), fh, indent=1)
        print(f"[bench] json -> {args.json}")
    return records


if __name__ == "__main__":
    main()
