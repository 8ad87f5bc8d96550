"""scripts/bench_serve.py runs end to end at a tiny size: both modes, every request complete, a JSON and a plot."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


@pytest.mark.slow  # starts two server processes
def test_bench_serve_runs(tmp_path):
    pytest.importorskip("uvicorn")
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_serve.py"), "--prompt-len", "32",
                        "--max-tokens", "4", "--num-prompts", "3", "--rates", "4", "--concurrency", "2",
                        "--max-batch", "2", "--json", str(out), "--plot", str(png)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(x["mode"], x["kind"]) for x in rows} == {(m, k) for m in ("full", "vericache")
                                                      for k in ("rate", "concurrency")}
    assert all(x["completed"] == x["requests"] == 3 for x in rows)
    assert png.stat().st_size > 0
