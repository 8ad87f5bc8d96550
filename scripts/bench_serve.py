"""Serving benchmark in the style of vLLM's benchmark_serving: `kvjax serve --mode full` and `--mode vericache`
side by side, against live servers this script starts on 127.0.0.1.

Two experiments, each run for both modes interleaved (rate by rate, so drift on a shared machine hits both alike):
- open loop: requests arrive as a Poisson process at each `--rates` value (requests/s) whatever the server does;
- concurrency sweep: `--concurrency` clients in a closed loop (each sends its next request when the last ends).
Every request is a long random-token prompt (`--prompt-len`) streaming `--max-tokens` tokens (ignore_eos, so every
request produces the same number of tokens). Reported per mode and setting: output tokens/s, requests/s, TTFT
(arrival to first token) and TPOT (time per output token after the first) p50/p99, and full/vericache ratios.
Writes a table, JSON (`--json`) and a plot (`--plot`).

    python scripts/bench_serve.py --prompt-len 1024 --max-tokens 32 --rates 0.5,1,2 --concurrency 1,4,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TINY = os.path.join(ROOT, "checkpoints", "kvjax-code-tiny")
sys.path.insert(0, ROOT)

from kvjax.server.launch import free_port  # noqa: E402


def start_server(args, mode: str):
    """A `kvjax serve` process in `mode`; returns (process, base url) once /health answers."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "kvjax.cli.main", "serve", "--model", args.model, "--mode", mode, "--port", str(port),
           "--context", str(args.prompt_len + args.max_tokens + 8), "--max-tokens-limit", str(args.max_tokens),
           "--max-batch", str(args.max_batch), "--max-queue", "1024", "--no-prefix-cache"]
    if args.budget_mb:
        cmd += ["--budget-mb", str(args.budget_mb)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        if proc.poll() is not None:
            raise SystemExit(f"{mode} server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{mode} server did not start")


async def one_request(client, url: str, prompt: list[int], max_tokens: int) -> dict:
    """Stream one completion; returns its arrival, first-token and end times and token count."""
    t0 = time.perf_counter()
    first, n, done = None, 0, False
    async with client.stream("POST", f"{url}/v1/completions", json=dict(
            prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True)) as r:
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                k = sum(len(c.get("token_ids", [])) for c in json.loads(line[6:]).get("choices", []))
                if k and first is None:
                    first = time.perf_counter()
                n += k
    return dict(start=t0, first=first, end=time.perf_counter(), tokens=n, ok=done and n == max_tokens)


async def open_loop(url: str, prompts, max_tokens: int, rate: float, seed: int) -> list[dict]:
    import httpx

    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(prompts))
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=4096)) as client:
        tasks = []
        for p, gap in zip(prompts, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one_request(client, url, p, max_tokens)))
        return await asyncio.gather(*tasks)


