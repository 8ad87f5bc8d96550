"""A run's context-length phases ("512:4M,2048:2M,4096:1M") and the steps each one takes."""

from __future__ import annotations

import dataclasses

_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9}


@dataclasses.dataclass(frozen=True)
class Phase:
    """`tokens` training tokens in windows of `context` tokens, `batch` windows per optimizer step."""

    context: int
    tokens: int
    batch: int

    @property
    def tokens_per_step(self) -> int:
        return self.context * self.batch

    @property
    def steps(self) -> int:
        return max(1, -(-self.tokens // self.tokens_per_step))


def parse_count(text: str) -> int:
    """'4M' -> 4000000, '250k' -> 250000, '1.5M' -> 1500000, '8192' -> 8192."""
    t = text.strip().lower()
    scale = _SUFFIX.get(t[-1:], 1)
    number = t[:-1] if scale != 1 else t
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (expected e.g. 8192, 250k, 4M)") from None
    if value <= 0:
        raise ValueError(f"token count must be positive: {text!r}")
    return int(value)


def parse_phases(spec: str, tokens_per_step: int) -> list[Phase]:
    """Phases of `spec` ("CONTEXT:TOKENS,..."), each with as many windows per step as fit `tokens_per_step`."""
    phases = []
    for part in spec.split(","):
        if not part.strip():
            continue
        try:
            ctx_text, tok_text = part.split(":")
            context = int(ctx_text)
        except ValueError:
            raise ValueError(f"bad phase {part!r} in --phases {spec!r}: expected CONTEXT:TOKENS, e.g. 512:4M") \
                from None
        if context < 2:
            raise ValueError(f"bad phase {part!r}: context must be >= 2 tokens")
        phases.append(Phase(context, parse_count(tok_text), max(1, tokens_per_step // context)))
    if not phases:
        raise ValueError(f"--phases {spec!r} names no phase")
    return phases


def phase_at(phases: list[Phase], step: int) -> tuple[int, int]:
    """(phase index, step within that phase) of global optimizer step `step` (the last phase runs on)."""
    for i, p in enumerate(phases):
        if step < p.steps or i == len(phases) - 1:
            return i, step
        step -= p.steps
    raise AssertionError("unreachable")


def total_steps(phases: list[Phase]) -> int:
    return sum(p.steps for p in phases)


def step_for_tokens(phases: list[Phase], tokens: int) -> int:
    """The global step at which a run of `phases` has trained `tokens` tokens (rounded down to a whole step): where
    a run resumed with a different `tokens_per_step` picks up, so its phases and schedule continue by tokens."""
    step = 0
    for i, p in enumerate(phases):
        phase_tokens = p.steps * p.tokens_per_step
        if tokens < phase_tokens or i == len(phases) - 1:
            return step + tokens // p.tokens_per_step
        tokens -= phase_tokens
        step += p.steps
    raise AssertionError("unreachable")
