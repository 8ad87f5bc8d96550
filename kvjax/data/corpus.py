"""Python-source corpus for the bundled code model: the running interpreter's standard library plus the pure-Python
sources of kvjax's runtime dependencies (`kvjax.data.dependencies`; keys `deps/<distribution>/<path>`).

The corpus is the `*.py` files under `sysconfig.get_paths()["stdlib"]`, which every machine with Python has, so
nothing is downloaded. Excluded: test code (any directory named `test`, `tests`, `idle_test` or matching
`*_test*`; files `test_*.py` / `*_test.py`), `site-packages` / `dist-packages`, the build-machine-specific
`_sysconfigdata_*.py` and `config-*` directories, and files over `MAX_FILE_BYTES`.

Files are split BY FILE with a hash of their relative path (no random state), so the split of a file never
depends on which other files exist: ~90% train, ~5% validation, ~5% held-out. Held-out files are the source of
long prompts (`long_prompts`). Different Python versions have different standard libraries; `manifest()` records
the version and per-file sha256 so a run can say which corpus it used.

With `root` given, functions read a standard library at `root` alone (no dependencies). Otherwise the corpus is
the stdlib plus the dependencies, deduplicated by content: a file whose bytes equal an earlier file's (held-out
first, then validation, then train; path order within a split) is dropped, so no held-out text is trained on
through a vendored copy. The same exclusion rules apply to dependency paths.

`long_prompts` (the benchmark and demo prompts) draws from the held-out files of the standard library only, so
the prompts stay the same whichever dependencies are installed; those files are never trained on.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import platform
import sys
import sysconfig
from typing import Any, Sequence

import numpy as np

from kvjax.data import dependencies

SPLITS = ("train", "val", "heldout")
MAX_FILE_BYTES = 200 * 1024
# Split thresholds over a hash bucket in [0, 10000): [0, 9000) train, [9000, 9500) val, [9500, 10000) heldout.
_BUCKETS = 10000
_TRAIN_END, _VAL_END = 9000, 9500
_EXCLUDED_DIRS = ("test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__")
_EXCLUDED_DIR_PATTERNS = ("*_test*", "config-*")
_EXCLUDED_FILE_PATTERNS = ("test_*.py", "*_test.py", "_sysconfigdata_*.py")
_CACHE_FORMAT = 1


def separator(relpath: str) -> str:
    """The line that precedes each file in `read_text` and `token_stream`."""
    return f"\n# ---- file: {relpath} ----\n"


def stdlib_root() -> str:
    """Absolute path of the running Python's standard library (never written into committed files)."""
    return sysconfig.get_paths()["stdlib"]


def _excluded_dir(name: str) -> bool:
    return name in _EXCLUDED_DIRS or any(fnmatch.fnmatch(name, p) for p in _EXCLUDED_DIR_PATTERNS)


def _excluded_file(name: str) -> bool:
    return not name.endswith(".py") or any(fnmatch.fnmatch(name, p) for p in _EXCLUDED_FILE_PATTERNS)


def is_excluded(relpath: str) -> bool:
    """True if `relpath` ("a/b/c.py", "/"-separated, relative to the stdlib) is test code or not corpus material."""
    *dirs, name = relpath.split("/")
    return any(_excluded_dir(d) for d in dirs) or _excluded_file(name)


def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted "/"-separated relative paths of the corpus files under `root` (default: `stdlib_root()`)."""
    root = root or stdlib_root()
    if not os.path.isdir(root):
        raise FileNotFoundError(f"standard library directory not found: {root}")
    out = []
    # Symlinked directories are not followed, so nothing outside the stdlib tree (or visited twice) gets in.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _excluded_dir(d))
        for name in filenames:
            if _excluded_file(name):
                continue
            full = os.path.join(dirpath, name)
            if not os.path.isfile(full) or os.path.getsize(full) > MAX_FILE_BYTES:
                continue
            out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(out)


def split_of(relpath: str) -> str:
    """Which split a file belongs to: a pure function of its relative path."""
    bucket = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big") % _BUCKETS
    if bucket < _TRAIN_END:
        return "train"
    return "val" if bucket < _VAL_END else "heldout"


def split(files: Sequence[str]) -> dict[str, list[str]]:
    """Partition relative paths into {"train", "val", "heldout"} (each sorted; disjoint; union == files)."""
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for f in sorted(set(files)):
        out[split_of(f)].append(f)
    return out


def _check_split(name: str) -> None:
    if name not in SPLITS:
        raise ValueError(f"unknown split {name!r}; expected one of {SPLITS}")


def dependency_files() -> list[str]:
    """Sorted keys of the dependency sources that pass the exclusion and size rules."""
    out = []
    for info in dependencies.resolve()[0].values():
        for key, path in info["files"].items():
            if not is_excluded(key[len(dependencies.PREFIX):]) and os.path.getsize(path) <= MAX_FILE_BYTES:
                out.append(key)
    return sorted(out)


def file_path(relpath: str, root: str | None = None) -> str:
    """Absolute path of a corpus file key (a stdlib relpath or a `deps/...` key)."""
    if root is None and relpath.startswith(dependencies.PREFIX):
        return dependencies.path_of(relpath)
    return os.path.join(root or stdlib_root(), relpath)


def _sha256_file(relpath: str, root: str | None) -> str:
    with open(file_path(relpath, root), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


_SPLIT_CACHE: dict = {}


def corpus_splits(root: str | None = None, stdlib_only: bool = False) -> dict[str, list[str]]:
    """{split: sorted keys}: the stdlib (at `root`, or the running one plus the dependencies unless `stdlib_only`),
    split by path hash, then deduplicated by content (held-out, then validation, then train keep a file first)."""
    with_deps = root is None and not stdlib_only
    files = stdlib_files(root) + (dependency_files() if with_deps else [])
    if not with_deps:
        return split(files)
    key = tuple(files)
    if key not in _SPLIT_CACHE:
        by_split = split(files)
        seen, out = set(), {}
        for name in ("heldout", "val", "train"):
            kept = []
            for f in by_split[name]:
                digest = _sha256_file(f, None)
                if digest not in seen:
                    seen.add(digest)
                    kept.append(f)
            out[name] = kept
        _SPLIT_CACHE.clear()
        _SPLIT_CACHE[key] = {n: out[n] for n in SPLITS}
    return _SPLIT_CACHE[key]


def split_files(name: str, root: str | None = None, stdlib_only: bool = False) -> list[str]:
    """Keys of one split's files (see `corpus_splits`)."""
    _check_split(name)
    return corpus_splits(root, stdlib_only)[name]


