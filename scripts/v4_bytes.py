"""Bytes per cache form of a DeepSeek-V4 request: per token (the slope) and per request (at given context lengths).

The numbers are read off the forms kvjax actually allocates (`kvjax.models.deepseek_v4.cache.init_cache` under
`jax.eval_shape`, so nothing is allocated even for a 1M-token V4-Flash request):

- compressed KV: one `head_dim` entry per `m` (CSA) or `m'` (HCA) tokens per layer — grows with the context;
- indexer state: the indexer's compressed keys (`index_head_dim` per `m` tokens per CSA layer) + its tail;
- tail: each compressor's buffer of the incomplete window (kv + gate, two series for CSA) + CSA's overlap slice;
- SWA window: `sliding_window` shared K=V vectors per layer (a ring; constant);
- (offloaded prefix: any of the above, held elsewhere — same bytes, different tier).

Configs: `small` (the tiny hybrid test config of tests/test_deepseek_v4_models.py, or `--config DIR|config.json`
for a trained checkpoint) and `flash`: DeepSeek-V4-Flash dimensions as transformers 5.24 `DeepseekV4Config` defaults
(its docstring names the checkpoint deepseek-ai/DeepSeek-V4-Flash-Base; `DeepseekV4GroupedLinear`'s docstring confirms
64 heads x 512, o_groups 8, o_lora_rank 1024, hidden 4096), with the Flash layer schedule from the model card
(huggingface.co/deepseek-ai/DeepSeek-V4-Flash, as summarised in antirez/ds4 MODEL_CARD.md): layers 0-1 sliding
only, then CSA (m = 4) and HCA (m' = 128) alternating. transformers' own default schedule (2 HCA, then alternating,
documented as the V4-Pro default) is printed as `flash-tfdefault`.

Usage: python scripts/v4_bytes.py [--config PATH] [--dtype bf16|f32] [--contexts 4096,131072,1048576] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvjax.models.deepseek_v4.cache import init_cache  # noqa: E402
from kvjax.models.layer_types import CSA, HCA, SLIDING  # noqa: E402
from kvjax.models.deepseek_v4.config import config_from_hf

FORMS = ("compressed_kv", "indexer", "tail", "swa_window")


def small_hf() -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from test_deepseek_v4_models import SPECS  # noqa: PLC0415

    from transformers import DeepseekV4Config  # noqa: PLC0415

    return DeepseekV4Config(**SPECS["hybrid"]).to_dict()


def flash_hf(schedule: str) -> dict:
    from transformers import DeepseekV4Config  # noqa: PLC0415

    d = DeepseekV4Config().to_dict()  # defaults = V4-Flash dimensions
    if schedule == "card":
        n = d["num_hidden_layers"]
        d["layer_types"] = [SLIDING] * 2 + [CSA if i % 2 == 0 else HCA for i in range(2, n)]
    return d


def form_bytes(config, tokens: int, itemsize: int) -> dict[str, int]:
    """Bytes of each form for one request holding `tokens` tokens (batch 1)."""
    dt = {2: jnp.bfloat16, 4: jnp.float32}[itemsize]
    cache = jax.eval_shape(lambda: init_cache(config, 1, tokens, dt))
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    out = dict.fromkeys(FORMS, 0)
    for st in cache.layers:
        out["swa_window"] += nbytes(st.window)
        if st.compressed is not None:
            out["compressed_kv"] += nbytes(st.compressed)
            out["tail"] += nbytes(st.tail)
        if st.indexer is not None:
            out["indexer"] += nbytes(st.indexer)
    return out


def report(name: str, config, contexts: list[int], itemsize: int) -> dict:
    big = 1 << 20
    a, b = form_bytes(config, big, itemsize), form_bytes(config, 2 * big, itemsize)
    per_token = {k: (b[k] - a[k]) / big for k in FORMS}
    kinds = {k: config.layer_types.count(k) for k in (SLIDING, CSA, HCA)}
    dense = config.num_layers * config.head_dim * itemsize  # a plain K=V MQA cache, for scale
    rows = {n: form_bytes(config, n, itemsize) for n in contexts}
    print(f"\n{name}: {config.num_layers} layers {kinds}, D={config.head_dim}, W={config.sliding_window}, "
          f"m={config.csa_rate}, m'={config.hca_rate}, index_head_dim={config.index_head_dim}, "
          f"{itemsize}-byte elements")
    head = f"{'form':<14}{'B/token':>10}" + "".join(f"{'@' + _fmt_n(n):>14}" for n in contexts)
    print(head)
    for k in FORMS:
        print(f"{k:<14}{per_token[k]:>10.1f}" + "".join(f"{_fmt_b(rows[n][k]):>14}" for n in contexts))
    print(f"{'total':<14}{sum(per_token.values()):>10.1f}"
          + "".join(f"{_fmt_b(sum(rows[n].values())):>14}" for n in contexts))
    print(f"{'dense K=V MQA':<14}{dense:>10.1f}" + "".join(f"{_fmt_b(dense * n):>14}" for n in contexts))
    return {"config": name, "layer_kinds": kinds, "itemsize": itemsize, "bytes_per_token": per_token,
            "bytes_per_request": {str(n): rows[n] for n in contexts}, "dense_mqa_bytes_per_token": dense}


def _fmt_n(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n < (1 << 20) else (f"{n >> 20}M" if n % (1 << 20) == 0 else str(n))


def _fmt_b(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="a DeepSeek-V4 model directory or config.json for the small config")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f32"))
    ap.add_argument("--contexts", default="4096,131072,1048576")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    itemsize = 2 if args.dtype == "bf16" else 4
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.config:
        p = os.path.join(args.config, "config.json") if os.path.isdir(args.config) else args.config
        with open(p) as f:
            small = json.load(f)
    else:
        small = small_hf()
    out = [report("small", config_from_hf(small), contexts, itemsize),
           report("flash", config_from_hf(flash_hf("card")), contexts, itemsize),
           report("flash-tfdefault", config_from_hf(flash_hf("tfdefault")), contexts, itemsize)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
