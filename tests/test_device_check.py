"""scripts/device_check.sh: the script parses, and every command line of its CPU smoke mode is accepted by the
benchmark it calls (the full smoke run is the slow test)."""

import os
import runpy
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "device_check.sh")


def test_device_check_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def _main(script, argv, monkeypatch, capsys):
    """(exit code, captured output) of `python scripts/<script> <argv>`, run in this process: the script's `main`
    on the same argument parser (a subprocess per script imported JAX and the library again, ~5 s each)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))  # the scripts import their neighbours
    main = runpy.run_path(os.path.join(ROOT, "scripts", script))["main"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code, capsys.readouterr()


@pytest.mark.parametrize("script", ["bench_roofline.py", "bench_kernels.py"])
def test_benchmarks_it_calls_have_a_cli(script, monkeypatch, capsys):
    code, out = _main(script, ["--help"], monkeypatch, capsys)
    assert code == 0 and "--json" in out.out


def test_bench_roofline_refuses_bad_flags(monkeypatch, capsys):
    code, out = _main("bench_roofline.py", ["--compressors", "zip"], monkeypatch, capsys)
    assert code not in (0, None) and "unknown zip" in out.err
    code, out = _main("bench_roofline.py", ["--compressors", "zip:ratio=8"], monkeypatch, capsys)
    assert code not in (0, None) and "unknown zip" in out.err
    # a drafter with fields (the default drafter's, say) is taken; a field without a value is refused by name
    code, _ = _main("bench_roofline.py", ["--compressors", "refresh:draft_weights=int8,refresh:ratio"], monkeypatch,
                    capsys)
    assert "'ratio' in 'refresh:ratio' is not field=value" in str(code)


@pytest.mark.slow
def test_cpu_smoke_runs_every_step(tmp_path):
    r = subprocess.run(["bash", SCRIPT, "--cpu-smoke", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "roofline.json").exists() and (tmp_path / "bench_kernels.json").exists()
