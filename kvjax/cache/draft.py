"""Lossy draft-cache forms (VeriCache drafts): a few tokens kept, or all tokens quantized, plus a recent ring.

A draft cache never has to be right, only cheap and usually agreeing: the full cache decides every token. Each
draft layer is a `DraftLayer` = a tuple of prompt *parts* (fixed after compression) + a `RecentKV` ring for tokens
decoded since (the drafted ones while drafting, replaced by the exact verified KV once accepted).

- `SparseKV`: kept keys/values at their ORIGINAL absolute positions (no re-rotation), `pos` per token `[B, S]` or
  per head `[B, K, S]` (per-head selections: SnapKV, KVzip); -1 = empty slot.
- `Int8KV`: kept keys/values as int8 codes with one f32 scale per (head, slot) each (symmetric, absmax / 127 over
  the head dim): half a bf16 part's bytes, read by the native kernel without a dequantised copy.
- `QuantizedKV`: KIVI-style (arXiv 2402.02750) asymmetric min/max codes, keys per channel over groups of `G`
  slots, values per token; the exact format is the shared contract with `pallas_kernels/` (packing: element d in
  byte d // (8 // bits), bit offset (d % (8 // bits)) * bits, low bits first). Extension: `pos` may be per head
  `[B, K, S]` when the quantized tokens were selected per head (drop + quantize).
- `QuantizedBulk`: a `QuantizedKV` of every prompt token with the slots held at full precision elsewhere hidden
  (a refreshing draft composed with quantization).
- `RecentKV`: ring of R slots with explicit positions (slot p % R), so rolled-back drafts are masked by setting
  their positions to -1 — never a reshape.

Layout `[B, K, S, D]` as in `kvjax.cache.dense` (token axis next to the head dim; see that module for why).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.arrays import tree_nbytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseKV:
    """Kept keys/values at their original positions."""

    k: jax.Array  # [B, K, S, D]
    v: jax.Array  # [B, K, S, D]
    pos: jax.Array  # i32[B, S] or i32[B, K, S]; -1 = empty

    def dense(self):
        """(k, v, pos) for attention."""
        return self.k, self.v, self.pos

    def nbytes(self) -> int:
        return tree_nbytes((self.k, self.v, self.pos))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8KV:
    """Kept keys/values at their original positions as int8 codes: `k * k_scale[..., None]` is the key (likewise v).

    Measured on SmolLM2-135M at 8K (README workload, x = 8, three prompts): the same accepted drafts per round as a
    bf16 part, at half its bytes."""

    k: jax.Array  # i8[B, K, S, D]
    v: jax.Array  # i8[B, K, S, D]
    k_scale: jax.Array  # f32[B, K, S]
    v_scale: jax.Array  # f32[B, K, S]
    pos: jax.Array  # i32[B, S] or i32[B, K, S]; -1 = empty

    @classmethod
    def quantize(cls, k: jax.Array, v: jax.Array, pos: jax.Array) -> "Int8KV":
        """Codes of k, v [B, K, S, D]: per (head, slot), scale = max |x| / 127 and codes round(x * 127 / max |x|)
        (a zero row: scale 0, codes 0)."""
        kc, ks = _absmax_int8(k)
        vc, vs = _absmax_int8(v)
        return cls(k=kc, v=vc, k_scale=ks, v_scale=vs, pos=pos.astype(jnp.int32))

    def dense(self, dtype=jnp.float32):
        """Dequantised (k [B, K, S, D], v [B, K, S, D], pos): the values the native kernel attends to."""
        k = self.k.astype(jnp.float32) * self.k_scale[..., None]
        v = self.v.astype(jnp.float32) * self.v_scale[..., None]
        return k.astype(dtype), v.astype(dtype), self.pos

    def nbytes(self) -> int:
        return tree_nbytes((self.k, self.v, self.k_scale, self.v_scale, self.pos))


_INV_127 = np.float32(1) / np.float32(127)


def _absmax_int8(x: jax.Array):
    """(i8 codes, f32 scale [..]) of x [..., D]: symmetric over the last axis."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    inv = jnp.where(amax > 0, 127.0 / amax, 0.0)[..., None]  # a product per element, not a division
    codes = jnp.clip(jnp.round(x * inv), -127, 127).astype(jnp.int8)
    return codes, amax * _INV_127  # a product, as XLA would rewrite a division by a constant (and the native kernel)


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    """u8[..., D] codes in [0, 2**bits) -> u8[..., D * bits // 8], low bits first."""
    per = 8 // bits
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    return jnp.sum(jnp.left_shift(c, shifts), axis=-1, dtype=jnp.uint8)


