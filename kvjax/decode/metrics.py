"""Per-run decoding metrics: tokens/s, accepted tokens per round, verifications, bytes moved, peak device memory.

Timings leave compilation out: a round whose draft, verify or refresh step compiled (each draft length's first round
in a fresh process) is counted in `decode_s` and `compile_rounds` but not in `tokens_per_s`, which is the tokens of
the rounds that compiled nothing over their time (None when every round compiled: warm up, or run longer); the
per-round phase means (`mean_draft_step_s`, `mean_verify_s`, `mean_transfer_s`, `mean_refresh_s`) are over those
rounds too (over every round when all compiled).

Bytes are ACCOUNTED, not measured (the CPU has no device-memory counters): a draft step reads the weights and the
whole draft cache once per drafted token, a verify pass reads the weights and the full cache's filled rows once, an
offloaded verify moves the prompt's full KV host->device once. Peak device memory = what stays on the device
(draft cache + resident full cache or decoded-token tail) + the transferred prompt KV during an offloaded verify.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from kvjax.arrays import tree_nbytes


def jit_cache_sizes(fns) -> tuple:
    """How many compiled programs each jitted function holds (grows when a call compiles). Uses jax's private
    `_cache_size`; a function without it reads as 0, so its compiles go unnoticed rather than failing the run."""
    return tuple(getattr(f, "_cache_size", lambda: 0)() for f in fns)


@dataclasses.dataclass
class RunMetrics:
    name: str
    params: object = None
    compress_s: float = 0.0
    decode_s: float = 0.0
    emitted: int = 0
    full_prompt_bytes: int = 0
    draft_prompt_bytes: int = 0
    draft_bytes: int = 0
    h2d_bytes_per_verify: int = 0
    offload_in_place: bool = False  # the verify reads the host part where it lies (`kvjax.decode.offload.lends`)
    device_resident_bytes: int = 0
    device_peak_bytes: int = 0
    rounds: list = dataclasses.field(default_factory=list)

    @functools.cached_property
    def param_bytes(self) -> int:
        """Bytes of `params`, counted once: every round's read accounting asks, and walking the packed tree's
        leaves cost ~0.25 ms a time (two per round, ~2.5% of a VeriCache round of the bundled model at 32K)."""
        if self.params is None:
            return 0
        return tree_nbytes(self.params)

    def add_round(self, **kw) -> None:
        self.rounds.append(kw)

    def summary(self) -> dict:
        r = self.rounds
        acc = np.asarray([x["accepted"] for x in r], np.int64)
        xs = np.asarray([x["x"] for x in r], np.int64)
        tok = max(self.emitted, 1)
        warm = [x for x in r if not x.get("compiled", False)]
        warm_s = float(sum(x["draft_s"] + x["transfer_s"] + x["verify_s"] + x.get("refresh_s", 0.0) for x in warm))
        warm_tokens = int(sum(x.get("kept", x["accepted"] + 1) for x in warm))
        hist = np.bincount(acc, minlength=int(xs.max()) + 1 if xs.size else 1).tolist() if acc.size else []
        tot = lambda k: float(sum(x[k] for x in r))  # noqa: E731
        # per-round phase means over the rounds that compiled nothing (as tokens_per_s; measured: the tiny model's mean
        # verify at 32K over 8 prompts read 14.9 ms with the compiling rounds in, 14.2 without)
        timed = warm or r
        mean = lambda k: float(sum(x.get(k, 0.0) for x in timed)) / max(len(timed), 1)  # noqa: E731
        return {
            "name": self.name,
            "emitted": self.emitted,
            "tokens_per_s": warm_tokens / warm_s if warm and warm_s > 0 else None,
            "decode_s": self.decode_s,
            "timed_rounds": len(warm),
            "compile_rounds": len(r) - len(warm),
            "compress_s": self.compress_s,
            "verifications": len(r),
            "mean_accepted_per_round": float(acc.mean()) if acc.size else 0.0,
            "mean_emitted_per_round": float(acc.mean() + 1) if acc.size else 0.0,
            "accepted_histogram": hist,
            "draft_lengths": np.bincount(xs).nonzero()[0].tolist() if xs.size else [],
            "draft_s": tot("draft_s"), "verify_s": tot("verify_s"), "transfer_s": tot("transfer_s"),
            "refresh_s": float(sum(x.get("refresh_s", 0.0) for x in r)),
            "mean_draft_step_s": mean("draft_s"),
            "mean_verify_s": mean("verify_s"),
            "mean_transfer_s": mean("transfer_s"),
            "mean_refresh_s": mean("refresh_s"),
            "mean_x": float(xs.mean()) if xs.size else 0.0,
            "device_read_bytes_per_token": (tot("draft_read_bytes") + tot("verify_read_bytes")) / tok,
            "h2d_bytes_per_token": tot("h2d_bytes") / tok,
            "offload_in_place": self.offload_in_place,
            "draft_bytes_ratio": self.draft_prompt_bytes / max(self.full_prompt_bytes, 1),
            "draft_bytes": self.draft_bytes,
            "full_prompt_bytes": self.full_prompt_bytes,
            "device_peak_bytes": self.device_peak_bytes,
            "device_resident_bytes": self.device_resident_bytes,
        }
