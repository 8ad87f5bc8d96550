"""Which Pallas GPU backend the kernels are lowered with, and how an `implementation=` name is resolved.

JAX 0.10.2 lowers a `pallas_call` for CUDA with Mosaic GPU unless Triton compiler params are given. Mosaic GPU has no
`jnp.dot` lowering for these register-level tiles and wants explicit SMEM pipelining, so the kernels pass
`triton.CompilerParams` and use the Triton backend (deprecated from JAX 0.11: the bodies only use backend-neutral
Pallas -- ref slicing, jnp, lax.dot_general, fori_loop, cond -- so moving them means changing this file and the
launch parameters, not the kernels). See README.md.

Implementations:
- "xla": the pure-jnp reference, compiled by XLA (the CPU default);
- "pallas": the Pallas kernel, compiled for the GPU (the GPU default);
- "pallas_interpret": the Pallas kernel in interpret mode (any backend; tests on CPU);
- "pallas_debug": interpret mode with `pltpu.InterpretParams(out_of_bounds_reads="raise")`, which raises on any
  out-of-bounds ref read that plain interpret mode would silently clamp;
- "native": kernel 0 as native CPU code through jax.ffi (`pallas_kernels/native`), built on first use; the CPU
  default where it builds (else "xla"; `active_cpu_implementation()` says which and why).
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import triton as pl_triton
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import native

IMPLEMENTATIONS = ("xla", "pallas", "pallas_interpret", "pallas_debug", "native")
NUM_WARPS = 4
NUM_STAGES = 2


def compiler_params(interpret):
    """Triton launch parameters for a compiled kernel; None in interpret modes (the checking interpreter behind
    `InterpretParams` accepts only TPU compiler params)."""
    if interpret is not False:
        return None
    return pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def resolve(implementation: str | None) -> str:
    """None -> "pallas" when the default JAX backend is a GPU, else `active_cpu_implementation()` ("native" where
    the native kernel builds, else "xla"); names are checked ("native" when it cannot build raises, naming why)."""
    if implementation is None:
        if jax.default_backend() in ("gpu", "cuda", "rocm"):
            return "pallas"
        return active_cpu_implementation()
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if implementation == "native" and not native.available():
        raise RuntimeError(f"implementation 'native' is not available here: {native.status()['reason']}")
    return implementation


def active_cpu_implementation() -> str:
    """The implementation CPU attention runs: "native" when the native kernel built and loaded, else "xla" (see
    `pallas_kernels.native.status()` for the reason)."""
    return "native" if native.available() else "xla"


def interpret_arg(implementation: str):
    """The `interpret=` argument of `pl.pallas_call` for a resolved Pallas implementation."""
    if implementation == "pallas":
        return False
    if implementation == "pallas_interpret":
        return True
    if implementation == "pallas_debug":
        return pltpu.InterpretParams(out_of_bounds_reads="raise")
    raise ValueError(f"{implementation!r} is not a Pallas implementation")