async def closed_loop(url: str, prompts, max_tokens: int, concurrency: int) -> list[dict]:
    import httpx

    todo = list(prompts)
    out = []
    async with httpx.AsyncClient(timeout=3600) as client:
        async def worker():
            while todo:
                out.append(await one_request(client, url, todo.pop(), max_tokens))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if r["ok"]]
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    ttft = np.asarray([r["first"] - r["start"] for r in ok]) * 1e3
    tpot = np.asarray([(r["end"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]) * 1e3
    pct = lambda a, q: float(np.percentile(a, q)) if a.size else float("nan")  # noqa: E731
    return dict(requests=len(results), completed=len(ok), wall_s=wall, req_per_s=len(ok) / wall,
                out_tok_per_s=sum(r["tokens"] for r in ok) / wall, ttft_p50_ms=pct(ttft, 50),
                ttft_p99_ms=pct(ttft, 99), tpot_p50_ms=pct(tpot, 50), tpot_p99_ms=pct(tpot, 99))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=TINY)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per setting")
    ap.add_argument("--rates", default="0.5,1,2", help="open-loop arrival rates, requests/s")
    ap.add_argument("--concurrency", default="1,4,8", help="closed-loop client counts")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--budget-mb", type=int, default=0)
    ap.add_argument("--modes", default="full,vericache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_serve.json")
    ap.add_argument("--plot", default="bench_serve.png")
    args = ap.parse_args()
    modes = args.modes.split(",")
    rng = np.random.default_rng(args.seed)
    servers = {m: start_server(args, m) for m in modes}
    rows = []
    try:
        prompts = lambda: [rng.integers(1, 4000, args.prompt_len).tolist() for _ in range(args.num_prompts)]  # noqa: E731
        for m, (_, url) in servers.items():  # warm the request shapes once per server (not measured)
            asyncio.run(closed_loop(url, prompts()[:2], args.max_tokens, 2))
        for rate in [float(r) for r in args.rates.split(",")]:
            ps = prompts()
            for m, (_, url) in servers.items():
                rows.append(dict(mode=m, kind="rate", setting=rate,
                                 **summarize(asyncio.run(open_loop(url, ps, args.max_tokens, rate, args.seed)))))
                print(json.dumps(rows[-1]), flush=True)
        for c in [int(c) for c in args.concurrency.split(",")]:
            ps = prompts()
            for m, (_, url) in servers.items():
                rows.append(dict(mode=m, kind="concurrency", setting=c,
                                 **summarize(asyncio.run(closed_loop(url, ps, args.max_tokens, c)))))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=120)
    report(rows, args, modes)


def report(rows, args, modes):
    print(f"\nprompt {args.prompt_len} tokens, {args.max_tokens} out, {args.num_prompts} requests per setting")
    print(f"{'kind':12s} {'set':>5s} {'mode':10s} {'done':>5s} {'tok/s':>8s} {'req/s':>6s} "
          f"{'TTFT p50':>9s} {'p99':>8s} {'TPOT p50':>9s} {'p99':>8s}")
    for r in rows:
        print(f"{r['kind']:12s} {r['setting']:5g} {r['mode']:10s} {r['completed']:5d} {r['out_tok_per_s']:8.1f} "
              f"{r['req_per_s']:6.2f} {r['ttft_p50_ms']:8.0f}ms {r['ttft_p99_ms']:6.0f}ms "
              f"{r['tpot_p50_ms']:8.1f}ms {r['tpot_p99_ms']:6.1f}ms")
    if set(modes) >= {"full", "vericache"}:
        print("\nvericache / full ratios (tok/s, TTFT p50, TPOT p50):")
        for kind, s in sorted({(r["kind"], r["setting"]) for r in rows}):
            f, v = ([r for r in rows if (r["kind"], r["setting"], r["mode"]) == (kind, s, m)][0]
                    for m in ("full", "vericache"))
            print(f"  {kind} {s:g}: {v['out_tok_per_s'] / f['out_tok_per_s']:.2f}x  "
                  f"{v['ttft_p50_ms'] / f['ttft_p50_ms']:.2f}x  {v['tpot_p50_ms'] / f['tpot_p50_ms']:.2f}x")
    with open(args.json, "w") as f:
        json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    for m in modes:
        rr = [r for r in rows if r["mode"] == m and r["kind"] == "rate"]
        cc = [r for r in rows if r["mode"] == m and r["kind"] == "concurrency"]
        ax[0].plot([r["setting"] for r in rr], [r["out_tok_per_s"] for r in rr], "o-", label=m)
        ax[1].plot([r["setting"] for r in rr], [r["ttft_p50_ms"] for r in rr], "o-", label=f"{m} p50")
        ax[1].plot([r["setting"] for r in rr], [r["ttft_p99_ms"] for r in rr], "x--", label=f"{m} p99")
        ax[2].plot([r["setting"] for r in cc], [r["out_tok_per_s"] for r in cc], "o-", label=m)
    ax[0].set(xlabel="arrival rate (req/s)", ylabel="output tokens/s", title="open loop: throughput")
    ax[1].set(xlabel="arrival rate (req/s)", ylabel="TTFT (ms)", title="open loop: time to first token")
    ax[2].set(xlabel="concurrent clients", ylabel="output tokens/s", title="closed loop: concurrency sweep")
    for a in ax:
        a.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
