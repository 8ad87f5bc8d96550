"""Long-context tasks whose answers are checked exactly: a fact buried at a stated depth in real source code, asked
for at the end of the prompt.

Why: a lossy KV cache keeps a model's soft scores (perplexity, most next tokens) close to the full cache's, yet
loses the one token span an exact answer needs (the VeriCache paper's motivating result). These tasks make that
visible: decoding from a lossy cache alone gets some answers wrong that full-cache decoding gets right, while
VeriCache, which verifies every token against the full cache, answers exactly as full-cache decoding does.

The haystack is the `modeling_*.py` source of the `transformers` distribution (pinned in kvjax's `test` extra, and
not part of the corpus the bundled model trains on: that is the standard library plus kvjax's *runtime*
dependencies, `kvjax.data.dependencies`). Files are taken in a seeded order of their sorted RECORD paths, so a task
set is the same on every machine with the pinned version (`HAYSTACK_DISTRIBUTION`, recorded with each task).

Two kinds, both answered by copying a span the prompt defined once, far back:
  - `value`: a constant `NAME = "<8 random hex digits>"` is inserted at the stated depth; the prompt ends restating
    it, `NAME = "`, and the answer is the value and its closing quote;
  - `signature`: a function with a unique name and four made-up parameters is inserted at the depth; the prompt ends
    restating it, `def name(`, and the answer is the exact parameter list and `):` (compared up to
    whitespace: one parameter per line is the same list).
Names and values are drawn from a seeded generator and checked absent from the haystack, so nothing but the
needle can supply the answer. Needles go in where a statement starts (outside docstrings and brackets), at its
indentation, so the file around them stays well-formed Python (a needle between two methods is indented as one).
Every prompt of a set has exactly the asked length (one compiled shape); `depth` is where the needle landed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata as md

import numpy as np

HAYSTACK_DISTRIBUTION = "transformers"
KINDS = ("value", "signature")
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
_WORDS = ("anchor", "beacon", "bucket", "cobalt", "ember", "falcon", "harbor", "ledger", "maple", "orbit", "pixel",
          "quartz", "raven", "summit", "tundra", "willow", "zephyr", "lantern", "meadow", "cinder", "glacier",
          "thistle", "saffron", "juniper", "copper", "marble", "velvet", "hollow", "spruce", "walnut")
_HEX = "0123456789abcdef"


@dataclasses.dataclass(frozen=True)
class ExactTask:
    """One task: a prompt whose continuation must start with `answer`, character for character."""

    kind: str                # "value" or "signature"
    prompt_ids: np.ndarray   # i32[P]
    answer: str              # the exact text the continuation must begin with
    depth: float             # where the needle landed: needle_token / len(prompt_ids)
    target_depth: float      # the depth asked for (the needle goes in at the nearest statement boundary)
    needle_token: int        # index into prompt_ids of the needle's first token
    needle: str              # the inserted text
    haystack: tuple          # the source files (paths inside site-packages) the haystack came from

    def is_correct(self, continuation: str) -> bool:
        """Exact check: the decoded continuation starts with the answer, character for character — for a signature
        up to whitespace (a parameter list written one per line, as the haystack's code does, is the same list)."""
        if self.kind == "signature":
            return "".join(continuation.split()).startswith("".join(self.answer.split()))
        return continuation.startswith(self.answer)


@functools.lru_cache(maxsize=2)
def haystack_files(distribution: str = HAYSTACK_DISTRIBUTION) -> tuple[str, ...]:
    """Sorted RECORD paths of the distribution's `modeling_*.py` files.

    Raises:
        ValueError: when the distribution is not installed or has no such files.
    """
    try:
        dist = md.distribution(distribution)
    except md.PackageNotFoundError:
        raise ValueError(f"exact tasks read their haystack from the {distribution!r} distribution, which is not "
                         f"installed (it is pinned in kvjax's test extra: pip install -e '.[test]')") from None
    files = sorted(str(f) for f in dist.files or () if f.name.startswith("modeling_") and f.suffix == ".py")
    if not files:
        raise ValueError(f"the {distribution!r} distribution lists no modeling_*.py files")
    return tuple(files)


def haystack_version(distribution: str = HAYSTACK_DISTRIBUTION) -> str:
    """The installed version of the haystack's distribution (a task set is fixed by it and the seed)."""
    return md.version(distribution)


def _read(distribution: str, path: str) -> str:
    return md.distribution(distribution).locate_file(path).read_text(encoding="utf-8")


def _name(rng, n_words: int) -> str:
    return "_".join(rng.choice(_WORDS, n_words, replace=False))


def _needle(kind: str, rng) -> tuple[str, str, str, tuple]:
    """(needle text, query text that ends the prompt, answer, strings the haystack must not contain)."""
    if kind == "value":
        name = _name(rng, 3).upper()
        value = "".join(rng.choice(list(_HEX), 8))
        return (f'{name} = "{value}"\n\n\n', f'\n\n\n# {name} once more, unchanged:\n{name} = "', f'{value}"',
                (name, value))
    if kind == "signature":
        fname = _name(rng, 3)
        a, b, c, d = (_name(rng, 2) for _ in range(4))
        params = f"{a}, {b}, *, {c}={int(rng.integers(2, 100))}, {d}=None"
        needle = (f"def {fname}({params}):\n    \"\"\"Combine {a} with {b}.\"\"\"\n"
                  f"    return {a}, {b}, {c}, {d}\n\n\n")
        return needle, f"\n\n\n# {fname} once more, unchanged:\ndef {fname}(", f"{params}):", (fname, a, b, c, d)
    raise ValueError(f"unknown exact-task kind {kind!r}; expected one of {KINDS}")


def _haystack_lines(tokenizer, rng, n_tokens: int, distribution: str):
    """Whole lines of seeded-order haystack files, at least `n_tokens` tokens by per-line count:
    (lines, per-line token counts, files used)."""
    files = haystack_files(distribution)
    lines, counts, used = [], [], []
    for i in rng.permutation(len(files)):
        used.append(files[i])
        for line in _read(distribution, files[i]).splitlines(keepends=True):
            lines.append(line)
            counts.append(len(tokenizer.encode(line)))
        lines.append("\n\n")
        counts.append(1)
        if sum(counts) >= n_tokens:
            return lines, counts, tuple(used)
    raise ValueError(f"the {distribution!r} haystack has fewer than {n_tokens} tokens")


def _statement_starts(lines) -> list[bool]:
    """Per line: does a new statement start there (outside docstrings and brackets, not after a decorator or a
    backslash)? Brackets are counted per line with comments cut off: a heuristic, good for real source files."""
    out, in_string, depth, prev = [], False, 0, ""
    for line in lines:
        head = line.lstrip(" ")[:1]
        out.append(not in_string and depth == 0 and (head.isalpha() or head in "_@#")
                   and not prev.startswith("@") and not prev.endswith("\\"))
        if (line.count('"""') + line.count("'''")) % 2:
            in_string = not in_string
        elif not in_string:
            code = line.split("#")[0]
            depth = max(depth + sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}"), 0)
        if line.strip():
            prev = line.strip()
    return out


def _boundary(starts, at: int) -> int:
    """The line index nearest `at` where a statement starts (so a needle inserted before it, at its indentation,
    keeps the file well-formed Python)."""
    for delta in range(len(starts)):
        for i in (at - delta, at + delta):
            if 0 < i < len(starts) and starts[i]:
                return i
    return at


def _indent(text: str, lines, i: int) -> str:
    pad = lines[i][:len(lines[i]) - len(lines[i].lstrip(" "))] if i < len(lines) else ""
    return "".join(pad + ln if ln.strip() else ln for ln in text.splitlines(keepends=True))


def make_task(tokenizer, n_tokens: int, kind: str, depth: float, seed: int, *,
              distribution: str = HAYSTACK_DISTRIBUTION) -> ExactTask:
    """One task of exactly `n_tokens` prompt tokens, deterministic in its arguments. The haystack is whole lines
    of source, except that its first line may start mid-line (the surplus is cut off the front in tokens).

    Raises:
        ValueError: for an unknown kind, a depth outside (0, 1), or too small a budget.
    """
    if not 0.0 < depth < 1.0:
        raise ValueError(f"depth must be in (0, 1), got {depth}")
    rng = np.random.default_rng([seed, KINDS.index(kind) if kind in KINDS else 99, int(round(depth * 1000))])
    needle, query, answer, unique = _needle(kind, rng)
    fixed = len(tokenizer.encode(needle)) + len(tokenizer.encode(query))
    budget = n_tokens - fixed - 8
    if budget < 64:
        raise ValueError(f"n_tokens={n_tokens} leaves no room for a haystack (needle + query take {fixed})")
    lines, counts, used = _haystack_lines(tokenizer, rng, budget + 512, distribution)
    hay = "".join(lines)
    if any(u in hay for u in unique):
        raise ValueError(f"seed {seed}: the needle's name or answer occurs in the haystack; pick another seed")
    cum = np.cumsum(counts)
    end = int(np.searchsorted(cum, budget + 128)) + 1  # a little over the budget; the surplus is cut off the front
    starts = _statement_starts(lines)
    shift, best = 0, None  # correction in tokens after measuring where the needle landed; best attempt so far
    for _ in range(4):
        over = max(int(cum[end - 1]) + fixed - n_tokens, 0)  # tokens the front will lose (estimated)
        cut = min(_boundary(starts, int(np.searchsorted(cum, over + depth * (n_tokens - fixed) + shift))), end - 1)
        prefix, placed = "".join(lines[:cut]), _indent(needle, lines, cut)
        ids = tokenizer.encode(prefix + placed + "".join(lines[cut:end]) + query)
        if len(ids) < n_tokens:
            if end == len(lines):
                raise ValueError(f"the {distribution!r} haystack is too short for {n_tokens} tokens")
            end = min(end + 16, len(lines))
            continue
        drop = len(ids) - n_tokens  # an exact length: every task of a set shares one compiled shape
        needle_token = len(tokenizer.encode(prefix)) - drop
        error = needle_token - depth * n_tokens
        if needle_token >= 0 and (best is None or abs(error) < abs(best[0])):
            best = (error, ids[drop:], needle_token, placed)
        if abs(error) <= 0.02 * n_tokens:
            break
        shift -= error
    if best is None:
        raise ValueError(f"could not place a needle at depth {depth} in {n_tokens} tokens")
    _, ids, needle_token, placed = best
    return ExactTask(kind=kind, prompt_ids=np.asarray(ids, np.int32), answer=answer,
                     depth=round(needle_token / n_tokens, 3), target_depth=float(depth),
                     needle_token=needle_token, needle=placed, haystack=used)


def make_tasks(tokenizer, n_tokens: int, count: int, seed: int = 0, *, kinds=KINDS, depths=DEFAULT_DEPTHS,
               distribution: str = HAYSTACK_DISTRIBUTION) -> list[ExactTask]:
    """`count` tasks cycling over kinds (fastest) and depths; task i uses seed `seed + i`."""
    out = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        depth = depths[(i // len(kinds)) % len(depths)]
        out.append(make_task(tokenizer, n_tokens, kind, depth, seed + i, distribution=distribution))
    return out