def read_file(relpath: str, root: str | None = None) -> str:
    """One corpus file as text (bytes that are not UTF-8 become U+FFFD)."""
    with open(file_path(relpath, root), encoding="utf-8", errors="replace") as f:
        return f.read()


def pieces(name: str, root: str | None = None, stdlib_only: bool = False) -> list[tuple[str, str]]:
    """[(key, separator(key) + text)] for one split, in path order."""
    return [(f, separator(f) + read_file(f, root)) for f in split_files(name, root, stdlib_only)]


def read_text(name: str, root: str | None = None, stdlib_only: bool = False) -> str:
    """All files of a split joined, each preceded by its `separator` line."""
    return "".join(p for _, p in pieces(name, root, stdlib_only))


# ---------------------------------------------------------------------------------------------------------------
# Token streams (cached on disk) and long prompts.


def cache_dir() -> str:
    """Where token streams are cached: $KVJAX_CACHE_DIR, else $XDG_CACHE_HOME/kvjax, else ~/.cache/kvjax."""
    if os.environ.get("KVJAX_CACHE_DIR"):
        return os.environ["KVJAX_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvjax")


def _tokenizer_identity(tokenizer: Any) -> str:
    if hasattr(tokenizer, "fingerprint"):  # kvjax.tokenizer.Tokenizer
        return tokenizer.fingerprint()
    if hasattr(tokenizer, "to_str"):  # a raw `tokenizers.Tokenizer`
        return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()
    raise TypeError(f"expected kvjax.tokenizer.Tokenizer or tokenizers.Tokenizer, got {type(tokenizer).__name__}")


def _encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    raw = getattr(tokenizer, "backend", tokenizer)  # kvjax Tokenizer wraps a `tokenizers.Tokenizer` as .backend
    if hasattr(raw, "encode_batch"):
        return [e.ids for e in raw.encode_batch(texts, add_special_tokens=False)]
    return [tokenizer.encode(t) for t in texts]


