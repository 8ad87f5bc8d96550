"""One interface for lossy draft compressors: full cache of a prefilled prompt -> `DraftCache`.

A compressor has a static budget (a compression ratio over the prompt's tokens, turned into a fixed slot count per
prompt length, so one prompt length compiles once) and builds, for every full-attention layer, the compressed prompt
parts of a `DraftLayer`. Sliding-window layers are never compressed: their draft keeps the last `W` prompt tokens
exactly (they are already small). Each draft layer also gets an empty recent ring for the tokens decoded later.

Positions stay the ORIGINAL absolute positions (no re-rotation; keys were rotated at their own positions when the
full cache was written).

`draft_dtype` stores the full-precision prompt parts (the kept tokens) in bfloat16 instead of float32: half the bytes
a draft token reads from them. The native attention kernel reads them as bf16 (no f32 copy); the recent ring stays
float32 (small, written every step), and verification reads the float32 full cache as always, so VeriCache's output
is unchanged — only acceptance can move. `draft_dtype="int8"` stores them as int8 codes with a scale per head and
slot (`Int8KV`): a quarter of float32's bytes, attended natively without a dequantised copy.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvjax.arrays import in_device_memory
from kvjax.cache.draft import DraftCache, DraftLayer, Int8KV, RecentKV, SparseKV
from kvjax.cache.dense import DenseKV, ModelCache, WindowKV
from kvjax.models.llama.config import ModelConfig
from pallas_kernels import native


def round_up(n: int, m: int) -> int:
    return int(math.ceil(n / m) * m)


def gather_tokens(x: jax.Array, pos: jax.Array) -> jax.Array:
    """x [B, K, S, D] at slots pos (i32[B, C] or [B, K, C], -1 -> zeros) -> [B, K, C, D]."""
    B, K = x.shape[:2]
    if pos.ndim == 2:
        pos = jnp.broadcast_to(pos[:, None, :], (B, K, pos.shape[-1]))
    g = jnp.take_along_axis(x, jnp.maximum(pos, 0)[..., None], axis=2)
    return jnp.where((pos >= 0)[..., None], g, 0).astype(x.dtype)


def gather_blocks(x: jax.Array, pos: jax.Array, block: int) -> jax.Array:
    """`gather_tokens` for a selection made of whole blocks: pos i32[B, K, C] holds runs of `block` consecutive
    positions starting at multiples of `block` (-1 where masked). Copies each block as one `block * D` slice
    instead of `block` separate rows (the tiny model's heads at 32K slots, a 4x budget: 1.5-2x faster alone;
    inside a whole refresh step, which the block scoring dominates, no measurable difference); the
    values are the same copies. Falls back to `gather_tokens` when the slots do not divide into blocks."""
    B, K, S, D = x.shape
    if S % block or pos.ndim != 3 or pos.shape[-1] % block:
        return gather_tokens(x, pos)
    runs = pos.reshape(B, K, -1, block)
    idx = jnp.maximum(jnp.max(runs, axis=-1), 0) // block  # a block's one index; a wholly masked run reads block 0
    xb = x.reshape(B, K, S // block, block * D)
    g = jnp.take_along_axis(xb, idx[..., None], axis=2, mode="clip").reshape(B, K, -1, D)
    return jnp.where((pos >= 0)[..., None], g, 0).astype(x.dtype)


def sinks_and_recent(length: jax.Array, sinks: int, recent: int) -> jax.Array:
    """i32[B, sinks + recent] positions {0..sinks-1} U {L-recent..L-1} (StreamingLLM); all of 0..L-1 when short."""
    C = sinks + recent
    i = jnp.arange(C, dtype=jnp.int32)[None, :]
    L = length[:, None]
    short = jnp.where(i < L, i, -1)
    long = jnp.where(i < sinks, i, L - recent + (i - sinks))
    return jnp.where(L <= C, short, long).astype(jnp.int32)


DRAFT_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}  # int8: `Int8KV` codes
DRAFT_WEIGHTS = ("float32", "bfloat16", "int8", "int_dot")  # what a draft reads (`kvjax.decode.draft_weights`)


def sparse_part(form, pos: jax.Array, dtype: str = "float32", gather=gather_tokens) -> SparseKV:
    """A layer's tokens at slots `pos` (`gather_tokens`' forms) as a sparse prompt part stored in `dtype`
    (a `DRAFT_DTYPES` name; "int8": an `Int8KV` of codes and per-slot scales)."""
    if dtype == "int8":
        return int8_part(form, pos, gather)
    dt = DRAFT_DTYPES[dtype]
    if _native_f32(form):  # one native pass (XLA:CPU's fused gather and conversion: ~1 ns per element)
        return SparseKV(k=native.gather_rows(form.k, pos, dt), v=native.gather_rows(form.v, pos, dt), pos=pos)
    return SparseKV(k=gather(form.k, pos).astype(dt), v=gather(form.v, pos).astype(dt), pos=pos)


def _native_f32(form) -> bool:
    """Whether `form`'s rows are gathered natively: an f32 cache on the CPU where the native kernels build."""
    return form.k.dtype == jnp.float32 and native.runs_here()


