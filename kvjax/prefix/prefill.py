"""Prefill and generate through a PrefixCache: lookup -> execute the plan -> prefill the rest -> insert.

The rest of the prompt is prefilled with the same jitted `prefill_chunk` as a cold run. Chunk ends are placed at
block boundaries (every `chunk` tokens from the hit, plus the prompt's last full-block boundary), and the snapshot
forms (the SWA rings) are captured there, so the next request can hit at any of them. Only prompt tokens are
inserted: generated tokens' keys/values come from one-token decode steps, whose matmul shapes differ from prefill,
so reusing them would not reproduce a cold prefill.

Exactness: a hit restores bytes that a prefill with the same kernels produced; the recomputed part runs the same
`prefill_chunk`. Chunks start at the hit boundary instead of at 0, so XLA may group rows differently; the tests
check greedy tokens are identical to `kvjax.generate` and logits agree to float tolerance.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from kvjax.cache.capacity import pick_capacity
from kvjax.prefix import model_identity
from kvjax.prefix.identity import Namespace, make_namespace, weights_fingerprint
from kvjax.decode import steps


def kv_dtype(model):
    """The dtype `model` keeps caches in."""
    return model.cache_dtype


def model_namespace(model, prefix_cache, *, tenant_salt: str = "", adapters: Sequence[tuple[Any, float]] = (),
                    ) -> Namespace:
    """The namespace of `model` as cached by `prefix_cache`, every field derived from the model itself.

    Args:
        model: a `kvjax.api.Model`; its weights are fingerprinted by content (`identity.weights_fingerprint`: an
            in-place leaf update is a new namespace), its tokenizer files and chat template by content hashes.
        prefix_cache: the PrefixCache (its form fingerprints and block size are the layout).
        tenant_salt: per-tenant isolation set by the server.
        adapters: (adapter weights pytree, scale) per adapter applied to the model, in order.
    """
    forms = prefix_cache.forms
    tokenizer_rev, template_rev = model_identity.tokenizer_revisions(getattr(model, "tokenizer", None))
    return make_namespace(model.config, weights=weights_fingerprint(model.params),
                          kv_dtype=np.dtype(kv_dtype(model)).name,
                          formats={s.name: s.fingerprint for s in forms.specs}, block_size=forms.block_size,
                          tokenizer_rev=tokenizer_rev, template_rev=template_rev,
                          adapters=model_identity.adapter_fields(adapters),
                          # the attention implementation the model's steps run (kvjax.load(..., attention=))
                          runtime=model_identity.runtime_fields(model.params, model.attention),
                          tenant_salt=tenant_salt)


def prefill_with_prefix_cache(model, prompt, prefix_cache, *, namespace: Namespace | None = None,
                              capacity: int | None = None, chunk: int = steps.DEFAULT_CHUNK,
                              prompt_logprobs: bool = False, insert: bool = True, priority: int = 0):
    """Prefill one prompt (batch 1), reusing what `prefix_cache` holds.

    Args:
        model: a `kvjax.api.Model` of the Llama family.
        prompt: i32[T] token ids.
        prefix_cache: the PrefixCache (its forms must match the model).
        namespace: defaults to `model_namespace(model, prefix_cache)`.
        capacity: cache capacity (default: the bucket for T + 1).
        chunk: prefill chunk length (a multiple of the block size).
        prompt_logprobs: bypass hits (the request needs every prompt token's output).

    Returns:
        (logits f32[V] at the last prompt token, ModelCache holding the prompt, the executed Plan).
    """
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    T, P = prompt.size, prefix_cache.P
    if T == 0:
        raise ValueError("prompt must be non-empty")
    if chunk % P:
        raise ValueError(f"chunk={chunk} must be a multiple of the block size {P}")
    ns = namespace or model_namespace(model, prefix_cache)
    capacity = capacity or pick_capacity(T + 1)
    forms = prefix_cache.forms
    cache = forms.new_cache(capacity)
    plan = prefix_cache.lookup(ns, prompt, prompt_logprobs=prompt_logprobs)
    # `execute` releases the lease of any plan it abandons, and of the current one if it raises. The executed plan's
    # lease is held until after the insert: the chain this request read is pinned while it is extended, so admitting
    # the new blocks can never evict their own parents.
    cache, plan = prefix_cache.execute(plan, cache)
    try:
        return _prefill_rest(model, prompt, prefix_cache, ns, cache, plan, chunk, prompt_logprobs, insert, priority)
    finally:
        plan.lease.release()


def _prefill_rest(model, prompt, prefix_cache, ns, cache, plan, chunk, prompt_logprobs, insert, priority):
    T, P = prompt.size, prefix_cache.P
    forms = prefix_cache.forms
    b = plan.boundary
    last_full = (T // P) * P
    ends = sorted({e for e in range(b + chunk, T, chunk)} | ({last_full} if last_full > b else set()) | {T})
    snaps = {}
    want_snap = bool(prefix_cache.snap_forms) and insert
    logits, start = None, b
    for end in ends:
        while start < end:  # a piece longer than `chunk` (cannot happen with the schedule above, kept for safety)
            stop = min(end, start + chunk)
            buf = np.zeros((1, chunk), np.int32)
            buf[0, : stop - start] = prompt[start:stop]
            logits, _, cache = steps.prefill_chunk(model.params, model.config, cache, jnp.asarray(buf),
                                                   jnp.asarray([stop - start], jnp.int32), family=model.family,
                                                   impl=model.attention)
            start = stop
        if want_snap and end % P == 0 and end > b:
            snaps[end] = forms.snapshot(cache)
    if insert and not prompt_logprobs:
        prefix_cache.insert(ns, prompt, cache, snaps, priority=priority)
    return logits[0], cache, plan


def generate_with_prefix_cache(model, prompt_ids, max_new_tokens: int, prefix_cache, *,
                               namespace: Namespace | None = None, ignore_eos: bool = False,
                               return_plan: bool = False, chunk: int = steps.DEFAULT_CHUNK):
    """Greedy decoding like `kvjax.generate`, with the prompt prefilled through `prefix_cache`.

    `chunk` is the prefill chunk (snapshot forms are captured at chunk ends, see `prefill_with_prefix_cache`).

    Returns:
        i32[<= max_new_tokens] new token ids (and the Plan when `return_plan`).
    """
    ids = np.asarray(prompt_ids, np.int32).reshape(-1)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    last, cache, plan = prefill_with_prefix_cache(model, ids, prefix_cache, namespace=namespace,
                                                  capacity=pick_capacity(ids.size + max_new_tokens), chunk=chunk)
    first = jnp.argmax(last).astype(jnp.int32)[None]
    toks = [int(first[0])]
    if max_new_tokens > 1:
        rest, cache = steps.decode(model.loop_params(), model.config, cache, first, jnp.zeros((1,), jnp.int32),
                                   num_steps=max_new_tokens - 1, family=model.family, impl=model.attention)
        toks += [int(t) for t in np.asarray(rest[0])]
    out = np.asarray(toks, np.int32)
    if not ignore_eos:
        out = steps.truncate_at_eos(out, model.config.eos_token_ids)
    return (out, plan) if return_plan else out
