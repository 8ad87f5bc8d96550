"""Choosing the draft length x per round, from a small static set (each x compiles once).

Two policies:
- `GrowShrink`: grow after a fully accepted round, shrink when under half was accepted (the first adaptive rule).
- `CostModel`: the VeriCache paper's ideal-speedup reasoning applied per request, online. From the rounds so far it
  estimates the chance `a_i` that draft i is accepted given drafts 0..i-1 were (each depth's ratio shrunk toward the
  pooled per-token rate, so depths with few trials follow the pooled rate), the time of a round's draft phase `d(x)`,
  of a re-selection per drafted token `r` (a refreshing draft re-selects every so many drafted tokens) and of the rest
  of a round `v(x)` (verification and transfer). `d` and `v` are exponential averages of each length's measured
  phases, a length's first round left out (it includes the compile); a length not timed yet is estimated from the
  timed ones, linear in x (`d`: a fixed part per round plus one per draft token) and in the block's rows (`v`).
  A round of x drafts then emits `E(x) = 1 + sum_{j<=x} prod_{i<j} a_i` tokens on average and costs
  `d(x) + x r + v(x)`; the next round uses the x with the most predicted tokens per second -- a length never timed
  only when it predicts a margin more than the timed ones (`EXPLORE_MARGIN`: its estimates are extrapolations) -- or,
  once in a while, the runner-up, when its verify time was last measured long ago and it predicts almost as much
  (`STALE_ROUNDS`, `RETIME_WITHIN`), so that one slow early measurement cannot keep a length out for good. When
  acceptance is low, short drafts (2, 4) win; when it is high, long ones — "A Sparse Glimpse of the Whole" (arXiv
  2607.27735) makes the same point.
"""

from __future__ import annotations

import numpy as np

DEFAULT_SET = (2, 4, 8, 16, 32)
DEFAULT_START = 8  # the first round's x of an adaptive run not given one
DEFAULT_FIXED = 32  # the x of a run that cannot adapt (a batch) and was not given one
# The share of a verify block's time taken to grow with its rows, for estimating an untimed length from one timed one:
# SmolLM2 at 8K, 85 ms at x = 8 and 206 ms at x = 32 -- 5.0 ms per row, 45 of x = 8's 85 ms (0.53).
ROW_SHARE = 0.5
# A timed length whose verify time is this many rounds old is timed again when it predicts at least (1 - RETIME_WITHIN)
# of the best length's tokens per second. Measured (the bundled model at 32K, 8 held-out prompts, one run): without it
# the policy settled on x = 4 (mean x 4.85) on estimates of x = 8's verify from its first rounds (16.6 ms, against
# 14.2 ms in a fixed-x = 8 run of the same prompts) and ran 1.33x full-cache decoding against fixed x = 8's 1.48x.
STALE_ROUNDS = 8
RETIME_WITHIN = 0.15
# A length never timed is run only when it predicts this much more than every timed length (its prediction divided by
# 1 + EXPLORE_MARGIN): its acceptance at depths never tried is the pooled rate of the shallower ones, and drafts deeper
# than any tried are accepted less (SmolLM2 at 8K, the README command: a fixed x = 8 accepted 7.53 of 8 a round, x = 16
# 11.8 of 16), and its verify time is extrapolated. Measured: the README command at fixed x = 8 ran 1.63-1.64x
# full-cache decoding, at x = 16 1.34x, and adaptive 1.39-1.70x, its x = 16 rounds tried on near-ties between noisy
# timings (with the margin: 1.58-1.72x, x = 8 throughout); the bundled model at 32K (8 held-out prompts, 256 tokens)
# adaptive 1.65x against fixed x = 8's 1.73x in one run (with the margin: 1.74x against 1.74x).
EXPLORE_MARGIN = 0.10