def token_stream_with_offsets(tokenizer: Any, name: str, root: str | None = None,
                              stdlib_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of a split and where each file starts in them.

    Each file piece (`separator` + text) is encoded on its own and the results concatenated, so file starts are
    exact token boundaries. (Encoding `read_text(name)` in one go can differ by a token at a boundary, where two
    whitespace runs merge.) Cached under `cache_dir()`, keyed by split, tokenizer fingerprint and file contents.

    Returns:
      tokens: i32[L] all tokens of the split.
      starts: i64[F+1] token offset of each file's first token, then L.
    """
    _check_split(name)
    items = pieces(name, root, stdlib_only)
    h = hashlib.sha256(f"kvjax-corpus-v{_CACHE_FORMAT}\0{name}\0{_tokenizer_identity(tokenizer)}".encode())
    for _, text in items:
        h.update(hashlib.sha256(text.encode("utf-8")).digest())
    path = os.path.join(cache_dir(), "corpus", f"{name}-{h.hexdigest()[:32]}.npz")
    if os.path.exists(path):
        try:
            with np.load(path) as z:
                return z["tokens"], z["starts"]
        except (OSError, ValueError, KeyError):
            pass  # unreadable cache entry (e.g. truncated): recompute and overwrite
    ids = _encode_batch(tokenizer, [text for _, text in items])
    lengths = np.array([len(x) for x in ids], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.fromiter((t for x in ids for t in x), np.int32, count=int(starts[-1]))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(tmp, tokens=tokens, starts=starts)
    os.replace(tmp, path)  # atomic: concurrent runs never read a half-written file
    return tokens, starts


def token_stream(tokenizer: Any, name: str, root: str | None = None, stdlib_only: bool = False) -> np.ndarray:
    """i32[L] tokens of a split (see `token_stream_with_offsets`; cached on disk)."""
    return token_stream_with_offsets(tokenizer, name, root, stdlib_only)[0]


def long_prompts(tokenizer: Any, n_tokens: int, count: int, seed: int = 0, *, root: str | None = None,
                 split_name: str = "heldout", stdlib_only: bool = True) -> list[np.ndarray]:
    """`count` windows of exactly `n_tokens` tokens of held-out code, deterministic in `seed`.

    Files are the split's stdlib files unless `stdlib_only=False` (then the dependencies' too). Prompt i starts at
    the first token of a file (files are visited in a seeded permutation, so different prompts
    start at different files while there are enough of them) and runs on through the following files in path
    order, wrapping around to the first file when the split is shorter than `n_tokens`.

    Returns:
      list of `count` arrays i32[n_tokens].
    """
    if n_tokens < 1 or count < 0:
        raise ValueError(f"need n_tokens >= 1 and count >= 0, got n_tokens={n_tokens}, count={count}")
    tokens, starts = token_stream_with_offsets(tokenizer, split_name, root, stdlib_only)
    total, n_files = tokens.size, starts.size - 1
    if total == 0:
        raise ValueError(f"split {split_name!r} has no tokens")
    order = np.random.default_rng(seed).permutation(n_files)
    out = []
    for i in range(count):
        first = int(starts[order[i % n_files]])
        idx = (first + np.arange(n_tokens, dtype=np.int64)) % total
        out.append(tokens[idx].astype(np.int32))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Manifest.


def manifest(root: str | None = None) -> dict:
    """What the corpus is, with no absolute machine paths: Python version, rules, per-split files and sha256s.

    `splits[name]["files"]` maps relpath -> sha256 of the file's bytes; `splits[name]["sha256"]` hashes the
    sorted (relpath, file sha256) pairs, so two machines agree on a split iff the digests match.
    """
    splits = {}
    for name, files in corpus_splits(root).items():
        digests = {f: _sha256_file(f, root) for f in files}
        whole = hashlib.sha256("".join(f"{f}\0{d}\n" for f, d in digests.items()).encode()).hexdigest()
        size = sum(os.path.getsize(file_path(f, root)) for f in files)
        splits[name] = dict(n_files=len(files), bytes=size, sha256=whole, files=digests)
    packages = {"python-stdlib": dict(version=platform.python_version(), licence="PSF-2.0",
                                      files={n: sum(not f.startswith(dependencies.PREFIX) for f in splits[n]["files"])
                                             for n in SPLITS})}
    if root is None:
        dists, missing = dependencies.resolve()
        for dist, info in sorted(dists.items()):
            counts = {n: sum(dependencies.package_of(f) == dist for f in splits[n]["files"]
                             if f.startswith(dependencies.PREFIX)) for n in SPLITS}
            packages[dist] = dict(version=info["version"], licence=info["licence"], files=counts)
    else:
        missing = ()
    return dict(
        source='*.py files of sysconfig.get_paths()["stdlib"] of the Python that built this manifest, plus the '
               '*.py files of the installed runtime dependencies of kvjax (keys deps/<distribution>/<path>)',
        packages=packages,
        dependencies_not_installed=list(missing),
        python_version=platform.python_version(),
        python_implementation=platform.python_implementation(),
        python_version_full=sys.version.split()[0],
        rules=dict(
            excluded_dirs=list(_EXCLUDED_DIRS),
            excluded_dir_patterns=list(_EXCLUDED_DIR_PATTERNS),
            excluded_file_patterns=list(_EXCLUDED_FILE_PATTERNS),
            max_file_bytes=MAX_FILE_BYTES,
            split="bucket = int(sha256(relpath)[:8 bytes], big-endian) % 10000; "
                  "<9000 train, <9500 val, else heldout",
            separator=separator("<relpath>"),
            file_package='stdlib relpath -> "python-stdlib"; "deps/<distribution>/..." -> <distribution>; '
                         "version and licence of each in `packages`",
            dedup="sha256 of the bytes; first occurrence kept in the order heldout, val, train (path order within)",
            decoding='utf-8, errors="replace"',
        ),
        splits=splits,
    )


def write_manifest(path: str, extra: dict | None = None, root: str | None = None) -> dict:
    """Write `manifest()` (plus `extra` keys, and any "tokenizer" section already in the file) as JSON."""
    m = manifest(root)
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if "tokenizer" in old:
            m["tokenizer"] = old["tokenizer"]
    m.update(extra or {})
    with open(path, "w") as f:
        json.dump(m, f, indent=1, sort_keys=False)
        f.write("\n")
    return m
