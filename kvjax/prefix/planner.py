"""Build a Plan from the cache's tree and entry state, before any compute: the boundary, what each form reads from
which tier, the lease, and the shortfalls that partition the recomputed tokens.

The partition (docs/cache_identity.md). With `T` prompt tokens, `matched` tokens found in the namespace's tree and
`limit = min(matched, T - 1)` (the last prompt token is always recomputed for its logits):

1. `[matched, T)` — compatibility: "identity" (another namespace *of the same tenant* holds the first block; the
   differing fields are named), else "token divergence" (at index k), else "not cached"; or, when the whole prompt
   matched, `[T - 1, T)` — boundary: "last token". A bypass (prompt log-probs) is `[0, T)` compatibility.
2. `[A, limit)` — capacity: `A` is where the first path form runs out of available entries; the cause is that
   entry's (evicted, not admitted, corrupt, tier timeout, tier excluded). Other forms short there are named with 0
   tokens.
3. `[b, A)` — snapshot forms serve only boundaries where every one of them has an available snapshot: up to the
   largest boundary `c <= A` where a snapshot was taken for every snapshot form, the loss is a capacity miss with
   the unavailable snapshot's cause; above `c`, a boundary miss "no snapshot". Families without snapshot forms lose
   `[b, A)` to "alignment" only.

So `sum(shortfall tokens) == T - boundary` for every plan, and every token is counted once.

Other tenants' namespaces are never consulted: a prompt another tenant cached looks exactly like one nobody cached.
"""

from __future__ import annotations

import collections
import weakref

import numpy as np

from kvjax.prefix.tiers import STALE_CAUSE
from kvjax.prefix.plan import CAPACITY, COMPATIBILITY, FormPlan, Lease, Plan, Shortfall

BOUNDARY = "boundary"


def _why(e, excluded_why: str) -> str:
    if e is None:
        return "not admitted"
    return excluded_why if e.tier() else e.why


