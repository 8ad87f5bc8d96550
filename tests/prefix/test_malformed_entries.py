"""Bug class 5: every malformed entry, at runtime and in `kvjax cache --verify` (with its JSON), is a counted miss
with its cause, never an exception."""

import json

import jax
import numpy as np
import pytest

from kvjax import cli
from kvjax.prefix.tiers import host_sharding


def _rewrite_header(path, header_bytes: bytes):
    raw = open(path, "rb").read()
    hl = int.from_bytes(raw[:8], "little")
    payload = raw[8 + hl:]
    open(path, "wb").write(len(header_bytes).to_bytes(8, "little") + header_bytes + payload)


def _header(path) -> dict:
    raw = open(path, "rb").read()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])


DAMAGE = {
    "header is a list": lambda p: _rewrite_header(p, b"[1, 2, 3]"),
    "header is a number": lambda p: _rewrite_header(p, b"42"),
    "header is not JSON": lambda p: _rewrite_header(p, b"{not json"),
    "header length past the end": lambda p: open(p, "wb").write((1 << 40).to_bytes(8, "little") + b"{}"),
    "field of the wrong type": lambda p: _rewrite_header(p, json.dumps({**_header(p), "nbytes": "8192"}).encode()),
    "field missing": lambda p: _rewrite_header(p, json.dumps({k: v for k, v in _header(p).items()
                                                              if k != "checksum"}).encode()),
    "payload shorter than the header says": lambda p: open(p, "wb").write(open(p, "rb").read()[:-7]),
    "empty value": lambda p: open(p, "wb").write(b""),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_malformed_store_entry_is_a_counted_miss(model, stored, run, cold, store_files, capsys, damage):
    url, p, reopen = stored
    victim = store_files(url, "dense")[0]
    DAMAGE[damage](victim)
    pc2 = reopen()
    got, plan = run(model, pc2, p)
    np.testing.assert_allclose(got, cold(model, p), atol=2e-5, rtol=0)
    assert pc2.stats()["misses"]["capacity"]["corrupt"] > 0, pc2.stats()["misses"]
    # the prefill re-inserted a good copy; damage it again: the offline check names it, prints its JSON, exits 2
    pc2.flush()
    DAMAGE[damage](victim)
    rc = cli.main(["cache", url, "--verify", "--json"])
    cap = capsys.readouterr()
    report = json.loads(cap.out)
    assert rc == 2
    assert [c["key"] for c in report["corrupt"]] == [victim[len(url) + 1:]], report["corrupt"]
    assert "corrupt entries" in cap.err and len(cap.err.strip().splitlines()) == 1


def test_verify_json_prints_the_report_when_it_finds_damage(model, make_cache, run, prompt, tmp_path, capsys,
                                                            store_files):
    url = str(tmp_path / "store")
    pc = make_cache(model, store_url=url)
    run(model, pc, prompt(40))
    pc.flush()
    victim = store_files(url, "swa")[0]
    raw = bytearray(open(victim, "rb").read())
    raw[-3] ^= 0xFF
    open(victim, "wb").write(bytes(raw))
    assert cli.main(["cache", url, "--verify", "--json"]) == 2
    cap = capsys.readouterr()
    r = json.loads(cap.out)
    assert r["corrupt"] == [dict(key=victim[len(url) + 1:], why="checksum mismatch")]
    assert cap.err.startswith("kvjax: error: 1 corrupt entries")
    out = tmp_path / "report.json"
    assert cli.main(["cache", url, "--verify", "--json", str(out)]) == 2
    assert json.loads(out.read_text())["corrupt"] == r["corrupt"]


@pytest.mark.parametrize("bad", ["dtype", "shape"])
def test_host_copy_that_fails_byte_checks_is_dropped_and_recomputed(model, make_cache, run, cold, prompt, bad,
                                                                    pins):
    pc = make_cache(model, host_bytes=1 << 20)
    p = prompt(100)
    run(model, pc, p)
    for spec in pc.forms.specs:
        pc.evict(spec.name, "device", 1000)  # demoted to the host tier
    pc.flush()
    (_, tree), = pc.trees.values()
    blk = sorted(tree.iter_blocks(), key=lambda b: b.index)[2]
    e = blk.path["dense"]
    x = np.asarray(e.host)
    x = x.astype(np.float16) if bad == "dtype" else x[..., :-1]
    e.host = jax.device_put(x, host_sharding())  # a bad copy, as a buggy transfer would leave it
    got, plan = run(model, pc, p)
    np.testing.assert_allclose(got, cold(model, p), atol=2e-5, rtol=0)
    assert plan.boundary <= 32 and pins(pc) == 0
    assert pc.stats()["misses"]["capacity"]["corrupt"] > 0
