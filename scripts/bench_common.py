"""What the benchmark scripts share: the model under test, its held-out prompts and the static drafters' settings."""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


# The six static drafters' settings every benchmark compares (4x budget; dropquant halves and quantizes).
STATIC_DRAFTERS = {
    "streaming": dict(ratio=4.0),
    "snapkv": dict(ratio=4.0, obs_window=32),
    "kvzip": dict(ratio=4.0, chunk=512),
    "kivi4": dict(residual=128),
    "kivi2": dict(residual=128),
    "dropquant": dict(ratio=2.0, bits=4, residual=128, chunk=512),
}


def random_model(config, seed: int = 0, tokenizer=None):
    """A `kvjax.Model` of `config` (any family) with randomly initialised params (`family.init_params`)."""
    from kvjax.families import family_of_config
    from kvjax.model import Model

    fam = family_of_config(config)
    return Model(config=config, params=fam.init_params(config, jax.random.key(seed)), family=fam,
                 tokenizer=tokenizer)


def random_model_like(checkpoint: str):
    """A randomly initialised model of the checkpoint's config (with its tokenizer when present).

    Random weights accept every draft; use it only to isolate mechanism costs from model quality, and say so.
    Without a checkpoint: the original bundled shape (4 layers, hidden 256, 8 x 4 heads of 32).
    """
    import json

    from kvjax.families import family_for

    tok = None
    if os.path.exists(os.path.join(checkpoint, "tokenizer.json")):
        from kvjax.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(checkpoint)
    cfg_path = os.path.join(checkpoint, "config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            hf = json.load(f)
    else:
        hf = dict(model_type="llama", vocab_size=tok.vocab_size if tok is not None else 4096, hidden_size=256,
                  intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072)
    return random_model(family_for(hf.get("model_type")).config_from_hf(hf), tokenizer=tok)


def model_label(path: str) -> str:
    """How results name a model directory: relative to the repository when inside it, else by its last component
    only (results never record a path of the machine that made them)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = os.path.abspath(path)
    if full.startswith(root + os.sep):
        return os.path.relpath(full, root)
    return os.path.basename(os.path.normpath(path))


def load_bench_model(checkpoint: str, random: bool):
    """(model, name): the trained checkpoint, or a random model of its shape when asked or when it is missing."""
    from kvjax import api

    if not random and (os.path.exists(os.path.join(checkpoint, "config.json")) or is_model_source(checkpoint)):
        return api.load(checkpoint), model_label(checkpoint)
    if not random:
        print(f"[bench] no trained checkpoint in {checkpoint}: using a random model of its shape", flush=True)
    return random_model_like(checkpoint), "random-init"


def bench_prompts(model, n_tokens: int, count: int, seed: int):
    """(prompts, source): held-out stdlib code of exactly n_tokens each, or random ids without a tokenizer."""
    if model.tokenizer is not None:
        try:
            from kvjax.data import corpus

            ps = corpus.long_prompts(model.tokenizer, n_tokens, count, seed)
            return [np.asarray(p, np.int32)[:n_tokens] for p in ps], "heldout corpus"
        except Exception as e:  # noqa: BLE001 - fall back loudly
            print(f"[bench] long_prompts unavailable ({type(e).__name__}: {e}); using random token ids")
    rng = np.random.default_rng(seed)
    return [rng.integers(0, model.config.vocab_size, n_tokens).astype(np.int32) for _ in range(count)], "random ids"


def tokens_and_stats(result):
    """(tokens i32[M], stats dict) from a VeriCache run's result: a (tokens, stats[, logits]) tuple, or a
    `Generation`-like object (array-like tokens with `.stats`)."""
    if isinstance(result, tuple):
        return np.asarray(result[0]), result[1]
    return np.asarray(result), result.stats


def native_status() -> dict:
    """The native CPU attention kernel's status for a results file: the built library by file name only (results
    never record a path of the machine that made them)."""
    import pallas_kernels.native

    st = dict(pallas_kernels.native.status())
    if st.get("library"):
        st["library"] = os.path.basename(st["library"])
    return st


def product_multiply_adds(config) -> int | None:
    """One decoder row's multiply-adds in its weight products -- per layer q, k, v, o and the gated MLP's three, then
    the LM head -- for a dense Llama-family config; None for another family (its products are not these)."""
    if getattr(config, "family", None) != "llama":
        return None
    H, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    N, K = config.num_heads, config.num_kv_heads
    return config.num_layers * (2 * H * N * D + 2 * H * K * D + 3 * H * I) + config.vocab_size * H


def causal_keys_seen(rows: int, first_row_keys: int) -> int:
    """The (row, key) pairs of `rows` consecutive query rows under the causal mask, the first seeing `first_row_keys`
    keys and each next one more."""
    return rows * first_row_keys + rows * (rows - 1) // 2


def attention_multiply_adds(num_heads: int, head_dim: int, keys_seen: int, layers: int = 1) -> int:
    """The multiply-adds of full attention over `keys_seen` (row, key) pairs summed over a step's query rows: per layer
    and query head, D for the score and D for the value of each pair."""
    return layers * num_heads * 2 * head_dim * int(keys_seen)


def multiply_add_rate(threads: int) -> float | None:
    """The machine's multiply-adds per second on `threads` threads (`pallas_kernels.native.multiply_add_rate`), or None
    where the native library is not loaded (no arithmetic floor then)."""
    import pallas_kernels.native as native  # noqa: PLC0415

    return native.multiply_add_rate(threads=threads) if native.available() else None


def best_of(fn, reps: int) -> float:
    """Best wall time in seconds of `reps` calls of fn (which returns something to block on)."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def parse_contexts(ap, value: str, minimum: int) -> list[int]:
    """`--context`'s comma-separated prompt lengths, each at least `minimum` tokens (`ap.error` otherwise)."""
    try:
        contexts = [int(c) for c in value.split(",") if c]
    except ValueError:
        ap.error(f"--context must be comma-separated integers, got {value!r}")
    if not contexts or min(contexts) < minimum:
        ap.error(f"--context lengths must be at least {minimum} tokens, got {value!r}")
    return contexts


