"""scripts/device_check.sh: the script parses, and every command line of its CPU smoke mode is accepted by the
benchmark it calls (the full smoke run is the slow test)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "device_check.sh")


def test_device_check_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


@pytest.mark.parametrize("script", ["bench_roofline.py", "bench_kernels.py"])
def test_benchmarks_it_calls_have_a_cli(script):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), "--help"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    assert "--json" in out


def test_bench_roofline_refuses_bad_flags():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_roofline.py"), "--compressors", "zip"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "unknown zip" in r.stderr


@pytest.mark.slow
def test_cpu_smoke_runs_every_step(tmp_path):
    r = subprocess.run(["bash", SCRIPT, "--cpu-smoke", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "roofline.json").exists() and (tmp_path / "bench_kernels.json").exists()