def usable_lengths(xs: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """The lengths of `xs` a run of `max_new_tokens` can use: after the prefill's token, a round of x drafts emits
    up to x + 1 of the remaining max_new_tokens - 1, so an x > max_new_tokens - 2 would draft past the end (and cost
    a compile for nothing). The smallest length always stays."""
    xs = tuple(sorted(xs))
    return tuple(x for x in xs if x <= max_new_tokens - 2) or xs[:1]


def start_length(xs: tuple[int, ...], wanted: int) -> int:
    """The first round's x: `wanted` when the set has it, else the set's largest length below it (its smallest if
    none is)."""
    below = [x for x in xs if x <= wanted]
    return below[-1] if below else xs[0]


def _estimate(times: dict[int, float], x: int, from_one) -> float:
    """A phase's time at length x from the lengths timed so far (`times`): its own average where x was timed, else on
    the line through the two nearest timed lengths (never falling with x, never below 0), else `from_one(x0, t0)` from
    the one timed length x0 and its time t0."""
    if x in times:
        return times[x]
    seen = sorted(times, key=lambda s: (abs(s - x), s))
    if len(seen) == 1:
        return from_one(seen[0], times[seen[0]])
    a, b = sorted(seen[:2])
    slope = max(0.0, (times[b] - times[a]) / (b - a))
    return max(times[a] + slope * (x - a), 0.0)


class GrowShrink:
    """Grow after a fully accepted round, shrink when under half was accepted."""

    def __init__(self, xs: tuple[int, ...]):
        self.xs = tuple(sorted(xs))

    def next(self, x: int, accepted: int, draft_s: float, verify_s: float, refresh_s: float = 0.0,
             refreshed_tokens: int = 0) -> int:
        i = self.xs.index(x)
        if accepted == x and i + 1 < len(self.xs):
            return self.xs[i + 1]
        if accepted < x // 2 and i > 0:
            return self.xs[i - 1]
        return x


class CostModel:
    """Pick the x of the static set with the most predicted tokens per second (see the module docstring).

    Args:
        xs: the static set of draft lengths.
        decay: weight of the newest measurement in the time averages.
        prior: pseudo-trials of the pooled acceptance rate each depth's estimate starts from.
    """

    def __init__(self, xs: tuple[int, ...], decay: float = 0.3, prior: float = 4.0):
        self.xs = tuple(sorted(xs))
        self.decay = decay
        self.prior = prior
        depth = self.xs[-1]
        self.hits = np.zeros(depth)
        self.trials = np.zeros(depth)
        self.draft_s: dict[int, float] = {}  # per length: its draft phase (x draft tokens and the call around them)
        self.refresh_token_s = 0.0  # a re-selection's time per token drafted since the one before
        self.verify_s: dict[int, float] = {}
        self.timed_at: dict[int, int] = {}  # the round in which each length's verify was last measured
        self.rounds = 0
        self.compiled: set[int] = set()  # lengths run once: their first round's times include the compile

    def _ema(self, old, new):
        return new if old is None else (1 - self.decay) * old + self.decay * new

    def observe(self, x: int, accepted: int, draft_s: float, verify_s: float, refresh_s: float = 0.0,
                refreshed_tokens: int = 0) -> None:
        """Record one round: x drafts, `accepted` of them accepted, its measured draft and verify times, and when it
        re-selected the draft's blocks, that time and the tokens drafted since the last re-selection. A refreshing
        draft re-selects every so many drafted tokens, not every round, so its cost is charged per drafted token:
        counted in the round that happened to pay it, it made that length's verify look slow (measured: x = 8 rounds
        took 117 ms, or 146-172 ms every fourth round) and a length run twice could keep an inflated estimate."""
        self.hits[:accepted] += 1
        self.trials[:min(accepted + 1, x)] += 1
        self.rounds += 1
        if x not in self.compiled:
            self.compiled.add(x)
            return
        self.draft_s[x] = self._ema(self.draft_s.get(x), draft_s)
        self.verify_s[x] = self._ema(self.verify_s.get(x), verify_s)
        self.timed_at[x] = self.rounds
        if refreshed_tokens > 0:
            self.refresh_token_s = self._ema(self.refresh_token_s or None, refresh_s / refreshed_tokens)

    def acceptance(self) -> np.ndarray:
        """a_i per depth: hits / trials shrunk toward the pooled rate over every depth (`prior` pseudo-trials of it).

        The pooled rate (the per-token acceptance of a geometric model, Beta(1, 1)-smoothed) is what a depth with
        few trials, or none, takes: a depth tried only in the first rounds keeps being re-estimated from every round
        after them, so one unlucky early round cannot pin the policy to short drafts (measured: without the pooling,
        the tiny model at 32K kept x = 4 at 4.3 of 4 accepted per round while x = 8 was 1.3x faster)."""
        pooled = (self.hits.sum() + 1) / (self.trials.sum() + 2)
        return (self.hits + self.prior * pooled) / (self.trials + self.prior)

    def expected_emitted(self, x: int) -> float:
        """E(x) = 1 + sum over j <= x of the chance that drafts 1..j are all accepted."""
        return 1.0 + float(np.sum(np.cumprod(self.acceptance()[:x])))

    def _draft_time(self, x: int) -> float:
        """d(x): the measured average, else a line in x through the two nearest timed lengths (a round's fixed part,
        the intercept, plus a per-token part, never falling with x), else the one timed length's time per draft token
        times x. A round's draft phase is not x times one token: the bundled model at 32K (8 held-out prompts, fixed
        x = 4 and x = 8 in one run) drafted a round in 1.91 and 2.98 ms, 0.84 ms of it whatever x. Charged per token,
        as one average over the lengths run, that part made every length longer than the one running look dearer and
        every shorter one cheaper than it was. (The same 8-prompt command before and after this change: adaptive x
        ran 0.926x and 0.935x fixed x = 8's speed, mean x 5.3 both times -- the rounds' noisy times and an acceptance
        that changes along a request, not this bias, keep it from x = 8 there.)"""
        return _estimate(self.draft_s, x, lambda x0, d0: d0 * x / x0)

    def _verify_time(self, x: int) -> float:
        """v(x): the measured average, else a line in the verify block's rows (x + 1) through the two nearest timed
        lengths (never falling with rows), else from the one timed length with `ROW_SHARE` of its time per-row work.
        Taking the nearest length's time instead made every longer length look free: SmolLM2 at 8K verified x = 8 in
        85 ms and x = 32 in 206 ms, and a run that had timed only x = 16 went to x = 32 on that estimate."""
        return _estimate(self.verify_s, x, lambda x0, v0: v0 * ((1 - ROW_SHARE) + ROW_SHARE * (x + 1) / (x0 + 1)))

    def predicted_tokens_per_s(self, x: int) -> float:
        return self.expected_emitted(x) / (self._draft_time(x) + x * self.refresh_token_s + self._verify_time(x))

    def _ranking_score(self, length: int, current: int) -> float:
        """The predicted tokens per second `next` ranks `length` by: discounted by `EXPLORE_MARGIN` while `length`
        was never timed (the current length, timed or not, is not discounted)."""
        p = self.predicted_tokens_per_s(length)
        return p if length in self.verify_s or length == current else p / (1 + EXPLORE_MARGIN)

    def next(self, x: int, accepted: int, draft_s: float, verify_s: float, refresh_s: float = 0.0,
             refreshed_tokens: int = 0) -> int:
        """Record the round just run (`observe`) and return the x of the next one (the same x until one timing is
        measured)."""
        self.observe(x, accepted, draft_s, verify_s, refresh_s, refreshed_tokens)
        if not self.draft_s:
            return x
        ranked = sorted(self.xs, key=lambda s: self._ranking_score(s, x), reverse=True)
        best, runner = ranked[0], ranked[1] if len(ranked) > 1 else ranked[0]
        stale = runner in self.timed_at and self.rounds - self.timed_at[runner] >= STALE_ROUNDS
        if stale and self.predicted_tokens_per_s(runner) >= (1 - RETIME_WITHIN) * self.predicted_tokens_per_s(best):
            return runner  # time it again (its measurement resets the staleness)
        return best


def make_policy(name: str, xs: tuple[int, ...]):
    """'cost' (default) or 'grow_shrink' over the static set `xs`."""
    if name == "cost":
        return CostModel(xs)
    if name == "grow_shrink":
        return GrowShrink(xs)
    raise ValueError(f"adaptive policy must be 'cost' or 'grow_shrink', got {name!r}")
