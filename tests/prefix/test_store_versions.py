"""A store across format versions: entries another store format wrote open as compatibility misses ("store format
N", counted), this version's entries are written beside them, `kvjax cache --verify` reports both and
`--evict-stale` deletes only the stale ones. Two processes racing on one store (writers and an evictor) never
produce a token from a torn or foreign entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvjax.cli.main import main as cli_main
from kvjax.prefix import codec
from kvjax.prefix import inspect as store_inspect
from kvjax.prefix.tiers import MARKER_KEY, STORE_FORMAT_VERSION

OLD = STORE_FORMAT_VERSION - 1


def _rewrite_as_old_format(root: str, store_files) -> int:
    """Make the store at `root` look written by the previous store format: marker and every entry header."""
    with open(os.path.join(root, MARKER_KEY)) as f:
        doc = json.load(f)
    with open(os.path.join(root, MARKER_KEY), "w") as f:
        json.dump(dict(doc, format_version=OLD), f)
    files = store_files(root)
    for path in files:
        with open(path, "rb") as f:
            header, payload = codec.decode(f.read())
        header = {k: v for k, v in header.items() if k not in ("nbytes", "checksum")}
        with open(path, "wb") as f:
            f.write(codec.encode(dict(header, format_version=OLD), bytes(payload)))
    return len(files)


def test_old_format_entries_are_counted_compatibility_misses_beside_new_ones(model, make_cache, run, cold, prompt,
                                                                             tmp_path, store_files, capsys):
    url = str(tmp_path / "store")
    p, q = prompt(100, seed=1), prompt(100, seed=2)
    pc = make_cache(model, device_bytes=0, host_bytes=0, store_url=url)
    run(model, pc, p)
    run(model, pc, q)
    pc.flush()
    n_old = _rewrite_as_old_format(url, store_files)
    assert n_old > 0

    pc = make_cache(model, device_bytes=0, host_bytes=0, store_url=url)  # opens: no "this kvjax reads format" error
    logits, plan = run(model, pc, p)
    np.testing.assert_allclose(logits, cold(model, p), atol=1e-4)
    causes = {(s.kind, s.cause) for s in plan.shortfalls}
    assert ("compatibility", f"store format {OLD}") in causes and plan.boundary == 0
    assert pc.stats()["misses"]["compatibility"][f"store format {OLD}"] > 0
    pc.flush()

    # p's entries are now this version's (rewritten in place), q's are still the old format's: both reported
    r = store_inspect.inspect(url, verify=True)
    n_new = r["current"]
    assert r["corrupt"] == [] and n_new > 0 and len(r["stale"]) == n_old - n_new
    assert {e["format_version"] for e in r["stale"]} == {OLD}
    assert cli_main(["cache", url, "--verify"]) == 0
    assert "STALE" in capsys.readouterr().out

    # a fresh process hits the new entries; the stale ones stay misses
    pc2 = make_cache(model, device_bytes=0, host_bytes=0, store_url=url)
    logits, plan = run(model, pc2, p)
    assert plan.boundary > 0
    np.testing.assert_allclose(logits, cold(model, p), atol=1e-4)

    # --evict-stale deletes exactly the stale entries
    assert cli_main(["cache", url, "--evict-stale"]) == 0
    r = store_inspect.inspect(url, verify=True)
    assert r["stale"] == [] and r["corrupt"] == [] and r["current"] == n_new
    logits, plan = run(model, make_cache(model, device_bytes=0, host_bytes=0, store_url=url), p)
    assert plan.boundary > 0


RACER = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
from builders import toy_config, toy_model
from kvjax.api import logits as full_logits
from kvjax.families import forms_for
from kvjax.models.layer_types import FULL, SLIDING
from kvjax.prefix.manager import PrefixCache
from kvjax.prefix.prefill import prefill_with_prefix_cache

model = toy_model(toy_config((FULL, SLIDING, FULL), window=20))
url, me, rounds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(me)
base = [np.random.default_rng(100 + i).integers(0, 97, 96).astype(np.int32) for i in range(4)]
cold = {}
hits = bad = 0
for r in range(rounds):
    # small store cap: admissions evict; process 1 also evicts on purpose
    pc = PrefixCache(forms_for(model.config, np.float32, 16), device_bytes=0, host_bytes=0, store_url=url,
                     store_bytes=200_000)
    i = int(rng.integers(0, 4))
    p = np.concatenate([base[i][: int(rng.integers(48, 97))], rng.integers(0, 97, 8).astype(np.int32)])
    last, _, plan = prefill_with_prefix_cache(model, p, pc, capacity=256, chunk=32)
    want = np.asarray(full_logits(model, p)[-1])
    hits += plan.boundary > 0
    bad += not np.allclose(np.asarray(last), want, atol=1e-4)
    if me == 1 and r % 3 == 2:
        for s in pc.forms.specs:
            pc.evict(s.name, "store", 4)
    pc.flush()
print(hits, bad)
"""


@pytest.mark.slow  # two processes, ~30 s on a 2-core CPU
def test_two_processes_racing_on_one_store(tmp_path, model, make_cache, run, prompt):
    url = str(tmp_path / "store")
    pc = make_cache(model, device_bytes=0, host_bytes=0, store_url=url)  # create the store before the race
    run(model, pc, prompt(40))
    pc.flush()
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(tests_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", RACER, tests_dir, url, str(me), "12"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for me in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    hits, bad = np.asarray([[int(x) for x in out.split()[-2:]] for out, _ in outs]).sum(axis=0)
    assert bad == 0  # no prefill ever used a torn, foreign or half-evicted entry
    assert hits > 0  # and they did share entries
    r = store_inspect.inspect(url, verify=True)
    assert r["corrupt"] == [] and r["stale"] == []
