"""Benchmark: remote prefix caching — fetch-full-then-decode vs draft-first VeriCache, side by side in one run.

For every (context length, link bandwidth) pair a held-out prefix of that length is prefilled once and stored (full
cache, last logits, one draft cache — KVzip-style by default, built once at store time) in a TensorStore `file://`
store; the store client's `Link` models a remote link of the given bandwidth (reads are delayed so bytes/s <= cap;
see `kvjax.remote.link`). Contenders:
  - full-fetch:           fetch logits + the whole full cache over the link, then plain one-token greedy decoding
                          (`steps.greedy_decode`, the fastest full-cache decoder); first token after the fetch;
  - draft-first:          fetch logits + the draft cache, emit the first token, draft while the full cache streams
                          in layer order, verify every token (`kvjax.remote.draft_first`);
  - full-fetch+vericache: (with --with-fetch-vericache) fetch the whole full cache, then resident VeriCache — shows
                          how much of the gain is VeriCache itself and how much is overlapping the fetch.
Every contender is timed from the request to its last token (fetch included). identical_fraction compares with
kvjax's verify-shape reference decoder (`vericache.reference_decode`). Each contender is warmed up once (compiles)
before the timed runs; with --repeats N, ttft_s and tokens_per_s are medians over N runs (all runs are in
the JSON) and identical_fraction is the worst run's (the CPU is shared).

Usage: python scripts/bench_remote_prefix.py --context 16384 32768 --new-tokens 256 --link-gbps 1 3 --json out.json
       (--random: a randomly initialised model of the checkpoint's shape when no trained checkpoint exists)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kvjax  # noqa: E402
from bench_common import random_model_like  # noqa: E402
from kvjax.decode import vericache as vc  # noqa: E402
from kvjax.remote import Link, RemoteStore  # noqa: E402
from kvjax.remote import draft_first as df  # noqa: E402


def load_model(checkpoint: str, random: bool):
    """The trained checkpoint, or a random model of its shape."""
    return random_model_like(checkpoint) if random else kvjax.load(checkpoint)


def get_prompt(model, n_tokens: int, seed: int):
    if model.tokenizer is not None:
        try:
            from kvjax.data import corpus

            return np.asarray(corpus.long_prompts(model.tokenizer, n_tokens, 1, seed)[0], np.int32), "heldout corpus"
        except Exception as e:  # noqa: BLE001 - fall back loudly
            print(f"[bench] long_prompts unavailable ({type(e).__name__}: {e}); using random token ids")
    rng = np.random.default_rng(seed)
    return rng.integers(0, model.config.vocab_size, n_tokens).astype(np.int32), "random ids"


def run_one(name, model, store, prompt, M, args):
    draft = dict(compressor=args.compressor, compressor_kw={"ratio": args.ratio}, recent_slots=args.recent_slots,
                 draft_len=args.draft_len)
    if name == "full-fetch":
        return df.serve_full_fetch(model, store, prompt, M, draft_len=args.draft_len, decoder="plain")
    if name == "full-fetch+vericache":
        return df.serve_full_fetch(model, store, prompt, M, draft_len=args.draft_len,
                                   decoder=f"vericache:{args.compressor}")
    return df.serve_draft_first(model, store, prompt, M, max_ahead=args.max_ahead, **draft)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=os.path.join(os.path.dirname(__file__), "..", "checkpoints",
                                                         "kvjax-code-tiny"))
    ap.add_argument("--random", action="store_true", help="random weights of the checkpoint's shape")
    ap.add_argument("--context", type=int, nargs="+", default=[16384, 32768], help="prefix lengths (tokens)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--link-gbps", type=float, nargs="+", default=[1.0, 3.0],
                    help="link bandwidths in GB/s (gigaBYTES per second, 1e9 B/s), modelled by kvjax.remote.Link")
    ap.add_argument("--compressor", default="kvzip",
                    help="draft compressor (built once, when the prefix is stored: KVzip's extra prefill is amortized)")
    ap.add_argument("--ratio", type=float, default=4.0, help="draft compression ratio (full tokens / kept)")
    ap.add_argument("--draft-len", type=int, default=8)
    ap.add_argument("--max-ahead", type=int, default=None,
                    help="most tokens drafted before the full cache arrives (default: one round of x)")
    ap.add_argument("--recent-slots", type=int, default=256)
    ap.add_argument("--chunk-mb", type=float, default=4.0, help="store chunk size (the link's pacing unit)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per contender; the best is kept")
    ap.add_argument("--with-fetch-vericache", action="store_true")
    ap.add_argument("--store", default=None, help="store directory (default: a temporary one, removed after)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    model = load_model(args.checkpoint, args.random)
    M = args.new_tokens
    root = args.store or tempfile.mkdtemp(prefix="kvjax-remote-")
    names = ["full-fetch", "draft-first"] + (["full-fetch+vericache"] if args.with_fetch_vericache else [])
    records, runs = [], []
    try:
        for ctx in args.context:
            prompt, source = get_prompt(model, ctx, args.seed)
            setup = RemoteStore(root, chunk_bytes=int(args.chunk_mb * (1 << 20)))
            t = time.perf_counter()
            info = df.store_prefix(model, setup, prompt, drafts=((args.compressor, {"ratio": args.ratio}),),
                                   recent_slots=args.recent_slots, max_new_tokens=M, max_draft=args.draft_len)
            store_s = time.perf_counter() - t
            ref = vc.reference_decode(model, prompt, M, draft_len=args.draft_len)
            for name in names:  # warm-up: compile every step shape once, uncapped
                run_one(name, model, setup, prompt, M, args)
            dbytes = info["draft_bytes"][info["drafts"][0]]
            print(f"[bench] context {ctx} ({source}): full cache {info['full_bytes'] / 1e6:.1f} MB, draft "
                  f"{dbytes / 1e6:.1f} MB, stored in {store_s:.1f}s")
            for gbps in args.link_gbps:
                recs, all_tries = {}, {name: [] for name in names}
                for _ in range(args.repeats):  # contenders interleaved, so load drift on the shared CPU hits all
                    for name in names:
                        store = RemoteStore(root, link=Link(gbytes_per_s=gbps),
                                            chunk_bytes=int(args.chunk_mb * (1 << 20)))
                        toks, st = run_one(name, model, store, prompt, M, args)
                        st["link_bytes"], st["link_busy_s"] = store.link.bytes, store.link.busy_s
                        st["identical_fraction"] = float(np.mean(toks == ref))
                        all_tries[name].append(st)
                for name in names:
                    tries = all_tries[name]
                    st = sorted(tries, key=lambda t: t["total_s"])[len(tries) // 2]  # the median run
                    rec = dict(name=name, context=ctx, link_gbps=gbps, new_tokens=M,
                               ttft_s=float(np.median([t["ttft_s"] for t in tries])),
                               tokens_per_s=float(np.median([t["tokens_per_s"] for t in tries])),
                               identical_fraction=min(t["identical_fraction"] for t in tries),
                               ttft_s_runs=[t["ttft_s"] for t in tries],
                               tokens_per_s_runs=[t["tokens_per_s"] for t in tries],
                               total_s=st["total_s"], full_arrival_s=st.get("full_arrival_s"), source=st["source"],
                               full_bytes=info["full_bytes"], draft_bytes=dbytes, link_bytes=st["link_bytes"],
                               link_busy_s=st["link_busy_s"], reasons=st.get("reasons", []))
                    for k in ("head_s", "drafted_ahead", "accepted_ahead", "verifications", "mean_accepted_per_round",
                              "ahead_s"):
                        if k in st:
                            rec[k] = st[k]
                    if "vericache" in st:
                        rec["mean_accepted_per_round"] = st["vericache"]["mean_accepted_per_round"]
                    recs[name] = rec
                    records.append(rec)
                ff, dfr = recs["full-fetch"], recs["draft-first"]
                run = dict(context=ctx, link_gbps=gbps, ttft_speedup=ff["ttft_s"] / dfr["ttft_s"],
                           throughput_speedup=dfr["tokens_per_s"] / ff["tokens_per_s"],
                           identical_fraction=dfr["identical_fraction"])
                runs.append(run)
                for r in recs.values():
                    print(f"  {ctx:6d} tok {gbps:4.1f} GB/s  {r['name']:22s} ttft {r['ttft_s'] * 1e3:8.1f} ms  "
                          f"{r['tokens_per_s']:7.1f} tok/s  identical {r['identical_fraction']:.3f}  "
                          f"full arrives {1e3 * (r['full_arrival_s'] or 0):7.1f} ms  "
                          f"acc/round {r.get('mean_accepted_per_round', float('nan')):.2f}")
                print(f"  -> draft-first vs full-fetch: first token {run['ttft_speedup']:.2f}x sooner, "
                      f"throughput {run['throughput_speedup']:.2f}x, identity {run['identical_fraction']:.3f}")
    finally:
        if args.store is None:
            shutil.rmtree(root, ignore_errors=True)
    # the checkpoint as a path inside the repository (results name no path of the machine they ran on)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ckpt = os.path.relpath(os.path.abspath(args.checkpoint), repo)
    out = dict(model=dict(path=None if args.random else ckpt, random=args.random,
                          config=json.loads(model.config.to_json())),
               settings={**{k: v for k, v in vars(args).items() if k not in ("json", "store")}, "checkpoint": ckpt},
               contenders=records, runs=runs, jax_backend=jax.default_backend())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"[bench] wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
