"""Bug class 3: `kvjax cache` and the store tier act only on a directory that is verifiably a kvjax store (a marker
written at creation), and delete only that store's own entries; anything else is refused with one line."""

import hashlib
import json
import os
import shutil

import pytest

import kvjax
from kvjax import cli
from kvjax.prefix.prefill import model_namespace

CHECKPOINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(kvjax.__file__))), "checkpoints")


def _tree(root):
    """relative path -> sha256 of every file under root."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture
def copied_checkpoints(tmp_path):
    if not os.path.isdir(CHECKPOINTS):
        pytest.skip("the bundled checkpoints/ directory is not next to the package")
    d = tmp_path / "checkpoints"
    shutil.copytree(CHECKPOINTS, d)
    return str(d)


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("kvjax: error: "), err
    return err[0]


@pytest.mark.parametrize("argv", [["--evict", "kvjax"], ["--evict", "kvja"], ["--evict-corrupt"], ["--verify"],
                                  ["--verify", "--json"], []])
def test_cache_command_refuses_a_directory_that_is_not_a_store(copied_checkpoints, capsys, argv):
    before = _tree(copied_checkpoints)
    assert cli.main(["cache", copied_checkpoints, *argv]) == 2
    assert "not a kvjax prefix-cache store" in _one_error_line(capsys)
    assert _tree(copied_checkpoints) == before, "kvjax cache changed files it does not own"


def test_prefix_cache_refuses_a_directory_that_is_not_a_store(copied_checkpoints, model, make_cache):
    before = _tree(copied_checkpoints)
    with pytest.raises(ValueError, match="not a kvjax prefix-cache store"):
        make_cache(model, store_url=copied_checkpoints)
    assert _tree(copied_checkpoints) == before


def test_store_commands_touch_only_store_entries(model, make_cache, run, prompt, tmp_path, capsys, store_files):
    url = str(tmp_path / "store")
    pc = make_cache(model, store_url=url)
    run(model, pc, prompt(40))
    pc.flush()
    ns = model_namespace(model, pc).hex
    foreign = {os.path.join(url, "NOTES.txt"): b"mine", os.path.join(url, ns, "notes.txt"): b"mine too",
               os.path.join(url, ns, "dense", "README"): b"not an entry"}
    for p, data in foreign.items():
        open(p, "wb").write(data)
    assert cli.main(["cache", url, "--verify", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["corrupt"] == [] and sorted(r["foreign"]) == sorted(os.path.relpath(p, url) for p in foreign)
    # an entry, not the foreign README beside it (which sorts first whenever every entry name starts with a-f: the names
    # are digests, so which one comes first changes with anything in the namespace, e.g. the native library's sources)
    victim = next(f for f in store_files(url, "dense") if os.path.basename(f) != "README")
    raw = bytearray(open(victim, "rb").read())
    raw[-3] ^= 0xFF
    open(victim, "wb").write(bytes(raw))
    assert cli.main(["cache", url, "--evict-corrupt", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evicted_corrupt"] == 1 and not os.path.exists(victim)
    assert cli.main(["cache", url, "--evict", ns[:8], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evicted_namespaces"] == [ns]
    assert store_files(url) == [os.path.join(url, ns, "dense", "README")]  # README is the only non-entry there
    assert all(open(p, "rb").read() == data for p, data in foreign.items())
    assert not os.path.exists(os.path.join(url, ns, "namespace.json"))


def test_evict_prefix_must_be_hex(model, make_cache, tmp_path, capsys):
    url = str(tmp_path / "store")
    make_cache(model, store_url=url)
    assert cli.main(["cache", url, "--evict", "zzzz"]) == 2
    assert "hex" in _one_error_line(capsys)
