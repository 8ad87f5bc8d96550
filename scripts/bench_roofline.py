"""Benchmark: every step kind against its memory floor, and kvjax against what a user would run instead, one run.

For each context length, on one held-out prompt of the checkpoint's corpus:
  - prefill (tokens/s), full-cache decode (ms/token), the draft step of each compressor (ms/token), the verify at
    x = 8 and x = 32 (ms per verify, and in full-cache decode steps), the offloaded verify's host->device transfer;
  - for each: the bytes the step must read, the measured time, the floor = one XLA reduction (`jnp.sum`) over the same
    number of bytes measured in the same run, and the ratio time / floor;
  - the compression of the prompt into each draft cache, as a fraction of the prompt's prefill time;
  - peers on the same checkpoint and prompt: Hugging Face transformers (PyTorch CPU, eager `generate`: prefill
    tokens/s, decode ms/token) and llama.cpp's `llama-bench` (`--llama-bench PATH` or on PATH) on a GGUF f32 export
    of the checkpoint (`gguf_export.py`) — otherwise skipped with the reason printed. For a GGUF model (a named one,
    e.g. `--model smollm2-135m-instruct`, or a .gguf file) transformers reads the GGUF itself and llama.cpp's f32
    peer runs the file with every tensor dequantised (the weights kvjax computes with); `--gguf FILE` adds the file
    as shipped (e.g. Q4_1).
Prints a table, writes JSON (one record per step and context) and a plot of ms/token vs context (kvjax decode, its
floor, the peers).

Usage: python scripts/bench_roofline.py --context 8192 --json docs/results/roofline_tiny_8k.json [--llama-bench PATH]
       (--compressors streaming,kivi4 to keep a run short; --random for a random-weight model of the same shape)
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
from kvjax.cache.capacity import CAPACITY_BUCKETS, pick_capacity  # noqa: E402
from kvjax.decode import draft as draft_mod  # noqa: E402
from kvjax.decode import offload as offl  # noqa: E402
from kvjax.decode import steps  # noqa: E402
from kvjax.decode import verify as verify_mod  # noqa: E402
from kvjax.decode.vericache import capacity_for  # noqa: E402
from bench_attention_peers import compare as attention_peers  # noqa: E402
from bench_common import (STATIC_DRAFTERS, add_model_args, best_of, gguf_source, heldout_prompts,  # noqa: E402
                          load_bench_model, parse_drafter_spec, parse_model_args, run_meta, transformers_model)
from kvjax.decode.draft_weights import draft_params  # noqa: E402
from kvjax.models.llama.layers import COARSE_BLOCK, COARSE_BLOCKS  # noqa: E402

# the refreshing drafters' draft steps (their selection stays the first one here: no verify runs in between)
COMPRESSORS = {**STATIC_DRAFTERS, "refresh": dict(ratio=4.0), "refresh_kivi2": {}, "refresh_kivi4": {}}
QUANTIZED = ("kivi4", "kivi2", "dropquant", "refresh_kivi2", "refresh_kivi4")
DECODE_STEPS = 32
X_MAX = 32


def copy(tree):
    return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


class Floor:
    """Seconds one jitted `jnp.sum` takes over `nbytes` of f32 (best of 5), measured when asked, in this run. Above
    `CAP` bytes (a prefill's total reads, tens of GB) it sums `CAP` bytes and scales linearly: far past every cache,
    a reduction's time is proportional to its bytes, and an array of the full size would not fit in memory."""

    CAP = 2 << 30

    def __init__(self):
        self._sum = jax.jit(jnp.sum)

    def __call__(self, nbytes: int) -> float:
        n = min(int(nbytes), self.CAP)
        a = jnp.ones((max(n // 4, 1),), jnp.float32)
        self._sum(a).block_until_ready()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            self._sum(a).block_until_ready()
            best = min(best, time.perf_counter() - t)
        del a
        return best * max(int(nbytes), 1) / max(n, 1)


def record(rows, floor, context, step, seconds, nbytes, per="step", **extra):
    fl = floor(nbytes)
    r = dict(context=context, step=step, ms=seconds * 1e3, per=per, bytes=int(nbytes), floor_ms=fl * 1e3,
             ratio=seconds / fl, **extra)
    rows.append(r)
    print(f"  {step:28s} {seconds * 1e3:9.2f} ms/{per:6s} {nbytes / 1e6:9.1f} MB  floor {fl * 1e3:8.2f} ms  "
          f"ratio {seconds / fl:5.2f}" + "".join(f"  {k}={v:.3g}" if isinstance(v, float) else f"  {k}={v}"
                                               for k, v in extra.items()), flush=True)
    return r


def step_weight_bytes(params) -> int:
    """The weight bytes a one-token step reads in the layout `params` holds (a GGUF model's loop layout: its block
    codes, `pallas_kernels.affine`): every leaf, less the embedding table where a separate head is stored (the table
    then gives one row per token)."""
    total = tree_nbytes(params)
    if "lm_head_coarse" in params:
        # a draft's coarse head: of the embedding's rows (in the tree twice, as `embed` and `lm_head_rows`) a token
        # reads its own and the re-scored blocks' (`coarse_head_logits`)
        rows = params["lm_head_rows"]
        return total - params["embed"].nbytes - rows.nbytes + (COARSE_BLOCKS * COARSE_BLOCK + 1) * rows[0].nbytes
    return total - params["embed"].nbytes if "lm_head" in params and "embed" in params else total


def bench_kvjax(model, prompt, drafters, floor, rows):
    L = prompt.size
    params, config, family, impl = model.params, model.config, model.family, model.attention
    wbytes = tree_nbytes(params)  # what a prefill chunk reads (the stored f32 layout)
    loop = model.loop_params()  # the one-token loops' layout, made once (as the engine's callers pass it)
    loop_bytes = step_weight_bytes(loop)
    cap = capacity_for(L, DECODE_STEPS * 8, X_MAX)
    # warm-up: compile the prefill chunk and the decode loop at this capacity on a short prompt
    warm = family.init_cache(config, 1, cap, model.cache_dtype)
    _, warm = steps.prefill(model, warm, prompt[:min(L, steps.BULK_CHUNK + 1)])  # both chunk widths (`chunk_plan`)
    seed = jnp.zeros((1,), jnp.int32)
    first = jnp.zeros((1,), jnp.int32)
    jax.block_until_ready(steps.decode(loop, config, warm, first, seed, num_steps=DECODE_STEPS, family=family,
                                       impl=impl))
    del warm

    full = family.init_cache(config, 1, cap, model.cache_dtype)
    t = time.perf_counter()
    logits, full = steps.prefill(model, full, prompt)
    jax.block_until_ready(full)
    prefill_s = time.perf_counter() - t
    plan = steps.chunk_plan(L)
    chunks = len(plan)
    kv_rows_read = sum(min(start + width, L) for start, width in plan)
    row_bytes = family.read_bytes(full, 1) - family.read_bytes(full, 0)
    # every chunk reads the weights and the cached rows up to its end (prefill is compute-bound: the ratio to a
    # memory floor is large by nature; the peers are its comparison)
    record(rows, floor, L, "prefill", prefill_s, chunks * wbytes + kv_rows_read * row_bytes, per="prompt",
           tokens_per_s=L / prefill_s, capacity=cap)
    first = jnp.argmax(logits)[None].astype(jnp.int32)
    kv_bytes = family.read_bytes(full, L)

    decode_s = best_of(lambda: steps.decode(loop, config, copy(full), first, seed, num_steps=DECODE_STEPS,
                                            family=family, impl=impl)[0], 3) / DECODE_STEPS
    # the copy inside the lambda is timed too: measure it alone and take it out
    copy_s = best_of(lambda: copy(full), 3) / DECODE_STEPS
    decode_s = max(decode_s - copy_s, 1e-9)
    record(rows, floor, L, "full-cache decode", decode_s, loop_bytes + kv_bytes, per="token",
           tokens_per_s=1 / decode_s)

    vdraft = None
    for spec, (name, kw) in drafters:
        comp = family.make_compressor(name, **kw)
        # the weights the draft reads (`draft_params`: the loop layout for float32, or a bf16/int8 copy with its own head)
        dparams = draft_params(model, kw.get("draft_weights", "float32"))
        dbytes = step_weight_bytes(dparams)
        t = time.perf_counter()
        dc = jax.block_until_ready(comp(params, config, full, prompt, recent_slots=256))
        comp_s = time.perf_counter() - t
        dc_bytes = dc.nbytes()
        drafts, _, dc = draft_mod.draft_step(dparams, config, dc, first, seed, x=X_MAX, family=family, impl=impl)
        jax.block_until_ready(drafts)

        def one():
            nonlocal dc
            d, _, dc = draft_mod.draft_step(dparams, config, dc, first, seed, x=X_MAX, family=family, impl=impl)
            return d

        draft_s = best_of(one, 3) / X_MAX
        record(rows, floor, L, f"draft step [{spec}]", draft_s, dbytes + dc_bytes, per="token",
               quantized=name in QUANTIZED, compress_s=comp_s, compress_vs_prefill=comp_s / prefill_s,
               vs_decode=draft_s / decode_s)
        vdraft = dc if vdraft is None else vdraft
        if dc is not vdraft:
            del dc

    vparams = model.verify_params()  # what VeriCache verifies with (and its reference reads)
    for x in (8, 32):
        drafts = jnp.zeros((1, x), jnp.int32)
        qlog = jnp.zeros((1, 1, config.vocab_size), jnp.float32)
        state = {"dc": vdraft}

        def verify_once() -> float:
            """One verify on a fresh copy of the full cache (it is donated), the copy made outside the timed
            region: subtracting a separately timed copy left nothing of a short verify (x = 8 at 8K) once the
            copy's own noise exceeded it."""
            fresh = copy(full)
            jax.block_until_ready(fresh)
            t0 = time.perf_counter()
            out = verify_mod.verify_step(vparams, config, fresh, state["dc"], first, drafts, qlog, seed,
                                         family=family, impl=impl)
            jax.block_until_ready(out[0])
            state["dc"] = out[3]
            return time.perf_counter() - t0

        verify_once()  # compile
        ver_s = min(verify_once() for _ in range(3))
        vdraft = state["dc"]
        record(rows, floor, L, f"verify x={x}", ver_s, step_weight_bytes(vparams) + kv_bytes, per="verify",
               decode_steps=ver_s / decode_s)

    if family.offload_split is not None:
        host_part, _ = family.offload_split(full, pick_capacity(DECODE_STEPS * 8 + X_MAX + 2, CAPACITY_BUCKETS))
        host_part = jax.block_until_ready(offl.to_host(host_part))
        moved = tree_nbytes(host_part)
        # an accelerator's per-verify copy (the engine on the CPU lends the host copy instead, `offload.lends`),
        # here into the previous copy's buffers (`offload.fetch(into=...)`: no fresh pages), the first fetch untimed
        held = {"buf": jax.block_until_ready(offl.fetch(host_part))}

        def fetch_into():
            held["buf"] = offl.fetch(host_part, into=held["buf"])
            return held["buf"]

        h2d_s = best_of(fetch_into, 3)
        record(rows, floor, L, "offload h2d transfer", h2d_s, moved, per="verify", filled_bytes=int(kv_bytes),
               moved_vs_filled=moved / max(kv_bytes, 1))
    return prefill_s, decode_s


def bench_transformers(checkpoint, prompt, new_tokens, floor, rows, wbytes, kv_row_bytes):
    """Hugging Face transformers, PyTorch CPU: prefill of the prompt, then `generate` continuing from its cache."""
    try:
        import torch
        from transformers import DynamicCache
    except ImportError as e:
        print(f"  transformers: skipped ({e})")
        return None
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    hf = transformers_model(checkpoint)
    ids = torch.tensor(prompt[None, :].astype(np.int64))
    L = prompt.size
    with torch.no_grad():
        hf.generate(ids[:, :256], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        cache = DynamicCache()
        t = time.perf_counter()
        hf(ids[:, :-1], past_key_values=cache, use_cache=True)
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        hf.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=0)
        decode_s = (time.perf_counter() - t) / new_tokens
    record(rows, floor, L, "transformers prefill", prefill_s, wbytes, per="prompt", tokens_per_s=(L - 1) / prefill_s)
    record(rows, floor, L, "transformers decode", decode_s, wbytes + L * kv_row_bytes, per="token",
           tokens_per_s=1 / decode_s)
    return prefill_s, decode_s


def gguf_weights(model) -> str:
    """What kvjax's steps read of a GGUF model's weights: its block codes where its loops read them
    (`kvjax.families.llama.reads_block_codes`: each weight made in registers as the exact f32 value it stands for),
    else an f32 copy."""
    from kvjax.families.llama import reads_block_codes

    if reads_block_codes(model):
        return "the GGUF's block codes, read as the exact f32 weights they stand for (native products)"
    return "f32 (dequantised from the GGUF)"


def bench_llama_cpp(checkpoint, prompt, rows, floor, wbytes, kv_row_bytes, llama_bench=None, new_tokens=64,
                    gguf_files=()):
    """llama.cpp on the same weights (GGUF f32 export by `gguf_export.py`): `llama-bench` prefill of the prompt's
    length with flash attention on (at 8K without it prefill ran 631 tokens/s against 2,784 with it) and
    `new_tokens` decode steps at the prompt's depth with it off and on, the faster compared (at 8K 167 vs 71 tokens/s:
    off wins on this CPU); f32 KV cache where the binary accepts `-ctk f32` (stock llama-bench lists only f16 and
    quantized types; a one-line patch adds f32), else its default f16 (recorded). llama-bench feeds random token
    ids: its speed does not depend on them. `gguf_files`: the same model in other formats (e.g. the quantized file a
    model ships as), run alike and named by their main tensor type (their floor: the file's bytes). Skipped, with the
    reason recorded, without a llama-bench binary (`--llama-bench PATH` or one on PATH) or the `gguf` package."""
    import shutil
    import tempfile

    L = int(prompt.size)
    binary = llama_bench or shutil.which("llama-bench")
    reason = None
    if binary is None:
        reason = ("no llama-bench binary (pass --llama-bench PATH; llama-cpp-python has no binary wheel for this "
                  "platform, and its vendored llama.cpp builds llama-bench with cmake in ~6 minutes)")
    else:
        try:
            import gguf  # noqa: F401
        except ImportError:
            reason = "the gguf package is not installed (pip install gguf) to export the checkpoint"
    if reason:
        print(f"  llama.cpp: skipped: {reason}")
        rows.append(dict(context=L, step="llama.cpp", skipped=reason))
        return None
    from gguf_export import export, export_dequantised

    tmp = tempfile.mkdtemp(prefix="kvjax-gguf-")
    try:
        src = gguf_source(checkpoint)  # a GGUF model: the same file with its tensors dequantised (kvjax's weights)
        path = (export_dequantised(src, os.path.join(tmp, "model-f32.gguf")) if src
                else export(checkpoint, os.path.join(tmp, "model-f32.gguf")))
        got = _llama_bench(binary, path, "llama.cpp", L, rows, floor, wbytes, kv_row_bytes, new_tokens)
        for extra in gguf_files:  # the same model in other weight formats (e.g. the Q4_1 file it ships as)
            label = f"llama.cpp {_gguf_weight_type(extra)}"
            got.update(_llama_bench(binary, extra, label, L, rows, floor, os.path.getsize(extra), kv_row_bytes,
                                    new_tokens))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return got


def _gguf_weight_type(path: str) -> str:
    """The most common tensor type of a GGUF file by bytes (e.g. 'Q4_1', 'F32')."""
    import gguf

    sizes = {}
    for t in gguf.GGUFReader(path).tensors:
        sizes[t.tensor_type.name] = sizes.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return max(sizes, key=sizes.get)


def _llama_bench(binary, path, label, L, rows, floor, wbytes, kv_row_bytes, new_tokens):
    """llama-bench on one GGUF file: prefill of L tokens with flash attention on, `new_tokens` decode steps at depth
    L with it off and on; records steps named `label` + ' prefill' / ' decode'."""
    import subprocess

    threads = str(max(1, os.cpu_count() or 1))

    def run(*args):
        # f32 KV where the build takes it, else f16; weights repacked for its kernels where that runs (llama.cpp
        # 0c1e570's AVX-512 repacking of SmolLM2's Q4_1 file crashed on the Xeon: there they are read as stored)
        for repack in ((), ("--repack", "0")):
            for kv in ("f32", "f16"):
                r = subprocess.run([binary, "-m", path, "-t", threads, "-ctk", kv, "-ctv", kv, "-r", "1", "-o", "json",
                                    *repack, *args], capture_output=True, text=True)
                if r.returncode == 0:
                    return json.loads(r.stdout)
        raise RuntimeError(f"llama-bench failed (exit {r.returncode}): {r.stderr[-500:]}")

    out = run("-p", str(L), "-n", "0", "-fa", "on") + run("-p", "0", "-n", str(new_tokens), "-d", str(L),
                                                          "-fa", "off,on")
    got = {}
    for r in out:
        kv = r.get("type_k")
        if r["n_gen"] == 0:
            step = f"{label} prefill" + (" (flash attention)" if r["flash_attn"] else "")
            got[step] = record(rows, floor, L, step, L / r["avg_ts"], wbytes, per="prompt",
                               tokens_per_s=r["avg_ts"], kv_type=kv)
        else:
            step = f"{label} decode" + (" (flash attention)" if r["flash_attn"] else "")
            got[step] = record(rows, floor, L, step, 1 / r["avg_ts"],
                               wbytes + L * kv_row_bytes // (1 if kv == "f32" else 2), per="token",
                               tokens_per_s=r["avg_ts"], kv_type=kv)
    # the peer at its best per phase: on this CPU flash attention speeds its prefill up and slows its decode down
    got[f"{label} decode"] = min((v for k, v in got.items() if k.startswith(f"{label} decode")),
                                 key=lambda v: v["ms"])
    return got


def add_best_bandwidth_floor(rows, min_bytes: int = 10 << 20):
    """Also state each step against the best reduction bandwidth seen anywhere in the run (over floors of at least
    `min_bytes`): on a shared machine one floor measurement can land in a busy moment (seen: 14-24 ms for the same
    151 MB in one run), and the per-step ratio then flatters the step."""
    bws = [r["bytes"] / r["floor_ms"] for r in rows if r.get("floor_ms") and r.get("bytes", 0) >= min_bytes]
    if not bws:
        return None
    best = max(bws)  # bytes per ms
    for r in rows:
        if r.get("floor_ms"):
            r["floor_best_bw_ms"] = r["bytes"] / best
            r["ratio_best_bw"] = r["ms"] / r["floor_best_bw_ms"]
    return best / 1e6  # GB/s


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for step, label, key in (("full-cache decode", "kvjax decode", "ms"), ("full-cache decode", "its floor", "floor_ms"),
                             ("transformers decode", "transformers generate", "ms")):
        pts = sorted((r["context"], r[key]) for r in rows if r.get("step") == step and key in r)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label, linestyle="--" if key == "floor_ms" else "-")
    for r in rows:
        if r.get("step", "").startswith("draft step") and "ms" in r:
            ax.scatter([r["context"]], [r["ms"]], marker="x", s=20, color="gray")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms / token")
    ax.set_title("decode: kvjax vs its memory floor and transformers (x: draft steps)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"[bench] plot -> {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, context="8192,32768", compressors=",".join(COMPRESSORS), new_tokens=64,
                   new_tokens_help="tokens the peers generate", json_default=None)
    ap.add_argument("--random", action="store_true", help="a random-weight model of the checkpoint's shape")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers and llama.cpp")
    ap.add_argument("--llama-bench", default=None, help="a llama-bench binary (default: one on PATH)")
    ap.add_argument("--gguf", action="append", default=[], help="llama.cpp also runs this GGUF file of the same model "
                                                                "(repeatable; e.g. the Q4_1 file it ships as)")
    args = ap.parse_args(argv)
    contexts, compressors = parse_model_args(ap, args, COMPRESSORS, 300, specs=True)
    # (spec, (name, fields)) each; a bad field fails here, before any model loads
    drafters = [(spec, parse_drafter_spec(spec, COMPRESSORS, None, ap.prog)) for spec in compressors]

    model, name = load_bench_model(args.model, args.random)
    floor = Floor()
    rows, sources = [], {}
    print(f"[bench] {name}, backend {jax.default_backend()}, {os.cpu_count()} CPUs", flush=True)
    for L in contexts:
        prompt, source = heldout_prompts(model, name, L, 1, args.seed)
        prompt = prompt[0]
        sources[L] = source
        print(f"context {L} ({source}):", flush=True)
        _, decode_s = bench_kvjax(model, prompt, drafters, floor, rows)
        if not args.no_peers and name != "random-init":
            kv_row = 2 * model.config.num_layers * model.config.num_kv_heads * model.config.head_dim * 4
            peer = bench_transformers(args.model, prompt, args.new_tokens, floor, rows, tree_nbytes(model.params),
                                      kv_row)
            if peer is not None:
                rows.append(dict(context=L, step="kvjax vs transformers", decode_speedup=peer[1] / decode_s,
                                 prefill_speedup=peer[0] / next(r["ms"] / 1e3 for r in rows
                                                               if r["context"] == L and r["step"] == "prefill")))
                print(f"  kvjax vs transformers: decode {rows[-1]['decode_speedup']:.2f}x, prefill "
                      f"{rows[-1]['prefill_speedup']:.2f}x", flush=True)
            lc = bench_llama_cpp(args.model, prompt, rows, floor, tree_nbytes(model.params), kv_row,
                                 args.llama_bench, args.new_tokens, args.gguf)
            if lc:
                prefill_s = next(r["ms"] / 1e3 for r in rows if r["context"] == L and r["step"] == "prefill")
                for label in sorted({k[:-len(" decode")] for k in lc if k.endswith(" decode")}):
                    rows.append(dict(context=L, step=f"kvjax vs {label}",
                                     decode_speedup=lc[f"{label} decode"]["ms"] / 1e3 / decode_s,
                                     prefill_speedup=lc[f"{label} prefill (flash attention)"]["ms"] / 1e3 / prefill_s))
                    print(f"  kvjax vs {label}: decode {rows[-1]['decode_speedup']:.2f}x, prefill "
                          f"{rows[-1]['prefill_speedup']:.2f}x (flash attention on)", flush=True)
    if not args.no_peers:  # one attention layer: native kernel vs XLA vs PyTorch's fused attention, interleaved
        cfg = model.config
        print("attention per layer (native / XLA / PyTorch SDPA, 2 threads):", flush=True)
        for rec in attention_peers(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   slots=[pick_capacity(L + 300, CAPACITY_BUCKETS) for L in contexts],
                                   log=lambda s: print(s, flush=True)):
            rows.append(dict(context=rec["slots"], step=f"attention layer {rec['rows']} rows", **rec))
    best_gbs = add_best_bandwidth_floor(rows)
    if best_gbs:
        print(f"[bench] best reduction bandwidth in this run: {best_gbs:.1f} GB/s; ratios against it:")
        for r in rows:
            if "ratio_best_bw" in r:
                print(f"  {r['context']:6d} {r['step']:28s} {r['ratio_best_bw']:6.2f}")
    if args.json:
        meta = dict(best_reduction_gb_per_s=best_gbs, model=name, contexts=contexts, prompt_source=sources,
                    compressors=compressors, decode_steps=DECODE_STEPS, peer_new_tokens=args.new_tokens,
                    weights=gguf_weights(model) if gguf_source(args.model) else "as stored",
                    floor="one jitted jnp.sum over the same number of f32 bytes, best of 5, same run", **run_meta())
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(meta=meta, records=rows), f, indent=1)
        print(f"[bench] json -> {args.json}")
        plot(rows, os.path.splitext(args.json)[0] + ".png")
    return rows


if __name__ == "__main__":
    main()