def unpack_codes(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack_codes`: u8[..., D * bits // 8] -> u8[..., D]."""
    per = 8 // bits
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    c = jnp.right_shift(packed[..., None], shifts) & jnp.uint8((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _minmax_quant(x: jax.Array, axis, bits: int):
    """Asymmetric min/max over `axis` (kept dims): returns (codes u8 same shape as x, scale, zero)."""
    lo = jnp.min(x, axis=axis, keepdims=True)
    hi = jnp.max(x, axis=axis, keepdims=True)
    rng = hi - lo
    scale = jnp.where(rng > 0, rng / (2**bits - 1), 1.0)
    codes = jnp.clip(jnp.round((x - lo) / scale), 0, 2**bits - 1).astype(jnp.uint8)
    return codes, scale.astype(jnp.float32), lo.astype(jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """KIVI-style 2/4-bit keys (per channel, groups of `group` slots) and values (per token)."""

    k_codes: jax.Array  # u8[B, K, S, D * bits // 8]
    k_scale: jax.Array  # f32[B, K, S // G, D]
    k_zero: jax.Array  # f32[B, K, S // G, D]
    v_codes: jax.Array  # u8[B, K, S, D * bits // 8]
    v_scale: jax.Array  # f32[B, K, S, 1]
    v_zero: jax.Array  # f32[B, K, S, 1]
    pos: jax.Array  # i32[B, S] (or [B, K, S], see module docstring); -1 = empty
    bits: int = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def quantize(cls, k: jax.Array, v: jax.Array, pos: jax.Array, *, bits: int = 4, group: int = 32) -> "QuantizedKV":
        """Quantize k, v [B, K, S, D] (S a multiple of `group`) with positions `pos`.

        Empty slots (pos -1) should hold zeros so they do not widen their key group's range.
        """
        if bits not in (2, 4):
            raise ValueError(f"bits must be 2 or 4, got {bits}")
        B, K, S, D = k.shape
        if S % group:
            raise ValueError(f"quantized slots S={S} must be a multiple of the key group {group}")
        kg = k.astype(jnp.float32).reshape(B, K, S // group, group, D)
        kc, ks, kz = _minmax_quant(kg, axis=3, bits=bits)  # scale/zero: [B, K, S//G, 1, D]
        vc, vs, vz = _minmax_quant(v.astype(jnp.float32), axis=3, bits=bits)  # [B, K, S, 1]
        return cls(k_codes=pack_codes(kc.reshape(B, K, S, D), bits), k_scale=ks[:, :, :, 0], k_zero=kz[:, :, :, 0],
                   v_codes=pack_codes(vc, bits), v_scale=vs, v_zero=vz, pos=pos.astype(jnp.int32), bits=bits,
                   group=group)

    def dense(self, dtype=jnp.float32):
        """Dequantised (k [B, K, S, D], v [B, K, S, D], pos)."""
        B, K, S, _ = self.k_codes.shape
        kc = unpack_codes(self.k_codes, self.bits).astype(jnp.float32)
        D = kc.shape[-1]
        G = self.group
        k = kc.reshape(B, K, S // G, G, D) * self.k_scale[:, :, :, None] + self.k_zero[:, :, :, None]
        v = unpack_codes(self.v_codes, self.bits).astype(jnp.float32) * self.v_scale + self.v_zero
        return k.reshape(B, K, S, D).astype(dtype), v.astype(dtype), self.pos

    def nbytes(self) -> int:
        return tree_nbytes((self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero, self.pos))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedBulk:
    """A quantized copy of every prompt token (`q`, its `pos` per slot) of which the slots the draft also holds at
    full precision elsewhere are hidden: the bulk of a refreshing draft composed with quantization
    (`kvjax.compress.refresh`). Re-selecting the full-precision set changes only `hidden`, never the codes."""

    q: QuantizedKV  # pos i32[B, S]: slot s holds prompt position s, -1 beyond the prompt
    hidden: jax.Array  # bool[B, K, S]

    def view(self) -> QuantizedKV:
        """The bulk as attention sees it: hidden slots at position -1 (per head)."""
        B, K, S = self.hidden.shape
        pos = jnp.where(self.hidden, -1, jnp.broadcast_to(self.q.pos[:, None, :], (B, K, S)))
        return dataclasses.replace(self.q, pos=pos.astype(jnp.int32))

    def dense(self):
        return self.view().dense()

    def nbytes(self) -> int:
        return self.q.nbytes() + tree_nbytes(self.hidden)


def attention_part(part):
    """What attention reads of a prompt part: `(k, v, pos)` of a sparse part, the `QuantizedKV` itself (the
    dispatcher attends to its codes, `kvjax.models.attention.quantized_part_stats`), a bulk's visible view, an
    `Int8KV` itself (its codes read by `kvjax.models.attention.int8_part_stats`)."""
    if isinstance(part, QuantizedBulk):
        return part.view()
    if isinstance(part, (QuantizedKV, Int8KV)):
        return part
    return part.dense()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecentKV:
    """Ring of `R` slots for tokens decoded after compression; slot p % R holds position p (pos -1 = empty)."""

    k: jax.Array  # [B, K, R, D]
    v: jax.Array  # [B, K, R, D]
    pos: jax.Array  # i32[B, R]

    @classmethod
    def empty(cls, batch: int, kv_heads: int, slots: int, head_dim: int, dtype=jnp.float32) -> "RecentKV":
        shape = (batch, kv_heads, slots, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), pos=jnp.full((batch, slots), -1, jnp.int32))

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    def write(self, k_new: jax.Array, v_new: jax.Array, positions: jax.Array, n_valid: jax.Array) -> "RecentKV":
        """Write rows `t < n_valid[b]` of k_new/v_new [B, T, K, D] (T <= R) at slots positions % R.

        Args:
            positions: i32[B, T] absolute positions of the rows.
        """
        B, T = k_new.shape[:2]
        R = self.slots
        t = jnp.arange(T)[None, :]
        slot = jnp.where(t < n_valid[:, None], jnp.mod(positions, R), R)  # R -> dropped
        b = jnp.arange(B)[:, None]
        k = self.k.at[b, :, slot].set(k_new.astype(self.k.dtype), mode="drop")
        v = self.v.at[b, :, slot].set(v_new.astype(self.v.dtype), mode="drop")
        pos = self.pos.at[b, slot].set(positions.astype(jnp.int32), mode="drop")
        return RecentKV(k=k, v=v, pos=pos)

    def rollback(self, length: jax.Array) -> "RecentKV":
        """Forget every position >= length[b] (rejected drafts): a masked position update."""
        return dataclasses.replace(self, pos=jnp.where(self.pos >= length[:, None], -1, self.pos))

    def dense(self):
        return self.k, self.v, self.pos

    def nbytes(self) -> int:
        return tree_nbytes((self.k, self.v, self.pos))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftLayer:
    """One layer of a draft cache: compressed prompt parts + the recent ring. `window` = sliding window or None."""

    parts: tuple  # SparseKV | Int8KV | QuantizedKV | QuantizedBulk, fixed after compression
    recent: RecentKV
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def prompt_nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
    """The lossy per-request state the drafter reads: one `DraftLayer` per model layer + the token count."""

    layers: tuple  # DraftLayer per layer
    length: jax.Array  # i32[B] tokens processed (= next position)
    # how a refreshing drafter re-selects its prompt parts after verifications (`kvjax.compress.refresh`); None for
    # a static draft, whose parts never change after compression
    refresh: Any = dataclasses.field(default=None, metadata=dict(static=True))

    def prompt_nbytes(self) -> int:
        """Bytes of the compressed prompt parts (what the compression ratio is about)."""
        return sum(l.prompt_nbytes() for l in self.layers)

    def nbytes(self) -> int:
        return sum(l.prompt_nbytes() + l.recent.nbytes() for l in self.layers) + tree_nbytes(self.length)

    def room(self) -> int:
        """Tokens the draft can take after compression before its smallest recent ring wraps."""
        return min(l.recent.slots for l in self.layers)


def draft_split(draft: DraftCache):
    """(the compressed prompt parts of every layer — fixed after compression, the loop invariant of drafting —, the
    draft with those parts removed: its rings and length, what drafting and verification change)."""
    frozen = tuple(l.parts for l in draft.layers)
    live = dataclasses.replace(draft, layers=tuple(dataclasses.replace(l, parts=()) for l in draft.layers))
    return frozen, live


def draft_join(frozen, live: DraftCache) -> DraftCache:
    """Inverse of `draft_split`; `frozen` None leaves the parts out (a row handed to verification)."""
    if frozen is None:
        return live
    return dataclasses.replace(live, layers=tuple(dataclasses.replace(l, parts=p) for l, p in zip(live.layers, frozen)))
