"""Requests and results of the many-request schedulers."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from kvjax.decode import offload as offl
from kvjax.decode import vericache as vc


@dataclasses.dataclass
class Request:
    """One decoding request.

    Attributes:
        prompt: i32[P] prompt token ids.
        max_new_tokens: tokens to emit (no EOS stop).
        arrival: scheduler iteration from which the request may be admitted.
        seed: sampling seed (unused when greedy).
        prefilled: optional (the family's full cache after prefill, first token i32[1]) from `prefill_request` (its
            arrays may live in pinned host memory, like a prefix-cache hit; its first token must have been chosen with
            the run's temperature and this seed); None = the scheduler prefills on admission.
        prompt_masses: optional, the prompt's scores its prefill handed out for the scheduler's drafter
            (`prefill_request(scoring=...)`, `Compressor.prompt_scoring`), so its admission skips scoring the prompt;
            None = the drafter scores it at admission.
        own_prefilled: the prefilled cache is the request's alone, so the scheduler may take its buffers (on the CPU
            its verifies write into the host copy they are lent, `kvjax.decode.offload.lends`); False = the caller's,
            copied once at admission.
    """

    prompt: np.ndarray
    max_new_tokens: int
    arrival: int = 0
    seed: int = 0
    prefilled: tuple | None = None
    own_prefilled: bool = False
    prompt_masses: tuple | None = None


def prefill_request(model, prompt, max_new_tokens: int, *, draft_len: int, host: bool = True, seed: int = 0,
                    temperature: float = 0.0, scoring: tuple[int, int] | None = None) -> tuple:
    """Prefill a prompt at the capacity VeriCache and its reference use: (full cache, first i32[1]) — then, with
    `scoring` (a drafter's `prompt_scoring`), the prompt masses the prefill handed out (`Request.prompt_masses`).

    With `host`, the cache is moved to pinned host memory (its device copy is freed).
    """
    full, first, *masses = vc.prefill_for(model, prompt, max_new_tokens, max_draft=draft_len, temperature=temperature,
                                          seed=seed, scoring=scoring)
    if host:
        full = offl.to_host(full)
        jax.block_until_ready(full)
    return (full, first) + tuple(masses)


@dataclasses.dataclass
class SchedulerResult:
    """Outputs and measurements of one scheduler run.

    Attributes:
        outputs: request index -> i32[max_new_tokens] tokens.
        wall_s: seconds from start to the last token; tokens: tokens emitted; tokens_per_s: their ratio.
        budget_bytes, peak_measured_bytes, peak_reserved_bytes: the device budget and the peaks (see
            `scheduler_memory`); device_peak_bytes: the allocator's peak where the backend has one (GPU), else None.
        timeline: (seconds, measured device bytes, reserved bytes, tokens emitted so far) samples.
        stats: per-phase times and counts (mode dependent).
    """

    name: str
    outputs: dict
    wall_s: float
    tokens: int
    budget_bytes: int
    peak_measured_bytes: int
    peak_reserved_bytes: int
    device_peak_bytes: int | None
    timeline: list
    stats: dict

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else float("nan")
