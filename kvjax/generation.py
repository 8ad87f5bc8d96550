"""What a generation returns and when it stops: `Generation` (tokens, text, finish reason, logprobs), `Delta` (one
streamed piece) and `StopRule` (end-of-sequence ids, stop token ids, stop strings) — one definition for every mode.

Stopping is decided on the emitted tokens after they are computed, identically whether they came from full-cache
decoding, VeriCache or a scheduler, so every mode stops at the same token:
- an end-of-sequence id of the model (unless `ignore_eos`) or a `stop` token id: the generation ends at that token,
  which is kept in `tokens` (as transformers keeps EOS) and left out of `text` (as vLLM leaves stop ids out);
- a `stop` string: the generation ends at the token whose decoded text first contains it; `text` is cut where the
  string begins (vLLM's default) and `tokens` keep that token.
`finish_reason` is "stop" for either, "length" when `max_new_tokens` ran out.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import numpy as np

from kvjax.errors import InputError

STOP, LENGTH = "stop", "length"


@dataclasses.dataclass
class Generation:
    """One generated continuation. Behaves like its token array (`np.asarray(g)`, `len(g)`, `g[i]`, `g.shape`).

    Attributes:
        tokens: i32[n] generated token ids (the stop token included, see the module docstring).
        text: their decoded text (None without a tokenizer), stop string and special tokens left out.
        finish_reason: "stop" or "length".
        logprobs: f32[n] log-probability of each token under the model's raw distribution, when asked.
        prompt_tokens: prompt length.
        stats: measurements: `tokens_per_s` (compilation left out, None when nothing was timed compiled),
            `decode_s`, and per mode VeriCache's rounds, acceptance, bytes, ... (`kvjax.decode.metrics`).
        logits: f32[n, V] the logits row that chose each token, when asked (`return_logits=True`).

    Deprecated, for one release: a result of `generate_vericache` / `reference_decode` still unpacks as the tuple
    those returned before 0.3 (`tokens, stats = kvjax.generate_vericache(...)`), with a DeprecationWarning;
    iterating any other Generation yields its token ids.
    """

    tokens: np.ndarray
    text: str | None
    finish_reason: str
    logprobs: np.ndarray | None = None
    prompt_tokens: int = 0
    stats: dict = dataclasses.field(default_factory=dict)
    logits: np.ndarray | None = None
    legacy: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

    def __array__(self, dtype=None, copy=None):
        return self.tokens if dtype is None else self.tokens.astype(dtype)

    def __len__(self) -> int:
        return int(self.tokens.size)

    def __iter__(self):
        if self.legacy is not None:
            warnings.warn("unpacking a Generation as a tuple is deprecated and goes in kvjax 0.4: read .tokens, "
                          ".stats, .logits, .logprobs", DeprecationWarning, stacklevel=2)
            return iter(self.legacy)
        return iter(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i]

    @property
    def shape(self):
        return self.tokens.shape

    @property
    def dtype(self):
        return self.tokens.dtype

    def tolist(self) -> list[int]:
        return self.tokens.tolist()

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (what the CLI prints)."""
        d = dict(text=self.text, tokens=self.tokens.tolist(), finish_reason=self.finish_reason,
                 prompt_tokens=self.prompt_tokens, new_tokens=len(self))
        if self.logprobs is not None:
            d["logprobs"] = [round(float(x), 6) for x in self.logprobs]
        return d


