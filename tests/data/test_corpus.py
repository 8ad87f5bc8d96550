"""kvjax.data.corpus: deterministic by-file split of the stdlib, exclusions, token streams, long prompts, manifest."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvjax.data import corpus
from kvjax.tokenizer import Tokenizer
from builders import CHECKPOINTS

SHIPPED = os.path.join(CHECKPOINTS, "kvjax-code-tiny")


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    # Token streams go to a fresh cache dir, so the test exercises compute + store + reload, never a stale entry.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVJAX_CACHE_DIR", str(tmp_path_factory.mktemp("kvjax_cache")))
        yield


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(SHIPPED)


@pytest.fixture(scope="module")
def files():
    return corpus.stdlib_files()


def _write(root, rel, text="x = 1\n", mode="w"):
    path = os.path.join(root, *rel.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as f:
        f.write(text)


@pytest.mark.parametrize("rel, excluded", [
    ("os.py", False), ("json/decoder.py", False), ("unittest/case.py", False), ("doctest.py", False),
    ("test/test_os.py", True), ("test/support/__init__.py", True), ("idlelib/idle_test/htest.py", True),
    ("lib2to3/tests/data/bom.py", True), ("ctypes/test/x.py", True), ("foo_tests_bar/x.py", True),
    ("a/b_test/c.py", True), ("pkg/test_thing.py", True), ("pkg/thing_test.py", True),
    ("site-packages/numpy/core.py", True), ("README.txt", True), ("x.pyc", True),
    ("_sysconfigdata__linux_x86_64-linux-gnu.py", True), ("config-3.11-x86_64-linux-gnu/python-config.py", True),
])
def test_is_excluded(rel, excluded):
    assert corpus.is_excluded(rel) == excluded


def test_stdlib_files_exclude_tests(files):
    assert len(files) > 200 and files == sorted(set(files))
    assert {"os.py", "json/decoder.py", "collections/__init__.py"} <= set(files)
    assert not [f for f in files if corpus.is_excluded(f)]
    root = corpus.stdlib_root()
    assert all(os.path.getsize(os.path.join(root, f)) <= corpus.MAX_FILE_BYTES for f in files)


def test_split_is_deterministic_disjoint_and_complete(files):
    s = corpus.split(files)
    assert s == corpus.split(list(reversed(files)) + files[:10])  # order and duplicates do not matter
    sets = [set(s[k]) for k in corpus.SPLITS]
    assert sum(map(len, sets)) == len(files) and set().union(*sets) == set(files)
    # A file's split depends only on its own path: removing files never moves the others.
    sub = corpus.split(files[::3])
    assert all(set(sub[k]) <= set(s[k]) for k in corpus.SPLITS)
    fractions = {k: len(s[k]) / len(files) for k in corpus.SPLITS}
    assert 0.85 < fractions["train"] < 0.95 and 0.02 < fractions["val"] < 0.08 and 0.02 < fractions["heldout"] < 0.08


def test_synthetic_root_exclusions_and_bad_bytes(tmp_path):
    root = str(tmp_path)
    _write(root, "keep.py")
    _write(root, "pkg/mod.py")
    _write(root, "pkg/tests/t.py")
    _write(root, "test_top.py")
    _write(root, "site-packages/lib.py")
    _write(root, "big.py", "#" * (corpus.MAX_FILE_BYTES + 1))
    _write(root, "latin1.py", b"s = '\xe9t\xe9'\n", mode="wb")
    os.symlink(os.path.join(root, "pkg"), os.path.join(root, "linked"))  # not followed: no duplicates
    assert corpus.stdlib_files(root) == ["keep.py", "latin1.py", "pkg/mod.py"]
    assert corpus.read_file("latin1.py", root) == "s = '\ufffdt\ufffd'\n"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        corpus.stdlib_files(os.path.join(root, "nowhere"))


def test_read_text_and_token_stream(tok):
    names = corpus.split_files("heldout")
    text = corpus.read_text("heldout")
    assert text.startswith(corpus.separator(names[0])) and text.count("\n# ---- file: ") >= len(names)
    tokens, starts = corpus.token_stream_with_offsets(tok, "heldout")
    assert tokens.dtype == np.int32 and starts.size == len(names) + 1 and starts[-1] == tokens.size
    for i in (0, len(names) // 2, len(names) - 1):  # each file's tokens decode to exactly its piece
        piece = corpus.separator(names[i]) + corpus.read_file(names[i])
        assert tok.decode(tokens[starts[i]:starts[i + 1]]) == piece
    assert tok.decode(tokens) == text
    cached = os.listdir(os.path.join(corpus.cache_dir(), "corpus"))
    assert len(cached) == 1 and cached[0].startswith("heldout-")
    again = corpus.token_stream(tok, "heldout")  # served from the cache file
    np.testing.assert_array_equal(again, tokens)
    with pytest.raises(ValueError, match="unknown split"):
        corpus.token_stream(tok, "validation")


def test_long_prompts_exact_length_and_deterministic(tok):
    a = corpus.long_prompts(tok, 8192, 3, seed=0)
    b = corpus.long_prompts(tok, 8192, 3, seed=0)
    c = corpus.long_prompts(tok, 8192, 3, seed=1)
    assert [p.shape for p in a] == [(8192,)] * 3 and all(p.dtype == np.int32 for p in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert len({p[:64].tobytes() for p in a}) == 3  # distinct starting files
    assert all(tok.decode(p[:40]).startswith("\n# ---- file: ") for p in a)  # start at a file boundary


def test_long_prompts_wrap_around_short_split(tmp_path, tok):
    root = str(tmp_path)
    names = [f"m{i}.py" for i in range(40) if corpus.split_of(f"m{i}.py") == "train"][:3]
    for i, name in enumerate(names):
        _write(root, name, f"def f{i}(x):\n    return x * {i}\n")
    assert corpus.split_files("train", root) == names
    tokens, starts = corpus.token_stream_with_offsets(tok, "train", root)
    n = 2 * tokens.size + 5
    (p,) = corpus.long_prompts(tok, n, 1, root=root, split_name="train")
    assert p.shape == (n,)
    # The prompt is the split's token stream read cyclically from the first token of one of its files.
    matches = [k for k in starts[:-1] if np.array_equal(p, tokens[(k + np.arange(n)) % tokens.size])]
    assert len(matches) == 1
    with pytest.raises(ValueError, match="n_tokens"):
        corpus.long_prompts(tok, 0, 1, root=root, split_name="train")


def _strings(x):
    if isinstance(x, dict):
        for k, v in x.items():
            yield k
            yield from _strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)
    elif isinstance(x, str):
        yield x


def test_manifest_has_no_absolute_paths(files):
    m = corpus.manifest()
    root = corpus.stdlib_root()
    for s in _strings(m):
        assert root not in s and not os.path.isabs(s) and os.path.join(os.path.expanduser("~"), "") not in s, s
    splits = corpus.corpus_splits()
    assert all(m["splits"][k]["n_files"] == len(splits[k]) for k in corpus.SPLITS)
    assert all(len(d) == 64 for k in corpus.SPLITS for d in m["splits"][k]["files"].values())
    stdlib = m["packages"]["python-stdlib"]["files"]
    assert sum(stdlib.values()) <= len(files) and m["packages"]["numpy"]["licence"]


def test_shipped_manifest_follows_the_split_rule():
    with open(os.path.join(SHIPPED, "corpus_manifest.json")) as f:
        m = json.load(f)
    assert m["tokenizer"]["vocab_size"] == 4096
    for name in corpus.SPLITS:
        listed = m["splits"][name]["files"]
        assert listed and all(corpus.split_of(f) == name and not corpus.is_excluded(f) for f in listed)
    for s in _strings(m):
        assert not os.path.isabs(s), s


def test_runtime_dependencies_come_in_without_the_test_extra():
    from kvjax.data import dependencies

    dists, _ = dependencies.resolve()
    assert {"jax", "numpy", "optax", "flax", "jinja2"} <= set(dists)
    assert not {"pytest", "hypothesis", "torch", "transformers", "pytest-xdist"} & set(dists)
    assert all(info["version"] and info["licence"] for info in dists.values())
    keys = corpus.dependency_files()
    assert keys and all(k.startswith("deps/") and not corpus.is_excluded(k[len("deps/"):]) for k in keys)
    assert dependencies.package_of("deps/numpy/numpy/__init__.py") == "numpy"


def test_corpus_is_deduplicated_and_held_out_text_is_never_trained_on(files):
    import hashlib

    splits = corpus.corpus_splits()
    digests = {k: {hashlib.sha256(open(corpus.file_path(f), "rb").read()).hexdigest() for f in v}
               for k, v in splits.items()}
    assert sum(len(v) for v in digests.values()) == sum(len(v) for v in splits.values())  # no duplicate content
    assert not digests["train"] & digests["heldout"] and not digests["train"] & digests["val"]
    assert any(f.startswith("deps/") for f in splits["train"])
    stdlib_heldout = corpus.split_files("heldout", stdlib_only=True)
    assert stdlib_heldout and set(stdlib_heldout) <= set(splits["heldout"])  # the benchmark prompts' files
    assert all(corpus.split_of(f) == name for name, v in splits.items() for f in v)
