import pytest
"""The many-request benchmark runs end to end at a tiny size (a name clash once made it fail before its first
timing, and nothing ran it)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # ~33 s end to end; the schedulers' exactness stays in CI through tests/scheduling/test_scheduler.py
def test_bench_scheduler_runs_and_every_contender_is_exact(tmp_path):
    out = tmp_path / "sched.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_scheduler.py"), "--random",
                        "--requests", "2", "--context", "512", "--new-tokens", "8", "--draft-len", "2",
                        "--repeats", "1", "--compressor", "refresh", "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    assert [x["name"] for x in records] == ["full", "vericache-lockstep", "vericache-staggered"]
    assert all(x["identical_fraction"] == 1.0 and x["within_budget"] for x in records)


def test_bench_exact_tasks_runs_and_vericache_answers_as_full_cache(tmp_path):
    """One tiny task on the bundled checkpoint: every contender reported, VeriCache identical to the reference
    (the script itself stops with an error otherwise), and `kvjax plot` draws the result."""
    out = tmp_path / "exact.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_exact_tasks.py"), "--context", "384",
                        "--tasks", "1", "--new-tokens", "6", "--draft-len", "2", "--compressors", "streaming",
                        "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    records = {x["name"]: x for x in doc["records"]}
    assert sorted(records) == ["full", "lossy[streaming]", "reference", "vc[streaming]"]
    assert records["vc[streaming]"]["identical_fraction"] == 1.0
    assert records["vc[streaming]"]["accuracy"] == records["reference"]["accuracy"]
    task = doc["tasks"][0]
    assert task["prompt_tokens"] == 384 - 6 - 2 - 2 and set(task["continuations"]) == set(records)
    png = tmp_path / "exact.png"
    from kvjax import plots

    assert plots.plot_files([str(out)], str(png))[0] == "accuracy" and png.stat().st_size > 0
