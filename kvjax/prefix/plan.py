"""What a prefix-cache lookup decides before any compute: the Plan, its per-form parts, and the Lease.

A Plan says, for every form, how many tokens it could reuse and from which tiers; the common boundary every form can
serve (path forms up to their first missing block, snapshot forms only where a snapshot exists); what is loaded
and what is recomputed; and one reason for every shortfall. The Lease pins every entry the plan reads, so eviction
cannot take them; executing the plan re-checks the lease's generations (time of check = time of use).
"""

from __future__ import annotations

import dataclasses
import itertools

_lease_ids = itertools.count(1)

COMPATIBILITY = "compatibility"
CAPACITY = "capacity"


@dataclasses.dataclass
class Shortfall:
    """Why fewer tokens are reused than the prompt offers.

    A plan's shortfalls partition the recomputed tokens `[boundary, prompt_tokens)`: each token is lost to exactly
    one shortfall, the first cause that stops it (docs/cache_identity.md lists every kind and cause). A shortfall of
    0 tokens only names a further reason (another form also missing there).

    Attributes:
        kind: "compatibility" (nothing computes the same thing: identity, token divergence, not cached, bypass),
            "capacity" (it did, but is not usable now: evicted, not admitted, tier timeout, tier excluded, corrupt,
            replan limit), or "boundary" (recompute forced by alignment: no snapshot, alignment, last token).
        cause: short machine-readable cause, e.g. "evicted", "token divergence", "identity".
        detail: human-readable detail ("token divergence at index 130", "fields ['semantic.weights']").
        form: the form concerned, or None for all forms.
        tokens: tokens lost to this cause.
        fields: for an identity miss, the namespace fields that differ.
    """

    kind: str
    cause: str
    detail: str
    form: str | None = None
    tokens: int = 0
    fields: tuple = ()


@dataclasses.dataclass
class FormPlan:
    """One form's part of a plan.

    Attributes:
        reusable: tokens this form alone could serve (path: leading available blocks * P; snapshot: the largest
            boundary with a snapshot, bounded by the matched prefix).
        used: entries the plan reads, per tier ({"device": n, "host": n, "store": n}).
        blocks, tiers: the Blocks to read and the tier each is read from, in order (path: one per block below the
            boundary; snapshot: at most one, the block the boundary ends).
    """

    name: str
    kind: str
    reusable: int = 0
    used: dict = dataclasses.field(default_factory=dict)
    blocks: list = dataclasses.field(default_factory=list)
    tiers: list = dataclasses.field(default_factory=list)

    @property
    def loads(self) -> list:
        """(Block, tier) pairs."""
        return list(zip(self.blocks, self.tiers))


class Lease:
    """Pins the entries a plan reads. Valid until released or until an entry's generation moves.

    Released by `PrefixCache.execute` for every plan it abandons (and for the current one if it raises), by the
    caller after use, and at the latest when its Plan is garbage collected: no pin outlives its plan.
    """

    def __init__(self, manager, entries: list, generations: list):
        self.id = next(_lease_ids)
        self.manager = manager
        self.entries = entries  # the pinned entries
        self.generations = generations  # their generations at lookup
        self.released = False

    def valid(self) -> bool:
        return not self.released and [e.generation for e in self.entries] == self.generations

    def release(self) -> None:
        if self.manager is not None:
            self.manager.release(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


@dataclasses.dataclass
class Plan:
    """The routing decision for one prompt.

    Attributes:
        prompt_tokens: length of the prompt.
        matched: tokens of the prompt found in the tree (block-aligned; before availability).
        boundary: tokens restored from the cache (the common boundary of all forms); tokens
            `[boundary, prompt_tokens)` are recomputed.
        forms: form name -> FormPlan.
        shortfalls: every reason the boundary is below the prompt length.
        lease: pins what the plan reads (release after execute; `PrefixCache.prefill` does it).
        lookup_ms: wall time of the lookup.
    """

    namespace: str
    prompt_tokens: int
    matched: int
    boundary: int
    forms: dict
    shortfalls: list
    lease: Lease | None
    lookup_ms: float = 0.0
    ns: object = dataclasses.field(default=None, repr=False)  # the Namespace looked up (for re-planning)
    tokens: object = dataclasses.field(default=None, repr=False)  # i32[T] the prompt
    tiers: tuple = ("device", "host", "store")
    excluded_why: str = "tier excluded"  # the cause reported for entries held only in tiers the plan may not read

    @property
    def recompute(self) -> tuple[int, int]:
        return self.boundary, self.prompt_tokens

    def reasons(self) -> list[str]:
        return [f"{s.kind}:{s.cause}" + (f"[{s.form}]" if s.form else "") + f": {s.detail}" for s in self.shortfalls]

    def __repr__(self) -> str:
        """One line a person can read: what is restored from where, what is recomputed and why (never the arrays)."""
        used = ", ".join(f"{k}: {f.reusable} reusable" + (f" from {'+'.join(sorted(f.used))}" if f.used else "")
                         for k, f in self.forms.items())
        why = "; ".join(self.reasons()) or "-"
        return (f"Plan(restore {self.boundary} of {self.prompt_tokens} prompt tokens, recompute "
                f"{self.prompt_tokens - self.boundary}; {used or 'no forms'}; shortfalls: {why})")

    __str__ = __repr__

    def summary(self) -> dict:
        """The plan as a JSON-ready dict."""
        return dict(prompt_tokens=self.prompt_tokens, matched=self.matched, boundary=self.boundary,
                    forms={k: dict(kind=f.kind, reusable=f.reusable, used=dict(f.used)) for k, f in self.forms.items()},
                    reasons=self.reasons(), lookup_ms=self.lookup_ms)