def last_snapshot(blocks, specs, upper: int, P: int, align: int, tiers) -> int:
    """Largest boundary <= upper (a multiple of P and `align`) where every spec has a snapshot entry available in
    `tiers` — or, with `tiers=None`, where every spec has a snapshot entry at all (taken, whatever its state)."""
    for i in range(min(len(blocks), upper // P) - 1, -1, -1):
        if ((i + 1) * P) % align:
            continue
        if all((e := blocks[i].snap.get(s.name)) is not None and (tiers is None or e.tier(tiers)) for s in specs):
            return (i + 1) * P
    return 0


def identity_fields(pc, ns, tokens) -> list[str]:
    """Fields by which `ns` differs from the same tenant's namespaces whose trees hold the prompt's first block."""
    out = set()
    for other, tree in pc.trees.values():
        if other.hex != ns.hex and other.tenant_salt == ns.tenant_salt and tree.match(tokens[: pc.P])[0]:
            out.update(ns.diff(other))
    return sorted(out)


def _attach_lease(pc, plan: Plan, pins: list) -> Plan:
    for e in pins:
        e.pins += 1
    plan.lease = Lease(pc, pins, [e.generation for e in pins])
    # An abandoned plan (never executed nor released) must not pin its entries for ever: its lease goes with it.
    weakref.finalize(plan, pc.abandon, plan.lease).atexit = False
    return plan


def build_plan(pc, ns, tokens: np.ndarray, *, prompt_logprobs: bool, tiers: tuple, excluded_why: str) -> Plan:
    """The Plan of one prompt (call under `pc.lock`, after `pc._drain()`); pins what it reads."""
    T, P = tokens.size, pc.P
    fplans = {n: FormPlan(n, s.kind) for n, s in pc.specs.items()}
    shortfalls: list[Shortfall] = []
    blocks: list = []
    if prompt_logprobs and T:
        shortfalls.append(Shortfall(COMPATIBILITY, "bypass", "prompt log-probs need every prompt token's output",
                                    tokens=T))
    elif T:
        tree = pc.trees.get(ns.hex)
        div = None
        if tree is not None:
            blocks, div = tree[1].match(tokens)
        matched = len(blocks) * P
        if matched < T:
            fields = identity_fields(pc, ns, tokens) if not blocks and T >= P else []
            if fields:
                shortfalls.append(Shortfall(COMPATIBILITY, "identity", f"fields {fields}", tokens=T - matched,
                                            fields=tuple(fields)))
            elif div is not None:
                shortfalls.append(Shortfall(COMPATIBILITY, "token divergence", f"token divergence at index {div}",
                                            tokens=T - matched))
            else:
                shortfalls.append(Shortfall(COMPATIBILITY, "not cached", f"tokens [{matched}, {T}) not cached",
                                            tokens=T - matched))
        else:
            shortfalls.append(Shortfall(BOUNDARY, "last token", "exact whole-prompt hit: the last token is "
                                        "recomputed for its logits", tokens=1))
    matched = len(blocks) * P
    limit = min(matched, T - 1) if T else 0
    now = next(pc._clock)

    # 2. path forms: each one's leading run of available entries (parallel lists: few objects per lookup)
    avail, short = {}, []
    for spec in pc.path_forms:
        ents, tl, why = [], [], None
        for blk in blocks:
            e = blk.path.get(spec.name)
            t = None if e is None else e.tier(tiers)
            if t is None:
                why = _why(e, excluded_why)
                break
            e.last_access = now
            ents.append(e)
            tl.append(t)
        avail[spec.name] = (ents, tl)
        fplans[spec.name].reusable = len(ents) * P
        if why is not None:
            short.append((len(ents) * P, spec.name, why))
    A = min([limit] + [a for a, _, _ in short])
    for i, (a, name, why) in enumerate(sorted(short, key=lambda s: s[0])):
        # another store format's entry computes nothing this version can read: a compatibility miss, not capacity
        kind = COMPATIBILITY if why.startswith(STALE_CAUSE) else CAPACITY
        shortfalls.append(Shortfall(kind, why, f"block {a // P} (tokens {a}..) {why}", name,
                                    tokens=limit - A if i == 0 else 0))

    # 3. snapshot forms (or plain alignment)
    for spec in pc.snap_forms:
        fplans[spec.name].reusable = last_snapshot(blocks, (spec,), limit, P, 1, tiers)
    if pc.snap_forms:
        b = last_snapshot(blocks, pc.snap_forms, A, P, pc.align, tiers)
        if b < A:
            c = last_snapshot(blocks, pc.snap_forms, A, P, pc.align, None)
            if c > b:
                blk = blocks[c // P - 1]
                spec = next(s for s in pc.snap_forms if not blk.snap[s.name].tier(tiers))
                why = _why(blk.snap[spec.name], excluded_why)
                shortfalls.append(Shortfall(CAPACITY, why, f"snapshot at {c} {why}", spec.name, tokens=c - b))
            top = max(b, c)
            if top < A:
                shortfalls.append(Shortfall(BOUNDARY, "no snapshot", f"no snapshot of "
                                            f"{[s.name for s in pc.snap_forms]} in ({top}, {A}]", tokens=A - top))
    else:
        b = (A // pc.align) * pc.align
        if b < A:
            shortfalls.append(Shortfall(BOUNDARY, "alignment", f"tokens ({b}, {A}] end off the forms' alignment "
                                        f"{pc.align}", tokens=A - b))

    pins = []
    nb = -(-b // P)
    for spec in pc.path_forms:
        ents, tl = avail[spec.name]
        fp = fplans[spec.name]
        fp.blocks, fp.tiers = blocks[:nb], tl[:nb]
        pins += ents[:nb]
    if b > 0:
        blk = blocks[b // P - 1]
        for spec in pc.snap_forms:
            e = blk.snap[spec.name]
            e.last_access = now
            fplans[spec.name].blocks, fplans[spec.name].tiers = [blk], [e.tier(tiers)]
            pins.append(e)
    for fp in fplans.values():
        fp.used = dict(collections.Counter(fp.tiers))
    plan = Plan(namespace=ns.hex, prompt_tokens=T, matched=matched, boundary=b, forms=fplans, shortfalls=shortfalls,
                lease=None, ns=ns, tokens=tokens, tiers=tuple(tiers), excluded_why=excluded_why)
    return _attach_lease(pc, plan, pins)


def cold_plan(pc, plan: Plan, replans: int) -> Plan:
    """The plan that reads nothing, for a request whose re-plans kept failing: boundary 0, no pins.

    Its shortfalls keep the compatibility / last-token part of `plan` and put every other token under the capacity
    cause "replan limit".
    """
    keep = [s for s in plan.shortfalls if s.kind == COMPATIBILITY or s.cause == "last token"]
    lost = plan.prompt_tokens - sum(s.tokens for s in keep)
    shortfalls = keep + [Shortfall(CAPACITY, "replan limit", f"{replans} re-plans kept failing their checks: tokens "
                                   f"[0, {lost}) recomputed", tokens=lost)]
    cold = Plan(namespace=plan.namespace, prompt_tokens=plan.prompt_tokens, matched=plan.matched, boundary=0,
                forms={n: FormPlan(n, s.kind) for n, s in pc.specs.items()}, shortfalls=shortfalls, lease=None,
                lookup_ms=plan.lookup_ms, ns=plan.ns, tokens=plan.tokens, tiers=plan.tiers,
                excluded_why=plan.excluded_why)
    return _attach_lease(pc, cold, [])
