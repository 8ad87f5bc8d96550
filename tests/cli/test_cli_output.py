"""Output where the user is (issue [api-keeps-its-word]): `kvjax bench` writes to the working directory (or --out),
`kvjax plot` plots what every script writes, progress is a line per phase when stderr is not a terminal, and an
adaptive run warms up only the draft lengths it can use."""

from __future__ import annotations

import glob
import json
import os

import pytest
from builders import BUNDLED, REPO

from kvjax import cli, plots
from kvjax.cli import bench

def test_bench_outputs_resolve_from_the_working_directory(tmp_path, capsys):
    script = os.path.join(REPO, "scripts", "bench_vericache.py")
    assert bench._outputs_here([], str(tmp_path), "bench_vericache.json", script) == [
        "--json", str(tmp_path / "bench_vericache.json")]  # not the repository root
    argv = bench._outputs_here(["--json", "r.json", "--plot=p.png", "--checkpoint", "checkpoints/x"], str(tmp_path),
                               "bench_vericache.json", script)
    assert argv == ["--json", str(tmp_path / "r.json"), f"--plot={tmp_path / 'p.png'}", "--checkpoint",
                    "checkpoints/x"]  # model paths still resolve from the repository, where the script runs
    assert cli.main(["bench", "vericache", "--out", str(tmp_path / "missing")]) == 2
    assert "folder does not exist" in capsys.readouterr().err


# one results file per script that writes them, and the plot each gets
EXPECTED = {"roofline": "roofline", "prefill": "throughput", "fused_loops": "throughput",
            "remote_prefix": "throughput", "scheduler": "memory", "vericache": "accepted", "prefix_cache": "prefix",
            "parity": "bars"}


@pytest.mark.parametrize("stem", sorted(EXPECTED))
def test_every_results_json_plots(stem, tmp_path):
    path = sorted(glob.glob(os.path.join(REPO, "docs", "results", f"{stem}*.json")))[0]
    out = tmp_path / "p.png"
    kind, _ = plots.plot_files([path], str(out))
    assert kind == EXPECTED[stem] and out.stat().st_size > 1000


def test_phase_lines_without_a_terminal_and_usable_draft_lengths(capsys):
    # capsys: stderr is not a terminal, as in a log file or CI
    assert cli.main(["generate", "--model", BUNDLED, "--prompt", "def f(", "--mode", "vericache", "--new-tokens", "6",
                     "--ignore-eos", "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["draft_length_set"] == [2, 4]  # 6 tokens: x = 8 .. 32 could never be used
    err = cap.err.splitlines()
    for phase in ("prefill", "warm-up (compile x=[2, 4])", "decode"):
        assert f"{phase} ..." in err and any(line.startswith(f"{phase}: done") for line in err), (phase, err)