def int8_part(form, pos: jax.Array, gather=gather_tokens) -> Int8KV:
    """A layer's tokens at slots `pos` as an `Int8KV`: gathered and quantised in one native pass on CPU (f32 caches,
    `pallas_kernels.native.gather_int8`: with XLA:CPU's form of it SmolLM2's re-selection at 8K took 74 ms against
    23 ms in bf16), else `Int8KV.quantize` of `gather`'s rows (the same codes and scales)."""
    if _native_f32(form):
        kc, ks = native.gather_int8(form.k, pos)
        vc, vs = native.gather_int8(form.v, pos)
        return Int8KV(k=kc, v=vc, k_scale=ks, v_scale=vs, pos=pos.astype(jnp.int32))
    return Int8KV.quantize(gather(form.k, pos), gather(form.v, pos), pos)


def sinks_and_recent_part(form, length: jax.Array, sinks: int, recent: int, dtype: str = "float32") -> SparseKV:
    """The exact keys and values of a layer's sinks and last `recent` prompt tokens, as one sparse part (what the
    quantizing drafters keep at full precision), stored in `dtype`."""
    return sparse_part(form, sinks_and_recent(length, sinks, recent), dtype)


def protected_mask(length: jax.Array, S: int, sinks: int, recent: int) -> jax.Array:
    """bool[B, S]: slot is a sink or among the last `recent` prompt tokens."""
    s = jnp.arange(S)[None, :]
    L = length[:, None]
    return (s < jnp.minimum(sinks, L)) | ((s >= L - recent) & (s < L))


