"""`kvjax plot`: the JSON's content picks the plot; each kind writes a non-blank PNG; bad input is one error line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax import cli, plots


def _vericache_doc(context: int, scale: float = 1.0) -> dict:
    """Shaped like scripts/bench_vericache.py's output."""
    recs = [dict(name="full", tokens_per_s=100.0 * scale, accepted_histogram=None),
            dict(name="vc[streaming]", tokens_per_s=180.0 * scale, mean_accepted_per_round=9.5, mean_x=16.0,
                 accepted_histogram=[3, 1, 0, 2, 1, 0, 0, 1, 2, 0, 3, 1, 2, 4, 2, 5, 20]),
            dict(name="vc[kivi4]", tokens_per_s=150.0 * scale, mean_accepted_per_round=14.1, mean_x=16.0,
                 accepted_histogram=[0] * 14 + [1, 2, 30])]
    return dict(config=dict(context=context, prompt_tokens=context - 300, new_tokens=256), records=recs)


def _scheduler_doc() -> dict:
    """Shaped like scripts/bench_scheduler.py's output: timeline rows (s, bytes, reserved, tokens)."""
    def tl(rate, mem):
        t = np.linspace(0, 10, 50)
        return [[float(a), int(mem * (1 + 0.1 * np.sin(a))), int(mem), int(rate * a)] for a in t]

    return dict(config=dict(context=16384), records=[
        dict(name="full", tokens_per_s=40.0, budget_bytes=300 << 20, timeline=tl(40, 280 << 20)),
        dict(name="vericache-staggered", tokens_per_s=90.0, budget_bytes=300 << 20, timeline=tl(90, 200 << 20))])


def _write(tmp_path, name, doc):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return str(p)


def _assert_png(path):
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.shape[0] > 300 and img.shape[1] > 500
    assert img[..., :3].std() > 0.05  # something was drawn


def test_content_picks_the_plot(tmp_path):
    one = _write(tmp_path, "vc8k.json", _vericache_doc(8192))
    two = _write(tmp_path, "vc32k.json", _vericache_doc(32768, 0.5))
    sch = _write(tmp_path, "sched.json", _scheduler_doc())
    kern = _write(tmp_path, "kern.json", dict(records=[
        dict(kernel="attend", implementation="xla", cached_tokens=s, gbps=g) for s, g in ((8192, 5.0), (32768, 7.0))]))
    gen = _write(tmp_path, "gen.json", dict(mode="vericache", prompt_tokens=1000, tokens_per_s=50.0,
                                            mean_accepted_per_round=3.0, accepted_histogram=[1, 2, 3]))
    pref = _write(tmp_path, "prefix.json", [  # a bare list, as scripts/bench_prefix_cache.py writes it
        dict(kind="lookup", prefix_tokens=1024, lookup_ms=0.2, lookup_ms_p90=0.3),
        dict(kind="lookup", prefix_tokens=16384, lookup_ms=0.9, lookup_ms_p90=1.5),
        dict(kind="restore", prefix_tokens=2048, tier="host", restore_ms=9.0, recompute_ms=4400.0,
             speedup_vs_recompute=489.0)])
    cases = {(pref,): "prefix", (one,): "accepted", (one, two): "throughput", (sch,): "memory", (kern,): "throughput", (gen,): "accepted"}
    for paths, kind in cases.items():
        assert plots.detect(plots.load(paths)) == kind, paths
    series, unit = plots.throughput_series(plots.load((one, two)))
    assert unit == "tokens/s" and series["vc[streaming]"] == [(7892, 180.0), (32468, 90.0)]
    for paths, kind in cases.items():
        out = str(tmp_path / f"{kind}-{len(paths)}.png")
        assert plots.plot_files(paths, out)[0] == kind
        _assert_png(out)


def test_cli_plot_json_and_errors(tmp_path, capsys):
    sch = _write(tmp_path, "sched.json", _scheduler_doc())
    out = str(tmp_path / "m.png")
    assert cli.main(["plot", sch, "-o", out, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["kind"] == "memory" and res["runs"] == 2 and res["output"] == out
    _assert_png(out)
    bad = _write(tmp_path, "empty.json", dict(records=[dict(name="x")]))
    assert cli.main(["plot", bad, "-o", str(tmp_path / "e.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvjax: error: no plottable data")
    assert cli.main(["plot", sch, "-o", str(tmp_path / "a.png"), "--kind", "accepted"]) == 2
    assert "no accepted_histogram" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["{not json", ""])
def test_cli_plot_unreadable(tmp_path, capsys, text):
    p = tmp_path / "bad.json"
    p.write_text(text)
    assert cli.main(["plot", str(p), "-o", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.startswith("kvjax: error: ")
