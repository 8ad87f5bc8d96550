"""The pure-Python sources of kvjax's runtime dependencies, as corpus material.

Starts from the `[project] dependencies` of kvjax (the installed distribution's requirements with no extra, so
the `test` extra never comes in; or the names in `RUNTIME_DEPENDENCIES` when kvjax is not installed) and follows
each installed distribution's own unconditional requirements. Every `*.py` file a distribution's RECORD lists
under site-packages becomes a corpus entry keyed `deps/<distribution>/<path inside site-packages>`, so the key
(and therefore the split) depends on neither the machine nor the version. Distributions not installed are
skipped and reported by `resolve`.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import os
import re

PREFIX = "deps/"
# pyproject.toml's [project] dependencies, for a source checkout that is not pip-installed.
RUNTIME_DEPENDENCIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "safetensors", "tokenizers",
                        "jinja2", "tensorstore", "tqdm", "matplotlib")


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _unconditional(requirements: list[str] | None) -> list[str]:
    from packaging.requirements import Requirement

    out = []
    for text in requirements or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req.name)
    return out


def root_requirements() -> list[str]:
    """kvjax's own runtime requirements (no extras)."""
    try:
        names = _unconditional(md.distribution("kvjax").requires)
    except md.PackageNotFoundError:
        names = []
    return sorted(set(names) | set(RUNTIME_DEPENDENCIES), key=canonical)


def licence_of(dist: md.Distribution) -> str:
    """SPDX expression when declared, else the OSI classifiers, else the first line of the License field."""
    meta = dist.metadata
    if meta.get("License-Expression"):
        return meta["License-Expression"].strip()
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return " OR ".join(classifiers)
    text = (meta.get("License") or "").strip()
    return text.splitlines()[0][:80] if text else "unknown"


@functools.lru_cache(maxsize=1)
def resolve() -> tuple[dict[str, dict], tuple[str, ...]]:
    """({distribution: {version, licence, files: {key: absolute path}}}, names required but not installed)."""
    found: dict[str, dict] = {}
    missing = []
    todo = list(root_requirements())
    while todo:
        name = canonical(todo.pop())
        if name in found or name in missing or name == "kvjax":
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            missing.append(name)
            continue
        files = {}
        for f in dist.files or []:
            rel = str(f).replace(os.sep, "/")
            if not rel.endswith(".py") or rel.startswith("..") or os.path.isabs(rel):
                continue  # outside site-packages (scripts in bin/, etc.)
            path = str(f.locate())
            if os.path.isfile(path):
                files[f"{PREFIX}{name}/{rel}"] = path
        found[name] = dict(version=dist.version, licence=licence_of(dist), files=files)
        todo.extend(_unconditional(dist.requires))
    return found, tuple(sorted(missing))


def package_of(key: str) -> str:
    """The distribution name of a `deps/<distribution>/...` key."""
    return key[len(PREFIX):].split("/", 1)[0]


def path_of(key: str) -> str:
    """Absolute path of a dependency file key (KeyError naming the key if it is not installed here)."""
    dists, _ = resolve()
    try:
        return dists[package_of(key)]["files"][key]
    except KeyError:
        raise KeyError(f"corpus file {key!r} is not installed on this machine") from None
