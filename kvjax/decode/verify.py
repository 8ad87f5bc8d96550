"""Verification for every family: one x+1-row forward over the full cache, the accept rule, the commit.

The block is [last emitted token, x drafts]. Row j predicts the token at position L+1+j. Greedy / position-keyed
sampling: drafts are accepted up to the first one that differs from the full cache's own choice, and that choice (or,
when all x match, the bonus token of row x) is emitted next — `accept`, the one accept rule. Rejection sampling uses
`sampling.rejection_accept`. The family's `commit` rolls the state back to the accepted tokens (masked, never a
reshape) and its `draft_commit` hands their exact state to the draft cache; nothing drafted survives.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.arrays import device_space
from kvjax.decode import offload as offl
from kvjax.decode import sampling


def accept(drafts: jax.Array, target: jax.Array):
    """The accept rule. drafts i32[B, x]; target i32[B, x+1] the full cache's tokens for positions L+1..L+x+1.

    Returns (n i32[B] accepted drafts, next i32[B] the full cache's token after them).
    """
    x = drafts.shape[1]
    match = (drafts == target[:, :x]).astype(jnp.int32)
    n = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
    return n, jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]


def verify_core(params, config, full, dcache, last, drafts, qlog, seed, *, temperature: float, rejection: bool,
                family, impl: str):
    """Verify + accept + commit (traced inside a jit). Returns (emitted i32[B, x+1], n i32[B], full, dcache, logits
    f32[B, x+1, V], aux).

    emitted[:, :n+1] are the new tokens (n accepted drafts, then the full cache's own token); logits[:, j] is the row
    that chose emitted[:, j]; aux is what the family's verify forward hands out besides (Llama: two rows' queries,
    which a refreshing draft scores with, `kvjax.decode.refresh`). `dcache` None: no draft to update (the remote
    stream's fetch-full path).
    """
    B, x = drafts.shape
    L = full.length
    tokens = jnp.concatenate([last[:, None].astype(jnp.int32), drafts], axis=1)
    logits, after, aux = family.verify_forward(params, config, full, tokens, jnp.full((B,), x + 1, jnp.int32),
                                               implementation=impl)
    positions = L[:, None] + 1 + jnp.arange(x + 1, dtype=jnp.int32)[None, :]  # positions of predicted tokens
    if rejection:
        n, nxt = sampling.rejection_accept(logits, qlog, drafts, positions, seed, temperature)
    else:
        n, nxt = accept(drafts, sampling.select_tokens(logits, positions, seed, temperature))
    j = jnp.arange(x + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    emitted = jnp.where(j < n[:, None], padded, nxt[:, None])
    keep = n + 1  # rows kept in the caches: last + n accepted drafts
    full = family.commit(params, config, full, after, tokens, L + keep, implementation=impl)
    if dcache is not None:
        dcache = family.draft_commit(dcache, full, L, keep, block=x + 1)
    return emitted, n, full, dcache, logits, aux


@functools.partial(jax.jit, static_argnames=("temperature", "rejection", "family", "impl"),
                   donate_argnames=("full", "dcache"))
def verify_step(params, config, full, dcache, last, drafts, qlog, seed, *, temperature: float = 0.0,
                rejection: bool = False, family, impl: str):
    """Resident verify: one x+1-row forward over the full cache, accept, commit, update the draft.

    Args:
        full: the full cache with length L (donated); dcache: the draft cache after drafting (donated).
        last: i32[B]; drafts: i32[B, x]; qlog: draft logits (rejection sampling only); seed: i32[B].

    Returns:
        (emitted i32[B, x+1], n i32[B], full, dcache, logits f32[B, x+1, V], aux).
    """
    return verify_core(params, config, full, dcache, last, drafts, qlog, seed, temperature=temperature,
                       rejection=rejection, family=family, impl=impl)


def verify_offloaded(params, config, host_part, device_part, length, prompt_len, dcache, last, drafts, qlog, seed, *,
                     temperature: float = 0.0, rejection: bool = False, family, impl: str):
    """Verify with the prompt's full state just brought back from host memory, or lent where it lies (the CPU:
    `offload.lends`; the committed cache then comes back in host memory, holding the lent buffers).

    The full cache is assembled on the device from the fetched `host_part` (donated, so the assembly writes into the
    transferred buffers) and the always-resident `device_part` (`family.offload_join`); the verify forward then runs
    on a cache bitwise equal to the resident one; only the device part keeps the accepted rows.

    Returns:
        (emitted, n, device_part, dcache, logits, aux, scratch) — scratch is the assembled (committed) full cache,
        returned so the donated transferred buffers can be aliased (assembled in place); a refreshing draft re-selects
        from it, everyone else drops it.
    """
    args = (params, config, host_part, device_part, length, prompt_len, dcache, last, drafts, qlog, seed)
    if offl.lends(host_part):
        return lent_verifier(offl.device_of(host_part), temperature, rejection, family, impl)(*args)
    return verify_fetched(*args, temperature=temperature, rejection=rejection, family=family, impl=impl)


def _verify_offloaded(params, config, host_part, device_part, length, prompt_len, dcache, last, drafts, qlog, seed, *,
                      temperature: float = 0.0, rejection: bool = False, family, impl: str):
    B, x = drafts.shape
    lent = offl.in_host_space(host_part)  # the CPU: the host copy itself, read in place (`offload.lends`)
    full = family.offload_join(device_space(host_part), device_part, length, prompt_len)
    L = full.length
    emitted, n, full, dcache, logits, aux = verify_core(params, config, full, dcache, last, drafts, qlog, seed,
                                                        temperature=temperature, rejection=rejection,
                                                        family=family, impl=impl)
    device_part = family.offload_update(device_part, full, L, n + 1, prompt_len, block=x + 1)
    return emitted, n, device_part, dcache, logits, aux, offl.host_space(full) if lent else full


_OFFLOADED = dict(static_argnames=("temperature", "rejection", "family", "impl"),
                  donate_argnames=("host_part", "device_part", "dcache"))
verify_fetched = jax.jit(_verify_offloaded, **_OFFLOADED)  # `verify_offloaded`'s program for a fetched host part


_LENT: dict = {}  # (body, device, static arguments) -> `lent_verifier`'s program


def lent_verifier(device, temperature: float, rejection: bool, family, impl: str, body=None, n_args: int = 11):
    """`verify_offloaded`'s program for a host part lent on `device` (`offload.lends`), its static arguments bound:
    every argument's and output's memory kind given -- JAX pairs a donated input with an output of its shape
    whatever their memories unless it knows all of them, and a host buffer handed to a device output aborts the
    process (a tail as long as the prompt's capacity did). Positional arguments only (jit takes no keyword
    arguments with `in_shardings`).

    `body` (default `_verify_offloaded`): a program laid out as it is -- `n_args` positional arguments of which the
    third is the host part, the fourth the device part and the seventh the draft state (those three donated), seven
    outputs of which the last is the committed cache -- e.g. the scheduler's verify with its row hand-offs
    (`kvjax.scheduling.batch_steps.verify_row`)."""
    body = _verify_offloaded if body is None else body
    key = (body, n_args, device, temperature, rejection, family, impl)
    if key not in _LENT:
        host, dev = offl.shardings(device)
        ins = (dev, dev, host) + (dev,) * (n_args - 3)  # params, config, host_part, device_part, length, ..., seed
        fn = functools.partial(body, temperature=temperature, rejection=rejection, family=family, impl=impl)
        _LENT[key] = jax.jit(fn, in_shardings=ins, out_shardings=(dev,) * 6 + (host,), donate_argnums=(2, 3, 6))
    return _LENT[key]


# `verify_offloaded` is two kinds of program: compiles are counted over both (`kvjax.decode.metrics.jit_cache_sizes`)
verify_offloaded._cache_size = lambda: verify_fetched._cache_size() + sum(
    f._cache_size() for key, f in _LENT.items() if key[0] is _verify_offloaded)