def topk_positions(scores: jax.Array, length: jax.Array, budget: int, exclude: jax.Array | None = None) -> jax.Array:
    """Per-head top-`budget` slots of scores f32[B, K, S] among slots < length[b] (and not `exclude` [B, S]).

    Returns i32[B, K, budget] positions in ascending order, -1 where fewer slots were eligible.
    """
    B, K, S = scores.shape
    ok = jnp.arange(S)[None, None, :] < length[:, None, None]
    if exclude is not None:
        ok &= ~exclude[:, None, :]
    sc = jnp.where(ok, scores, -jnp.inf)
    vals, idx = jax.lax.top_k(sc, budget)
    pos = jnp.where(vals > -jnp.inf, idx, S + 1)  # protected slots score +inf and are kept
    pos = jnp.sort(pos, axis=-1)  # ascending: neighbours stay together in memory
    return jnp.where(pos > S, -1, pos).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Compressor:
    """Base: subclasses implement `layer_parts` for full-attention layers (and `prepare` for scoring).

    Attributes:
        ratio: full prompt tokens / kept tokens per head (e.g. 4.0 keeps a quarter); quantizers ignore it.
        sinks: first tokens always kept in full precision.
        draft_dtype: "float32" (default), "bfloat16" or "int8" (`Int8KV` codes): how the kept tokens' keys and values
            are stored (keyword only).
        draft_weights: the weights the draft reads, "float32" (the model's), "bfloat16" (a bf16 copy: half the
            bytes per draft token) or "int8" (int8 codes, a scale per output column: a quarter); verification keeps
            the f32 weights, so output is unchanged (`kvjax.decode.draft_weights`; keyword only).
        max_kept: at most this many kept tokens per head whatever the prompt's length (None: no cap; keyword only).
            A draft token's cost grows with the kept tokens while acceptance saturates, so a long prompt is best
            drafted from a fixed number of tokens rather than a fixed fraction (README "Cheaper drafts").
    """

    ratio: float = 4.0
    sinks: int = 4
    name: str = dataclasses.field(default="base", init=False)
    draft_dtype: str = dataclasses.field(default="float32", kw_only=True)
    draft_weights: str = dataclasses.field(default="float32", kw_only=True)
    max_kept: int | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        if not self.ratio >= 1:  # also NaN
            raise ValueError(f"ratio (prompt tokens per kept token) must be >= 1, got {self.ratio!r}")
        if self.draft_dtype not in DRAFT_DTYPES:
            raise ValueError(f"draft_dtype must be one of {sorted(DRAFT_DTYPES)}, got {self.draft_dtype!r}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights must be one of {DRAFT_WEIGHTS}, got {self.draft_weights!r}")
        if self.max_kept is not None and (isinstance(self.max_kept, bool) or not isinstance(self.max_kept, int)
                                          or self.max_kept < 32):
            raise ValueError(f"max_kept (kept tokens per head) must be an integer >= 32 or None, got {self.max_kept!r}")

    @property
    def reads_host_memory(self) -> bool:
        """Whether `__call__` may be handed a prefilled cache that lies in host memory ("pinned_host") where a jit
        reads it in place (the CPU, `kvjax.decode.offload.lends`): the scheduler then compresses the request's host
        copy instead of fetching a device copy first. Only drafters whose every read of the cache is such a jit say
        yes (`Refresh`); the draft cache is made in device memory either way."""
        return False

    def budget(self, prompt_len: int) -> int:
        """Kept slots per head for a prompt of `prompt_len` tokens (static; a multiple of 32; at most `max_kept`)."""
        kept = prompt_len / self.ratio if self.max_kept is None else min(prompt_len / self.ratio, self.max_kept)
        return max(32, round_up(kept, 32))

    @property
    def prompt_scoring(self) -> tuple[int, int] | None:
        """(rows, block) when this drafter scores a prompt by the softmax mass its last `rows` tokens put on each
        `block` of slots: a prefill asked for them (`kvjax.decode.steps.prefill(scoring=...)`) hands them out from
        its own attention, and `__call__(prompt_masses=...)` then skips scoring; None: this drafter does not."""
        return None

    def prepare(self, params, config: ModelConfig, full: ModelCache, prompt) -> dict:
        """Per-prompt data shared by all layers (scores); default none."""
        return {}

    def prepare_scored(self, full: ModelCache, prompt_masses: tuple) -> dict:
        """`prepare`'s data from the masses a prefill handed out (`prompt_scoring`); only drafters that score."""
        raise TypeError(f"the {self.name!r} drafter does not score prompts by their last tokens' attention "
                        "(prompt_scoring is None), so it takes no prompt_masses")

    def layer_parts(self, i: int, form: DenseKV, length: jax.Array, prompt_len: int, data: dict) -> tuple:
        raise NotImplementedError

    def __call__(self, params, config: ModelConfig, full: ModelCache, prompt, *, recent_slots: int,
                 prompt_masses: tuple | None = None) -> DraftCache:
        """Build the draft cache of a prefilled prompt.

        Args:
            full: the full cache right after prefill (length = prompt length, not donated here).
            prompt: i32[T] the prompt token ids (scorers re-read it).
            recent_slots: ring slots per layer for decoded tokens; sliding layers get at least W + recent_slots.
            prompt_masses: the prompt's scores as the prefill handed them out (`prompt_scoring`), or None: the
                drafter scores the prompt itself.
        """
        prompt_len = int(full.length[0])
        data = (self.prepare(params, config, full, prompt) if prompt_masses is None
                else self.prepare_scored(full, prompt_masses))
        B = full.length.shape[0]
        layers = []
        for i, form in enumerate(full.layers):
            K, D = form.k.shape[1], form.k.shape[3]
            if isinstance(form, WindowKV):
                form = in_device_memory(form)  # (a cache in host memory: its window copied to the device first)
                # copies: the draft cache is donated to the draft step, the full cache must survive it
                parts = (SparseKV(k=jnp.array(form.k, copy=True), v=jnp.array(form.v, copy=True),
                                  pos=form.slot_positions()),)
                ring = RecentKV.empty(B, K, form.window + recent_slots, D, form.k.dtype)
                layers.append(DraftLayer(parts=parts, recent=ring, window=form.window))
            else:
                parts = self.layer_parts(i, form, full.length, prompt_len, data)
                ring = RecentKV.empty(B, K, recent_slots, D, form.k.dtype)
                layers.append(DraftLayer(parts=tuple(parts), recent=ring, window=None))
        draft = DraftCache(layers=tuple(layers), length=jnp.array(full.length, copy=True))  # own buffer: donated later
        return in_device_memory(draft)  # (from a cache in host memory: its length and sliding windows, copied there)
