"""The docs match the code: every repository path README.md and docs/*.md cite exists, and the README's Python API
snippet runs as written."""

from __future__ import annotations

import glob
import os
import re

import pytest
from builders import REPO

# a repository path anywhere in the text (code spans, commands, prose) starts at a top-level folder; Markdown links
# may also be relative to the document
CITED = re.compile(r"(?<![\w/.-])((?:kvjax|tests|scripts|docs|checkpoints|pallas_kernels|\.ci)/"
                   r"[A-Za-z0-9_./-]*)(?![{*A-Za-z0-9_./-])")
LINK = re.compile(r"\]\(([^)#\s:]+)[)#]")


def _docs() -> list[str]:
    return [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]


def _cited_paths(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    found = {p.rstrip("/.") for p in CITED.findall(text)} | set(LINK.findall(text))
    return {p for p in found if "*" not in p and "{" not in p and p}


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: os.path.relpath(p, REPO))
def test_every_cited_path_exists(doc):
    here = os.path.dirname(doc)
    missing = [p for p in sorted(_cited_paths(doc))
               if not os.path.exists(os.path.join(REPO, p)) and not os.path.exists(os.path.join(here, p))]
    assert not missing, f"{os.path.relpath(doc, REPO)} cites paths that do not exist: {missing}"


def _python_api_snippet() -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_python_api_snippet_runs(monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the snippet names checkpoints/ relative to the repository, as a user there would
    exec(compile(_python_api_snippet(), "README.md (Python API)", "exec"), {})  # noqa: S102 - our own README
    assert capsys.readouterr().out  # it printed text, stats, a hit count