def is_model_source(name: str) -> bool:
    """A name kvjax.load reads besides a Hugging Face directory: a named model (`kvjax models`) or a GGUF file or
    directory (a benchmark must never fall back to a random model for these)."""
    from kvjax.formats import named
    from kvjax.formats.gguf_model import gguf_path

    return named.is_named(name) or (os.path.exists(name) and gguf_path(name) is not None)


def gguf_source(name: str) -> str | None:
    """The GGUF file a named model or GGUF path stands for (a named model is fetched when not cached); None for a
    Hugging Face directory."""
    from kvjax.formats import named
    from kvjax.formats.gguf_model import gguf_path

    if named.is_named(name):
        name = named.fetch(name)
    return gguf_path(name) if os.path.exists(name) else None


def transformers_model(checkpoint: str):
    """The same model in Hugging Face transformers (PyTorch CPU, f32, eval mode): read from its GGUF file where the
    checkpoint is a named or GGUF model (transformers dequantises it to f32, as kvjax does), else from the directory."""
    import torch
    from transformers import AutoModelForCausalLM

    src = gguf_source(checkpoint)
    where = dict(pretrained_model_name_or_path=os.path.dirname(src), gguf_file=os.path.basename(src)) if src else \
        dict(pretrained_model_name_or_path=checkpoint)
    return AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()


# Files of the `transformers` distribution whose licence header is dated this year or later were written after
# SmolLM2's training data was gathered (its release: November 2024), so they are held out from it.
RECENT_SOURCE_SINCE = 2025


def recent_source_files(since: int = RECENT_SOURCE_SINCE) -> tuple[str, ...]:
    """Sorted RECORD paths of the installed `transformers` `modeling_*.py` files whose copyright header names a year
    >= `since` (the haystack of `kvjax.data.exact_tasks`, narrowed to text newer than a pretrained model's data)."""
    import re

    from kvjax.data import exact_tasks

    dist = exact_tasks.HAYSTACK_DISTRIBUTION
    out = []
    for f in exact_tasks.haystack_files(dist):
        head = exact_tasks._read(dist, f)[:2000]
        m = re.search(r"Copyright (?:\(c\) )?(\d{4})", head)
        if m and int(m.group(1)) >= since:
            out.append(f)
    if not out:
        raise ValueError(f"no {dist} modeling file is dated {since} or later")
    return tuple(out)


def recent_source_prompts(tokenizer, n_tokens: int, count: int, seed: int) -> list[np.ndarray]:
    """`count` prompts of exactly `n_tokens` tokens of `recent_source_files()`: prompt i starts at the top of the
    i-th file of a seeded permutation and runs on through the next files of that order."""
    from kvjax.data import exact_tasks

    files = recent_source_files()
    order = np.random.default_rng(seed).permutation(len(files))
    out = []
    for i in range(count):
        ids, j = [], i
        while len(ids) < n_tokens:
            text = exact_tasks._read(exact_tasks.HAYSTACK_DISTRIBUTION, files[order[j % len(files)]])
            ids += list(tokenizer.encode(text + "\n\n"))
            j += 1
        out.append(np.asarray(ids[:n_tokens], np.int32))
    return out


