"""The Family protocol: everything the one decode engine needs from a model family, as a value.

A family is a frozen dataclass of functions (tpu-inference's `ModelInterface`, gemma's `TransformerLike`): the engine
(`kvjax.decode`), the schedulers (`kvjax.scheduling`), remote prefix serving (`kvjax.remote`) and the prefix cache
(`kvjax.prefix`) call these and never ask which family they run. A new family is one folder under `kvjax/models/`,
one file here and one registry line (`kvjax.families.registry`).

The functions, by what they serve (shapes: `B` batch, `T` new tokens, `x` draft length; caches are pytrees):

- loading: `config_from_hf(hf_dict) -> config`; `params_from_tensors(config, tensors, dtype) -> params`;
  `params_to_tensors(config, params, dtype)`; `hf_config_dict(config)`; `init_params(config, key, dtype)`.
- the full cache: `init_cache(config, batch, capacity, dtype) -> cache` — a dataclass pytree with a `layers` tuple
  (one state per layer: the full-cache scheduler admits it and remote serving streams it layer by layer) and
  `length` i32[B]; slots a prefill has not written hold init_cache's zeros (remote entries are trimmed to what was
  written); `forward(params, config, cache, tokens i32[B, T], n_valid i32[B], *, implementation=None,
  logit_rows=None) -> (logits f32[B, T, V] (f32[B, R, V] at logit_rows i32[B, R]), cache)` — prefill chunks and
  plain one-token decode; `verify_forward(...) -> (logits, cache, aux)` — the same over the full cache in the
  canonical verify arithmetic (the shape the reference decoder and VeriCache's verification share, bit for bit;
  aux is the family's by-product of it, e.g. queries for refreshing drafts, None when it has none);
  optionally `forward_with_masses(params, config, cache, tokens, n_valid, first i32[B], *, rows, block,
  implementation, logit_rows) -> (logits, cache, per-layer block masses or None)` — `forward` (the same logits and
  cache, bit for bit) that also sums the softmax mass the prompt rows at positions first..first + rows - 1 in the
  chunk put on each `block` of slots (the refreshing drafter's first selection, taken from the prefill: the
  compressor's `prompt_scoring`); `commit(params, config, before, after, tokens, keep_len, *, implementation) -> cache` — the state after a verify
  block rolled back to `keep_len[b]` tokens (masked, no reshape); optionally
  `decode_split(cache, rows) -> (invariant, carry)`, `decode_join(invariant, carry) -> cache`,
  `decode_carry(cache) -> carry`, `decode_merge(invariant, carry) -> cache` — how a decode loop of `rows` steps
  keeps the cache it only reads out of its carry (Llama: `kvjax.cache.chunked`); without them the loop carries
  the whole cache.
- the draft cache: a compressor (`compressor(name, **kw)`; names in `compressors`) is called as
  `compressor(params, config, full, prompt, *, recent_slots) -> draft`; a draft has `length`, `nbytes()`,
  `prompt_nbytes()` and `room()` (tokens it can take before a ring wraps or its capacity ends), and one pytree
  structure per compressor and capacity (the schedulers stack drafts of different prompts into one slot batch);
  `draft_forward(params, config, draft, tokens, n_valid) -> (logits, draft)`; `draft_commit(draft, full, start,
  keep, *, block) -> draft` — after a verify: forget the drafted state past `start`, take the `keep[b]` exact
  positions `start[b]..` from the committed full cache; `draft_split(draft) -> (invariant, changing)` and
  `draft_join(invariant | None, changing) -> draft` — what drafting never changes (kept out of loop carries and
  out of the rows the schedulers verify) and what it does; `draft_refresh(draft, full, aux, *, spec)` — a refreshing
  draft re-selects its prompt part from what the verify forward handed out.
- accounting: `read_bytes(cache, length)` — bytes one forward over `length` cached tokens reads.
- offload (full cache in host memory between verifications): `offload_split(full, tail_capacity) -> (host_part,
  device_part)` (it computes nothing on `full`: a scheduler splits host-resident caches too);
  `offload_join(fetched_host_part, device_part, length, prompt_len) -> full`; `offload_update(device_part, full,
  start, keep, prompt_len, *, block) -> device_part`.
- tensor parallelism: `shard_params(params, config, mesh, *, vocab=None) -> params` placed on a ("dp", "tp") mesh.
- loops: optionally `loop_params(params) -> params` — the layout the one-token loops (decode, drafting) read, made
  once per call before the loop (Llama fuses its projections: fewer, larger matmuls per step); optionally
  `pack_params(params) -> params` — the layout the native products read, giving the same hidden states as `params`
  (Llama packs its f32 projections and its output head for the CPU's native tiles). `Model.loop_params()` keeps the
  fused layout packed, and `Model.verify_params()` (what verify-shape forwards read) is that same layout where the
  family packs.
- the prefix cache: `prefix_layout(config, dtype, block_size) -> BlockLayout`.

A family that cannot do something leaves the field None; `require` raises `UnsupportedFeatureError` naming the family
and the feature.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from kvjax.errors import UnsupportedFeatureError


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """A model family as a value (hashable by identity, so jitted steps take it as a static argument)."""

    name: str
    model_types: tuple[str, ...]
    config_type: type
    config_from_hf: Callable[..., Any]
    params_from_tensors: Callable[..., Any]
    params_to_tensors: Callable[..., Any]
    hf_config_dict: Callable[..., Any]
    init_params: Callable[..., Any]
    init_cache: Callable[..., Any]
    read_bytes: Callable[..., Any]
    forward: Callable[..., Any]
    verify_forward: Callable[..., Any]
    commit: Callable[..., Any]
    decode_split: Callable[..., Any] | None = None
    decode_join: Callable[..., Any] | None = None
    decode_carry: Callable[..., Any] | None = None
    decode_merge: Callable[..., Any] | None = None
    draft_forward: Callable[..., Any] | None = None
    draft_commit: Callable[..., Any] | None = None
    draft_split: Callable[..., Any] | None = None
    draft_refresh: Callable[..., Any] | None = None
    draft_join: Callable[..., Any] | None = None
    compressor: Callable[..., Any] | None = None
    compressors: tuple[str, ...] = ()
    offload_split: Callable[..., Any] | None = None
    offload_join: Callable[..., Any] | None = None
    offload_update: Callable[..., Any] | None = None
    prefix_layout: Callable[..., Any] | None = None
    check_draft_len: Callable[..., Any] | None = None
    shard_params: Callable[..., Any] | None = None
    loop_params: Callable[..., Any] | None = None
    pack_params: Callable[..., Any] | None = None
    forward_with_masses: Callable[..., Any] | None = None
    default_compressor: str = "streaming"  # the draft maker used when none is named (chosen by measurement)
    # () -> its fields when none are given for it (None: the compressor's own defaults); a function because the best
    # setting depends on what the kernels here read directly (e.g. bf16 drafts)
    default_compressor_kw: Callable[[Any], dict] | None = None

    def require(self, field: str, feature: str) -> Callable[..., Any]:
        """The function `field`, or UnsupportedFeatureError naming this family and `feature`."""
        fn = getattr(self, field)
        if fn is None:
            raise UnsupportedFeatureError(self.name, feature)
        return fn

    def default_drafter(self, model=None, **kw) -> tuple[str, dict]:
        """(name, fields) of the draft maker used when none is named: `default_compressor` with
        `default_compressor_kw(model)` under the given `kw`."""
        base = self.default_compressor_kw(model) if self.default_compressor_kw is not None else {}
        return self.default_compressor, {**base, **kw}

    def make_compressor(self, name_or_compressor, *, model=None, **kw):
        """A draft maker of this family by name (`compressors`; None: `default_compressor` with
        `default_compressor_kw(model)` under the given `kw` -- `model`, when given, the one it will draft for), or the
        object itself when already one."""
        if name_or_compressor is None:
            name_or_compressor, kw = self.default_drafter(model, **kw)
        if not isinstance(name_or_compressor, str):
            return name_or_compressor
        make = self.require("compressor", "VeriCache draft caches")
        if name_or_compressor not in self.compressors:
            raise UnsupportedFeatureError(self.name, f"compressor {name_or_compressor!r}",
                                          f"this family's compressors are {', '.join(self.compressors)}")
        return make(name_or_compressor, **kw)

    def __repr__(self) -> str:
        return f"Family({self.name!r})"
