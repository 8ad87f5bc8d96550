"""VeriCache (arXiv 2605.17613): a lossy draft cache drafts, the full cache verifies — exact decoding, one request,
any model family.

Round: the drafter (same model, lossy draft cache) decodes `x` tokens in one jit call; the full cache checks all of
them in one x+1-row forward; tokens are accepted up to the first mismatch, the mismatch is replaced by the full
cache's token (or, if all x matched, the bonus token is kept). The accepted tokens' exact state goes into both
caches; nothing drafted survives. Output equals `reference_decode` token for token (the same verify-shape forward),
for greedy decoding and for position-keyed sampling alike.

Offloaded mode keeps the prompt's full state in pinned host memory and brings it back for each verify; tokens decoded
since stay on the device. Adaptive mode picks x per round from a small static set (each x compiles once): it grows
after a fully accepted round and shrinks after an early mismatch.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.arrays import same_shapes, tree_nbytes
from kvjax.cache.capacity import CAPACITY_BUCKETS, pick_capacity
from kvjax.decode import draft as draft_mod
from kvjax.decode import metrics
from kvjax.decode import offload as offl
from kvjax.decode import refresh as refresh_mod
from kvjax.decode import sampling, steps
from kvjax.decode import verify as verify_mod
from kvjax.decode.draft_length import make_policy
from kvjax.decode.draft_weights import draft_params
from kvjax.decode.metrics import RunMetrics
from kvjax.errors import InputError

MAX_DRAFT_LEN = 256  # x + 1 verify rows per round; beyond this a round costs more than it can win


def capacity_for(prompt_len: int, max_new_tokens: int, max_draft: int) -> int:
    """The one capacity rule: full-cache capacity bucket for prompt + new tokens + one verify block of slack.

    The reference decoder uses the same capacity (the cache length is part of the computation's shape).
    """
    return pick_capacity(prompt_len + max_new_tokens + max_draft + 2)


def check_draft_len(model, x: int) -> None:
    """Raise InputError unless 1 <= x <= MAX_DRAFT_LEN and the family can roll back x + 1 rows."""
    if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or not 1 <= x <= MAX_DRAFT_LEN:
        raise InputError(f"draft_len must be an integer in [1, {MAX_DRAFT_LEN}], got {x!r}")
    if model.family.check_draft_len is not None:
        model.family.check_draft_len(model.config, int(x))


def first_token(logits, prompt_len: int, seed, temperature: float):
    """The token after the prompt (position `prompt_len`), i32[1]."""
    return sampling.select_tokens(logits[None, None, :], jnp.asarray([[prompt_len]], jnp.int32), seed, temperature)[0]


def _draft_lengths(model, draft_len: int, adaptive) -> tuple:
    xs = tuple(sorted(adaptive)) if adaptive else (draft_len,)
    if draft_len not in xs:
        raise InputError(f"draft_len {draft_len} is not in the adaptive set {xs}")
    for x in xs:
        check_draft_len(model, x)
    return xs


def generate_vericache(model, prompt_ids, max_new_tokens: int, *, compressor=None, draft_len: int = 8,
                       offload: bool = False, temperature=0.0, seed: int = 0, rejection: bool = False,
                       adaptive: tuple | None = None, recent_slots: int = 256, compressor_kw: dict | None = None,
                       progress=None, return_logits: bool = False, should_stop=None, adaptive_policy: str = "cost",
                       return_logprobs: bool = False):
    """Exact decoding of one prompt with a lossy draft cache and full-cache verification.

    Args:
        model: a `kvjax.Model` of any family.
        prompt_ids: i32[P] prompt token ids.
        max_new_tokens: tokens to emit (a fixed length unless `should_stop` ends the run earlier).
        compressor: a draft maker or one of `model.family.compressors` by name (None: the family's
            `default_compressor`); `compressor_kw` are its fields.
        draft_len: x, tokens drafted per round (static).
        offload: keep the prompt's full state in pinned host memory between verifications.
        temperature: 0 = greedy; > 0 = position-keyed exact sampling (or rejection sampling when `rejection`); or a
            `sampling.Sampling` (temperature with top-k / top-p / min-p filters, applied identically everywhere).
        adaptive: static ascending set of x values to adapt over (starting at draft_len, which must be in it).
        adaptive_policy: "cost" (the x with the most predicted tokens/s from measured acceptance and phase times) or
            "grow_shrink" (`kvjax.decode.draft_length`).
        recent_slots: draft ring slots for decoded tokens.
        progress: optional callback(tokens_emitted, new_tokens i32[k]): the first token, then every round's.
        should_stop: optional callable(tokens emitted so far) -> bool, asked after every round: True ends the run
            there (the caller cuts at its exact stop token).
        return_logits: also return the logits row that chose each token, f32[max_new_tokens, V] (the first from the
            prefill, the rest from verification): bit-identical to `reference_decode(..., return_logits=True)`.
        return_logprobs: also return each emitted token's log-probability f32[max_new_tokens] under the exact
            (full-cache) distribution, computed from the verification's rows.

    Returns:
        (tokens i32[max_new_tokens], stats dict — see `kvjax.decode.metrics.RunMetrics.summary`; timings leave
        compilation out), plus the logits when `return_logits`, then the logprobs when `return_logprobs`.
    """
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if rejection and sampling.as_sampling(temperature).greedy:
        raise InputError("rejection sampling needs temperature > 0")
    comp = model.family.make_compressor(compressor, model=model, **(compressor_kw or {}))
    draft_params(model, comp.draft_weights)  # checked (and made once) before any compute
    xs = _draft_lengths(model, draft_len, adaptive)
    full, first, first_logits, *scored = prefill_for(model, prompt_ids, max_new_tokens, max_draft=xs[-1],
                                                     temperature=temperature, seed=seed, return_logits=True,
                                                     scoring=comp.prompt_scoring)
    return run_vericache(model, full, first, prompt_ids, max_new_tokens, compressor=comp, draft_len=draft_len,
                         prompt_masses=scored[0] if scored else None,
                         offload=offload, temperature=temperature, seed=seed, rejection=rejection, adaptive=adaptive,
                         recent_slots=recent_slots, progress=progress, should_stop=should_stop,
                         adaptive_policy=adaptive_policy,
                         first_logits=first_logits, return_logits=return_logits,
                         return_logprobs=return_logprobs)


def scored(comp, prompt_masses) -> dict:
    """The keyword that hands a prefill's prompt masses to drafter `comp`, where there are some and it takes them
    (`Compressor.prompt_scoring`; other families' drafters take no such keyword)."""
    return {"prompt_masses": prompt_masses} if prompt_masses is not None and comp.prompt_scoring is not None else {}


def prefill_for(model, prompt_ids, max_new_tokens: int, *, max_draft: int, temperature: float = 0.0, seed: int = 0,
                return_logits: bool = False, on_chunk=None, scoring: tuple[int, int] | None = None):
    """Prefilled full cache (capacity by `capacity_for`) and the first token: (cache, first i32[1]) — plus the last
    prompt row's logits f32[V] when `return_logits` — plus, with `scoring` (a drafter's `prompt_scoring`), the
    prompt masses the prefill handed out for it (`steps.prefill`; None where it could not)."""
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    full = model.family.init_cache(model.config, 1, capacity_for(prompt.size, max_new_tokens, max_draft),
                                   model.cache_dtype)
    logits, full, *masses = steps.prefill(model, full, prompt, on_chunk=on_chunk, scoring=scoring)
    first = first_token(logits, prompt.size, jnp.asarray([seed], jnp.int32), temperature)
    return (full, first) + ((logits,) if return_logits else ()) + tuple(masses)


def run_vericache(model, full, first, prompt_ids, max_new_tokens: int, *, compressor, draft_len: int = 8,
                  offload: bool = False, temperature: float = 0.0, seed: int = 0, rejection: bool = False,
                  adaptive: tuple | None = None, recent_slots: int = 256, progress=None, draft_cache=None,
                  first_logits=None, should_stop=None, adaptive_policy: str = "cost", return_logits: bool = False,
                  return_logprobs: bool = False, on_round=None, prompt_masses=None):
    """VeriCache rounds from an already prefilled full cache (`prefill_for`); `full` is consumed (donated).

    Same arguments and result as `generate_vericache`; the prefill is not part of the timed decode, and neither is a
    round that compiled (`kvjax.decode.metrics`).
    `draft_cache`: an already compressed draft cache of this prompt (consumed; its ring must hold x + 1 rows) —
    benchmarks compress once and reuse it; `compressor` then only names the run. `first_logits`: the prefill's last
    row f32[V], needed by `return_logits` (every emitted token's logits row) and `return_logprobs` (every emitted
    token's log-probability under the exact full-cache distribution, f32[n], returned after the logits).
    `on_round(new i32[k], their logprobs f32[k] or None)`: called with the first token, then each round's tokens.
    `prompt_masses`: the prompt's scores the prefill handed out for the drafter (`prefill_for(scoring=...)`), which
    it then need not compute (`Compressor.__call__`).
    """
    params, config, family, impl = model.params, model.config, model.family, model.attention
    comp = family.make_compressor(compressor, model=model)
    xs = _draft_lengths(model, draft_len, adaptive)
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    P = prompt.size
    xmax = xs[-1]
    seed_a = jnp.asarray([seed], jnp.int32)
    met = RunMetrics(name=f"vericache[{getattr(comp, 'name', type(comp).__name__)}]", params=params)
    # what drafting reads: the model's weights or their bf16 copy (checked, and made once per model, before any compute)
    dparams = draft_params(model, comp.draft_weights)
    vparams = model.verify_params()  # what verification reads (`Model.verify_params`: the loops' packed layout on CPU)
    t0 = time.perf_counter()
    if draft_cache is None:
        dcache = comp(params, config, full, prompt, recent_slots=max(recent_slots, xmax + 1),
                      **scored(comp, prompt_masses))
    else:
        dcache = draft_cache
    jax.block_until_ready(dcache)
    met.compress_s = time.perf_counter() - t0
    met.full_prompt_bytes = family.read_bytes(full, P)
    fixed_bytes = family.read_bytes(full, 0)  # a verify reads these plus row_bytes per cached token
    row_bytes = family.read_bytes(full, 1) - fixed_bytes
    met.draft_prompt_bytes = dcache.prompt_nbytes()
    met.draft_bytes = dcache.nbytes()

    if offload:
        split = family.require("offload_split", "offload (full cache in host memory)")
        host_part, device_part = split(full, pick_capacity(max_new_tokens + xmax + 2, CAPACITY_BUCKETS))
        host_part = offl.to_host(host_part)
        length = full.length
        prompt_len = jnp.asarray([P], jnp.int32)
        jax.block_until_ready((host_part, device_part))
        met.h2d_bytes_per_verify = tree_nbytes(host_part)  # read from host memory: copied over, or lent
        met.offload_in_place = offl.lends(host_part)
        del full
        met.device_resident_bytes = tree_nbytes(device_part) + met.draft_bytes
        met.device_peak_bytes = met.device_resident_bytes + met.h2d_bytes_per_verify
    else:
        met.device_resident_bytes = tree_nbytes(full) + met.draft_bytes
        met.device_peak_bytes = met.device_resident_bytes

    lent = False  # offload: this round's verify was lent the host part (`offload.lends`) and hands it back
    out = [int(first[0])]
    if (return_logits or return_logprobs) and first_logits is None:
        raise InputError("return_logits / return_logprobs need first_logits (the prefill's last row)")
    rows = [np.asarray(first_logits)[None]] if return_logits else None
    lps = [np.asarray(steps.token_logprobs(jnp.asarray(first_logits)[None], first))] if return_logprobs else None
    jitted = (draft_mod.draft_step, verify_mod.verify_offloaded if offload else verify_mod.verify_step,
              refresh_mod.refresh_step)
    if progress is not None:
        progress(1, np.asarray(first))
    if on_round is not None:
        on_round(np.asarray(first), None if lps is None else lps[0])
    if should_stop is not None and should_stop(out):
        max_new_tokens = 1
    last = np.asarray(first)  # every round hands the jitted steps a host array (one compiled signature)
    x = draft_len
    t_start = time.perf_counter()
    spec = getattr(dcache, "refresh", None)
    since = (0, 0)  # (verifications, drafted tokens) since the refreshing draft last re-selected
    policy = make_policy(adaptive_policy, xs) if len(xs) > 1 else None
    while len(out) < max_new_tokens:
        compiled_before = metrics.jit_cache_sizes(jitted)
        ta = time.perf_counter()
        drafts, qlog, dcache = draft_mod.draft_step(dparams, config, dcache, last, seed_a, x=x,
                                                    temperature=temperature, rejection=rejection, family=family,
                                                    impl=impl)
        drafts.block_until_ready()
        tb = time.perf_counter()
        if offload:
            lent = offl.lends(host_part)
            if lent:  # (the CPU) the verify reads the host copy itself and hands it back
                fetched, host_part = host_part, None
            else:
                fetched = offl.fetch(host_part)
            jax.block_until_ready(fetched)
            tc = time.perf_counter()
            emitted, n, device_part, dcache, logits, aux, committed = verify_mod.verify_offloaded(
                vparams, config, fetched, device_part, length, prompt_len, dcache, last, drafts, qlog, seed_a,
                temperature=temperature, rejection=rejection, family=family, impl=impl)
            length = length + n + 1
        else:
            tc = tb
            emitted, n, full, dcache, logits, aux = verify_mod.verify_step(
                vparams, config, full, dcache, last, drafts, qlog, seed_a, temperature=temperature,
                rejection=rejection, family=family, impl=impl)
            committed = full
        n_host = int(np.asarray(n)[0])
        # sliced on the host: a device array sliced by a new length compiles a slice for it (~30 ms each, up to x + 1
        # lengths per x, charged to the round's verify and to the adaptive policy's estimate of it)
        emitted_host = np.asarray(emitted)
        new = emitted_host[0, :n_host + 1]
        td = time.perf_counter()
        reselect, drafted_since = False, 0
        if spec is not None:
            drafted_since = since[1] + x  # tokens drafted since the last re-selection, this round's included
            reselect, since = spec.after_verify(since, x)
            if reselect:
                dcache = refresh_mod.refresh_step(dcache, committed, aux, family=family)
                jax.block_until_ready(dcache)
        if lent:
            host_part = offl.take_back(family, committed)
        del committed
        te = time.perf_counter()
        ctx = P + len(out) - 1  # tokens in the full cache before this round
        kept = min(n_host + 1, max_new_tokens - len(out))  # a last round may verify past the end: not counted
        compiled = metrics.jit_cache_sizes(jitted) != compiled_before
        met.add_round(x=x, accepted=min(n_host, kept), draft_s=tb - ta, transfer_s=tc - tb, verify_s=td - tc,
                      refresh_s=te - td, compiled=compiled, kept=kept,
                      draft_read_bytes=x * (met.param_bytes + met.draft_bytes),
                      verify_read_bytes=met.param_bytes + fixed_bytes + ctx * row_bytes,
                      h2d_bytes=met.h2d_bytes_per_verify if offload else 0)
        out.extend(int(t) for t in new)
        if rows is not None:
            rows.append(np.asarray(logits[0])[:n_host + 1])
        if lps is not None:  # outside the timed round: only asked-for work, compiled once per x
            lps.append(np.asarray(steps.token_logprobs(logits[0], emitted[0]))[:n_host + 1])
        last = emitted_host[:, n_host]  # a host array, taken as is by the next jitted call (jnp.asarray: ~0.2 ms)
        if progress is not None:
            progress(min(len(out), max_new_tokens), new)
        if on_round is not None:
            on_round(new, None if lps is None else lps[-1])
        if policy is not None:
            # a round's fixed part: verify and transfer; a re-selection is charged per token drafted since the last
            # (not from a round that compiled: its first re-selection compiles too)
            x = policy.next(x, n_host, tb - ta, td - tb, te - td, drafted_since if reselect and not compiled else 0)
        if should_stop is not None and should_stop(out):
            break
    met.decode_s = time.perf_counter() - t_start
    toks = np.asarray(out[:max_new_tokens], np.int32)
    met.emitted = int(toks.size)
    result = (toks, met.summary())
    if rows is not None:
        result += (np.concatenate(rows, axis=0)[:max_new_tokens],)
    if lps is not None:
        result += (np.concatenate(lps)[:max_new_tokens],)
    return result


def reference_decode(model, prompt_ids, max_new_tokens: int, *, draft_len: int = 8, temperature: float = 0.0,
                     seed: int = 0, max_draft: int | None = None, return_margins: bool = False,
                     return_logits: bool = False, progress=None, prefilled=None):
    """kvjax's full-cache reference decoder: one token per step through the verify shape (T = x + 1, row 0).

    Args:
        draft_len: x of the VeriCache run to compare with (the verify block shape).
        max_draft: largest x of an adaptive run (sets the cache capacity like `generate_vericache`).
        return_margins: also return f32[max_new_tokens] top-1 minus top-2 logit at each step.
        return_logits: also return the logits row that chose each token, f32[max_new_tokens, V].
        progress: optional callback(tokens_done).
        prefilled: (last-row logits, full cache) that `steps.prefill` left for this prompt in a fresh cache of this
            capacity (`capacity_for`): a copy is decoded instead of prefilling again -- the same program on the same
            inputs, so the same bits (`kvjax generate --compare-full` checks a run against its own prefill this way
            when no prefix cache restored it, a prefill fewer). A cache of another shape raises ValueError.

    Returns:
        tokens i32[max_new_tokens] (then margins, then logits, as asked).
    """
    from kvjax.decode.reference import reference_step  # noqa: PLC0415 - sibling module, kept apart for clarity

    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_draft_len(model, draft_len)
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    seed_a = jnp.asarray([seed], jnp.int32)
    capacity = capacity_for(prompt.size, max_new_tokens, max_draft or draft_len)
    if prefilled is None:
        full = model.family.init_cache(model.config, 1, capacity, model.cache_dtype)
        logits, full = steps.prefill(model, full, prompt)
    else:
        logits, full = prefilled[0], prefilled_copy(model, prefilled[1], capacity)
    tok = first_token(logits, prompt.size, seed_a, temperature)
    out, margins, rows = [int(tok[0])], [_margin(logits)], [np.asarray(logits)]
    vparams = model.verify_params()  # the layout VeriCache verifies with: its reference must read the same
    for _ in range(max_new_tokens - 1):
        tok, row, full, _ = reference_step(vparams, model.config, full, tok, seed_a, x=draft_len,
                                        temperature=temperature, family=model.family, impl=model.attention)
        out.append(int(tok[0]))
        if return_margins:
            margins.append(_margin(row[0]))
        if return_logits:
            rows.append(np.asarray(row[0]))
        if progress is not None:
            progress(len(out))
    result = [np.asarray(out, np.int32)]
    if return_margins:
        result.append(np.asarray(margins, np.float32))
    if return_logits:
        result.append(np.stack(rows))
    return tuple(result) if len(result) > 1 else result[0]


def prefilled_copy(model, full, capacity: int):
    """A copy of a prefilled cache `full`, checked to be shaped as a fresh cache of `capacity` (ValueError if not)."""
    if not shaped_as_cache(model, full, capacity):
        raise ValueError(f"the prefilled cache is not shaped as a cache of capacity {capacity} for this model")
    return jax.tree.map(jnp.copy, full)


def shaped_as_cache(model, full, capacity: int) -> bool:
    """Whether `full` has the shapes of `model`'s fresh B = 1 cache of `capacity` (nothing is allocated to tell)."""
    return same_shapes(full, jax.eval_shape(lambda: model.family.init_cache(model.config, 1, capacity,
                                                                            model.cache_dtype)))


def _margin(logits) -> float:
    top = jax.lax.top_k(jnp.reshape(logits, (-1,)), 2)[0]
    return float(top[0] - top[1])