def heldout_prompts(model, model_name: str, n_tokens: int, count: int, seed: int):
    """(prompts, source) held out from what the model trained on: the bundled checkpoint's held-out corpus split
    (`bench_prompts`) for kvjax's own checkpoints and random models; for any other model (a pretrained one, e.g.
    SmolLM2, which saw the standard library) source code newer than its data (`recent_source_prompts`)."""
    if model.tokenizer is None or model_name == "random-init" or model_name.startswith("checkpoints/"):
        return bench_prompts(model, n_tokens, count, seed)
    from kvjax.data import exact_tasks

    since = RECENT_SOURCE_SINCE
    return (recent_source_prompts(model.tokenizer, n_tokens, count, seed),
            f"{exact_tasks.HAYSTACK_DISTRIBUTION}=={exact_tasks.haystack_version()} modeling_*.py dated >= {since} "
            f"(newer than the model's training data)")


def run_meta(argv=None) -> dict:
    """What every result file records about its run: the exact command line (paths of this machine replaced by their
    last component), the CPU (`lscpu` model name and L3), the CPU count, the JAX backend and the git commit."""
    import platform
    import subprocess

    args = list(sys.argv if argv is None else argv)
    args[0] = os.path.relpath(os.path.abspath(args[0]), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    clean = [os.path.basename(a) if os.path.isabs(a) else a for a in args]
    cpu = {}
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "L3 cache"):
                cpu[key.strip()] = value.strip()
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        commit = None
    return dict(command="python " + " ".join(clean), cpu_model=cpu.get("Model name", platform.processor() or None),
                l3_cache=cpu.get("L3 cache"), cpus=os.cpu_count(), backend=jax.default_backend(), commit=commit)


def add_model_args(ap, *, context: str, compressors: str, new_tokens: int, new_tokens_help: str,
                   json_default: str | None) -> None:
    """The options the one-model benchmarks share: --model, --context (comma-separated lengths), --compressors
    (comma-separated drafters), --new-tokens, --seed, --json. `parse_model_args` checks them."""
    ap.add_argument("--model", default="checkpoints/kvjax-code-tiny",
                    help="what kvjax.load reads: a model directory, a GGUF file or a named model")
    ap.add_argument("--context", default=context, help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--compressors", default=compressors, help="comma-separated drafters")
    ap.add_argument("--new-tokens", type=int, default=new_tokens, help=new_tokens_help)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=json_default, help="write the results here (and a .png next to it)")


def parse_model_args(ap, args, known, min_context: int, specs: bool = False) -> tuple[list[int], list[str]]:
    """(contexts, compressors) from `add_model_args`' options; `ap.error` names a bad length or unknown drafter.
    With `specs`, a drafter may carry fields ('refresh:draft_weights=int8', `parse_drafter_spec`): its name is
    checked."""
    contexts = parse_contexts(ap, args.context, min_context)
    compressors = [c for c in args.compressors.split(",") if c]
    unknown = [c for c in compressors if (c.split(":")[0] if specs else c) not in known]
    if unknown:
        ap.error(f"--compressors: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    if args.new_tokens < 1:
        ap.error(f"--new-tokens must be at least 1, got {args.new_tokens}")
    return contexts, compressors


def _field_value(value: str):
    """A field's value as written: int, float, else the string (e.g. draft_dtype=bfloat16)."""
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def parse_drafter_spec(spec: str, defaults: dict, overrides: dict | None, prog: str) -> tuple[str, dict]:
    """'name' or 'name:field=value:field=value' (an ablation, e.g. 'refresh:block=32:period=2',
    'refresh:ratio=8:draft_dtype=bfloat16') -> (name, fields) over the benchmark's `defaults[name]`, updated by
    `overrides` (e.g. --ratio) and then by the spec's own fields; a bad spec exits with `prog`'s one-line error."""
    name, *fields = spec.split(":")
    if name not in defaults:
        raise SystemExit(f"{prog}: error: unknown compressor {name!r}; expected one of {sorted(defaults)}")
    kw = {**defaults[name], **(overrides or {})}
    for f in fields:
        key, eq, value = f.partition("=")
        if not eq:
            raise SystemExit(f"{prog}: error: {f!r} in {spec!r} is not field=value")
        kw[key] = _field_value(value)
    return name, kw
