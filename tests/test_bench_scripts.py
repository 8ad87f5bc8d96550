"""The many-request benchmark runs end to end at a tiny size (a name clash once made it fail before its first
timing, and nothing ran it)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
