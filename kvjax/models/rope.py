"""Rotary position embeddings shared by every family: the normalised rope config and its inverse frequencies.

`rope_inv_freq` mirrors transformers' float32 computation (default, linear, llama3 and yarn rope types) so that
positions rotate identically in kvjax and in the reference implementation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from either `rope_theta`/`rope_scaling` or `rope_parameters`."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0



def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[Any, float]:
    """Inverse frequencies [dim // 2] (float64 numpy, cast by the caller) and the cos/sin scale, as transformers computes them."""
    # transformers computes these in torch float32; mirror that so positions rotate identically.
    idx = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    base = np.float32(rope.theta)
    inv = (np.float32(1.0) / (base ** idx)).astype(np.float32)
    scale = 1.0
    if rope.rope_type == "linear":
        inv = (inv / np.float32(rope.factor)).astype(np.float32)
    elif rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wl = old / rope.low_freq_factor
        high_wl = old / rope.high_freq_factor
        wavelen = (2 * math.pi / inv).astype(np.float32)
        inv_l = np.where(wavelen > low_wl, inv / np.float32(rope.factor), inv).astype(np.float32)
        smooth = ((old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)).astype(np.float32)
        smoothed = ((1 - smooth) * inv_l / np.float32(rope.factor) + smooth * inv_l).astype(np.float32)
        is_medium = (~(wavelen < high_wl)) & (~(wavelen > low_wl))
        inv = np.where(is_medium, smoothed, inv_l).astype(np.float32)
    elif rope.rope_type == "yarn":
        factor = rope.factor

        def get_mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        if rope.attention_factor is not None:
            scale = rope.attention_factor
        elif rope.mscale and rope.mscale_all_dim:
            scale = float(get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim))
        else:
            scale = get_mscale(factor)
        orig = rope.original_max_position_embeddings

        def corr_dim(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(rope.theta))

        low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        extra = (1 - ramp).astype(np.float32)
        pos_freqs = (base ** idx).astype(np.float32)
        inv_extra = (1.0 / pos_freqs).astype(np.float32)
        inv_inter = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
        inv = (inv_inter * (1 - extra) + inv_extra * extra).astype(np.float32)
    return inv, float(scale)