@dataclasses.dataclass(frozen=True)
class Delta:
    """One streamed piece of a generation: new token ids and the text they complete (may be empty while a multi-byte
    character is incomplete); the last delta carries the finish reason. With `logprobs=True`, `logprobs` holds each
    token id's log-probability."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    logprobs: tuple[float, ...] | None = None  # one per token id, when the stream was asked for them


class StopRule:
    """When a generation ends: EOS ids (unless ignored), stop token ids, stop strings.

    Args:
        eos_token_ids: the model's end-of-sequence ids.
        stop: a string, a token id, or a sequence mixing both.
        ignore_eos: do not stop at EOS (stop ids and strings still apply).
        tokenizer: needed for stop strings and for text.
    """

    def __init__(self, eos_token_ids=(), stop=None, *, ignore_eos: bool = False, tokenizer=None):
        items = [] if stop is None else ([stop] if isinstance(stop, (str, int, np.integer)) else list(stop))
        self.strings = tuple(s for s in items if isinstance(s, str))
        ids = [int(s) for s in items if isinstance(s, (int, np.integer)) and not isinstance(s, bool)]
        bad = [s for s in items if not isinstance(s, (str, int, np.integer)) or isinstance(s, bool)]
        if bad:
            raise InputError(f"stop must hold strings and token ids, got {bad[0]!r}")
        if any(not s for s in self.strings):
            raise InputError("stop strings must be non-empty")
        if self.strings and tokenizer is None:
            raise InputError("stop strings need a model with a tokenizer; give stop token ids instead")
        self.ids = frozenset(ids) | (frozenset() if ignore_eos else frozenset(int(e) for e in eos_token_ids))
        self.tokenizer = tokenizer

    def end(self, tokens: Sequence[int]) -> int | None:
        """How many of `tokens` to keep if the generation ends within them (the ending token included), else None."""
        id_end = next((i + 1 for i, t in enumerate(tokens) if int(t) in self.ids), None)
        str_end = self._string_end(tokens, len(tokens) if id_end is None else id_end)
        ends = [n for n in (id_end, str_end) if n is not None]
        return min(ends) if ends else None

    def _string_end(self, tokens, limit: int) -> int | None:
        """The fewest tokens (<= limit) whose decoded text contains a stop string, or None."""
        if not self.strings:
            return None

        def has(n):
            text = self.tokenizer.decode([int(t) for t in tokens[:n]])
            return any(s in text for s in self.strings)

        if not has(limit):
            return None
        lo, hi = 1, limit  # decoded text only grows with n, so "contains a stop string" is monotone in n
        while lo < hi:
            mid = (lo + hi) // 2
            if has(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def text(self, tokens: Sequence[int]) -> str | None:
        """The visible text of `tokens`: special tokens skipped, cut where the first stop string begins."""
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)
        cut = min((text.find(s) for s in self.strings if s in text), default=-1)
        return text[:cut] if cut >= 0 else text


class DeltaBuilder:
    """Turns tokens arriving in pieces into `Delta`s: text is held back while it ends in an incomplete character
    (decoded as U+FFFD until its last byte) or in a prefix of a stop string; the generation's end (stop rule or
    `max_new_tokens`) cuts the tokens exactly as `finish` does and sets `ended`."""

    def __init__(self, rule: StopRule, max_new_tokens: int):
        self.rule, self.max_new, self.tokens, self.shown, self.ended = rule, max_new_tokens, [], "", False
        self.logprobs: list[float] | None = None  # set once a piece brings logprobs

    def add(self, new, logprobs=None) -> Delta | None:
        """The delta for `new` tokens (None when nothing is ready to show yet); `logprobs`, one per new token, are
        carried on the delta that carries the token."""
        if self.ended:
            return None
        start = len(self.tokens)
        self.tokens += [int(t) for t in new]
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + [float(v) for v in logprobs]
        n = self.rule.end(self.tokens[: self.max_new])
        self.ended = n is not None or len(self.tokens) >= self.max_new
        keep = self.tokens[: (n if n is not None else self.max_new)]
        shown_ids = keep[:-1] if n is not None and keep and int(keep[-1]) in self.rule.ids else keep
        visible = self.rule.text(shown_ids) or ""
        if not self.ended:
            visible = _hold_back(visible, self.rule.strings)
        text = ""
        if visible.startswith(self.shown):  # else a tokenizer merge rewrote shown text (rare): wait until it settles
            text, self.shown = visible[len(self.shown):], visible
        ids = tuple(keep[start:]) if start < len(keep) else ()
        lps = tuple(self.logprobs[start:start + len(ids)]) if self.logprobs is not None else None
        if self.ended:
            return Delta(ids, text, STOP if n is not None else LENGTH, lps)
        if not (ids or text):
            return None
        return Delta(ids, text, None, lps)


def _hold_back(text: str, stop_strings) -> str:
    text = text.rstrip("\ufffd")
    cut = 0
    for s in stop_strings:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                cut = max(cut, k)
                break
    return text[: len(text) - cut] if cut else text


def finish(tokens: Sequence[int], rule: StopRule, max_new_tokens: int, *, prompt_tokens: int = 0,
           logprobs=None, stats: dict | None = None, logits=None) -> Generation:
    """The `Generation` of a run that produced `tokens` (possibly past its stop point: they are cut here, and so are
    `logprobs` f32[n] and `logits` f32[n, V])."""
    toks = np.asarray(tokens, np.int32).reshape(-1)[:max_new_tokens]
    n = rule.end(toks)
    reason = STOP if n is not None else LENGTH
    toks = toks[:n] if n is not None else toks
    lp = None if logprobs is None else np.asarray(logprobs, np.float32)[: toks.size]
    shown = toks[:-1] if toks.size and int(toks[-1]) in rule.ids else toks  # an end id is kept, never shown
    lg = None if logits is None else np.asarray(logits)[: toks.size]
    return Generation(tokens=toks, text=rule.text(shown), finish_reason=reason, logprobs=lp,
                      prompt_tokens=prompt_tokens, stats=dict(stats or {}, finish_reason=reason), logits=lg)
