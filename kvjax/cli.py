"""The `kvjax` console command.

    kvjax generate [--model DIR] (--prompt TEXT | --prompt-file F | --long-prompt N) [--chat] [--new-tokens M]
                   [--mode full|vericache] [--compressor NAME] [--draft-len X] [--offload] [--json PATH]

Errors print as one line (`kvjax: error: ...`) with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints",
                             "kvjax-code-tiny")


class CliError(Exception):
    """A user-facing error: printed as one line."""


def _prompt_ids(args, model) -> "np.ndarray":
    import numpy as np

    tok = model.tokenizer
    if args.long_prompt:
        if tok is None:
            raise CliError("--long-prompt needs a model directory with tokenizer.json")
        from kvjax.data import corpus

        return corpus.long_prompts(tok, args.long_prompt, 1, seed=args.seed)[0]
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise CliError("give one of --prompt, --prompt-file or --long-prompt")
    if tok is None:
        raise CliError(f"model directory {model.path} has no tokenizer.json; pass token ids via the Python API")
    if args.chat:
        return np.asarray(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                          np.int32)
    return np.asarray(tok.encode(text), np.int32)


def cmd_generate(args) -> dict:
    import numpy as np

    import kvjax

    model = kvjax.load(args.model, dtype=args.dtype)
    ids = _prompt_ids(args, model)
    print(f"model {os.path.basename(os.path.normpath(args.model))}: {model.config.num_layers} layers, "
          f"prompt {ids.size} tokens, generating {args.new_tokens}", file=sys.stderr)
    t0 = time.perf_counter()
    if args.mode == "full":
        out = kvjax.generate(model, ids, max_new_tokens=args.new_tokens, stop_at_eos=False)
        stats = {}
    else:
        from kvjax.decode import vericache

        out, stats = vericache.generate_vericache(model, ids, args.new_tokens, compressor=args.compressor,
                                                  draft_len=args.draft_len, offload=args.offload, progress=True)
    dt = time.perf_counter() - t0
    if args.compare_full:
        stats = {**stats, **_compare_full(args, model, ids, out)}
    text = model.tokenizer.decode([int(t) for t in out]) if model.tokenizer is not None else None
    if text is not None:
        print(text)
    result = dict(mode=args.mode, prompt_tokens=int(ids.size), new_tokens=int(len(out)), seconds=round(dt, 3),
                  tokens=[int(t) for t in out], **{k: v for k, v in stats.items() if _jsonable(v)})
    return result


def _full_cache_tokens_per_s(model, ids, n: int) -> float:
    """Throughput of kvjax's best full-cache decoder (one `lax.fori_loop` call), compiled before it is timed."""
    import jax
    import jax.numpy as jnp

    from kvjax.cache.forms import init_cache, pick_capacity
    from kvjax.decode import steps

    cache = init_cache(model.config, 1, pick_capacity(ids.size + n + 2))
    logits, cache = steps.prefill(model.params, model.config, cache, ids)
    first = jnp.argmax(logits).astype(jnp.int32)[None]
    warm = jax.tree.map(jnp.copy, cache)
    jax.block_until_ready(steps.greedy_decode(model.params, model.config, warm, first, num_steps=n)[0])
    t0 = time.perf_counter()
    jax.block_until_ready(steps.greedy_decode(model.params, model.config, cache, first, num_steps=n)[0])
    return n / (time.perf_counter() - t0)


def _compare_full(args, model, ids, out) -> dict:
    """Check VeriCache tokens against the full-cache reference decode and time full-cache decoding."""
    import numpy as np

    from kvjax.decode import vericache

    if args.mode != "vericache":
        return {}
    print("checking against full-cache reference decoding ...", file=sys.stderr)
    ref = vericache.reference_decode(model, ids, len(out), draft_len=args.draft_len)
    identical = bool(np.array_equal(ref, np.asarray(out)))
    full_tps = _full_cache_tokens_per_s(model, ids, len(out))
    return dict(identical_to_full_cache=identical, full_cache_tokens_per_s=round(full_tps, 2))


def _summary(result: dict) -> str:
    keys = ("mode", "prompt_tokens", "new_tokens", "tokens_per_s", "full_cache_tokens_per_s",
            "mean_accepted_per_round", "identical_to_full_cache", "seconds")
    parts = [f"{k}={result[k]}" for k in keys if k in result]
    if "tokens_per_s" in result and "full_cache_tokens_per_s" in result and result["full_cache_tokens_per_s"]:
        parts.append(f"speedup_vs_full={result['tokens_per_s'] / result['full_cache_tokens_per_s']:.2f}x")
    return "summary: " + " ".join(parts)


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvjax", description="Exact long-context decoding in JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="decode from a prompt")
    g.add_argument("--model", default=DEFAULT_MODEL, help="Hugging Face-format model directory")
    g.add_argument("--prompt")
    g.add_argument("--prompt-file")
    g.add_argument("--long-prompt", type=int, default=0, help="use N tokens of held-out stdlib code as the prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--new-tokens", type=int, default=128)
    g.add_argument("--mode", choices=["full", "vericache"], default="full")
    g.add_argument("--compressor", default="streaming")
    g.add_argument("--draft-len", type=int, default=16)
    g.add_argument("--offload", action="store_true", help="keep the prompt's full KV in host memory")
    g.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--compare-full", action="store_true",
                   help="also run full-cache decoding: identity check and throughput ratio")
    g.add_argument("--json", help="write the result as JSON to this path")
    g.set_defaults(fn=cmd_generate)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.fn(args)
    except (CliError, ValueError, FileNotFoundError, OSError) as e:
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 2
    print(_summary(result), file=sys.stderr)
    if result.get("identical_to_full_cache") is False:
        print("kvjax: error: VeriCache output differs from full-cache decoding", file=sys.stderr)
        return 1
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
