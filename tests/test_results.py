"""docs/results/ and README "Results" stay what `scripts/regenerate_results.py` says they are: every registered result
exists, every file belongs to one, the README tables equal what `--tables` renders now, and every registered command
parses with its script's own argument parser (nothing is run)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import sys
from unittest import mock

import pytest
from builders import REPO

SCRIPTS = os.path.join(REPO, "scripts")
sys.path.insert(0, SCRIPTS)

import regenerate_results as rr  # noqa: E402
import results_tables as rt  # noqa: E402

NAME = re.compile(r"[a-z0-9_]+?_(" + "|".join(rr.MODELS) + r")(_[a-z0-9_]+)?")
SCRIPT_RESULTS = [r for r in rr.RESULTS if not r.is_pytest]


def _ids(r):
    return r.name


@pytest.mark.parametrize("res", [r for r in rr.RESULTS if not r.pending], ids=_ids)
def test_every_measured_result_has_its_files(res):
    assert os.path.exists(os.path.join(REPO, res.path)), f"{res.name}: {res.path} is missing (or mark it pending)"
    if res.png:
        assert os.path.exists(os.path.join(REPO, res.path[:-5] + ".png")), f"{res.name}: its .png is missing"


def test_names_follow_the_rule_and_are_unique():
    names = [r.name for r in rr.RESULTS]
    assert len(names) == len(set(names))
    bad = [n for n in names if not NAME.fullmatch(n) or re.search(r"_(v\d+[a-z]?|new|old)(_|$)", n)]
    assert not bad, f"names must be <benchmark>_<smollm2|tiny|random>[_<setting>], no _vN/_new: {bad}"
    assert all(r.table in rt.RENDER for r in rr.RESULTS), "every table needs a render function"


def test_results_name_no_path_of_the_machine_that_made_them():
    """Committed results record file names, never an absolute path (a home directory, a temporary folder)."""
    absolute = re.compile(r'"(/(root|home|tmp|work|Users|var|private)/[^"]*)"')
    for name in sorted(os.listdir(os.path.join(REPO, rr.RESULTS_DIR))):
        if name.endswith(".json"):
            with open(os.path.join(os.path.join(REPO, rr.RESULTS_DIR), name), encoding="utf-8") as f:
                found = absolute.search(f.read())
            assert found is None, f"{name}: {found.group(1)}"


def test_every_file_in_docs_results_belongs_to_a_registered_result():
    owned = {f"{r.name}.json" for r in rr.RESULTS} | {f"{r.name}.png" for r in rr.RESULTS if r.png}
    files = sorted(os.listdir(os.path.join(REPO, rr.RESULTS_DIR)))
    orphans = [f for f in files if f not in owned]
    assert not orphans, f"docs/results/ files no registry entry writes (add one, or git rm them): {orphans}"


def test_readme_tables_equal_what_tables_renders_now():
    with open(os.path.join(REPO, rr.README), encoding="utf-8") as f:
        text = f.read()
    rendered = rt.render_readme(text, rr.RESULTS, REPO)
    stale = [k for k, v in rt.blocks_in(rendered).items() if rt.blocks_in(text)[k] != v]
    assert not stale, f"README tables out of date: run `python scripts/regenerate_results.py --tables` ({stale})"
    assert {r.table for r in rr.RESULTS} <= set(rt.blocks_in(text)) <= set(rt.RENDER)


class _Parsed(Exception):
    pass


_MODULES: dict = {}


def _parse(script: str, args: list[str]) -> argparse.Namespace:
    """The namespace the script's own `main` parses `args` into; `main` is stopped right after parsing."""
    if script not in _MODULES:
        spec = importlib.util.spec_from_file_location(os.path.basename(script)[:-3], os.path.join(REPO, script))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MODULES[script] = mod
    real = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, argv=None, namespace=None):
        raise _Parsed(real(self, argv, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_and_stop), \
            mock.patch.object(sys, "argv", [script, *args]):
        try:
            _MODULES[script].main()
        except _Parsed as done:
            return done.args[0]
        except SystemExit as e:
            raise AssertionError(f"{script} rejects {args}: exit {e.code}") from None
    raise AssertionError(f"{script}: main() returned without parsing its arguments")


@pytest.mark.parametrize("res", SCRIPT_RESULTS, ids=_ids)
def test_every_registered_command_parses_with_its_script(res):
    argv = res.argv()
    assert argv[:2] == ["python", res.script] and os.path.exists(os.path.join(REPO, res.script))
    ns = _parse(res.script, argv[2:])
    assert getattr(ns, "json", None) == res.path, f"{res.name}: the command must write {res.path}"


@pytest.mark.parametrize("res", [r for r in rr.RESULTS if r.is_pytest], ids=_ids)
def test_pytest_measured_results_name_their_test_and_output(res):
    assert os.path.exists(os.path.join(REPO, res.script))
    env = dict(res.env)
    assert env and any(v in (res.path, rr.RESULTS_DIR) for v in env.values())


def _recorded_command(doc) -> str | None:
    return rt._find(doc, ("command",))


@pytest.mark.parametrize("res", [r for r in SCRIPT_RESULTS if os.path.exists(os.path.join(REPO, r.path))], ids=_ids)
def test_a_recorded_command_is_the_registered_one(res):
    """Where a file records the command that wrote it (scripts that call `run_meta`), the registry's command
    parses to the same arguments (output paths and external files aside): a regenerated file measures the same."""
    with open(os.path.join(REPO, res.path), encoding="utf-8") as f:
        recorded = _recorded_command(json.load(f))
    if recorded is None:
        return  # older files do not record their command; the README and the registry carry it
    words = shlex.split(recorded)
    while words and ("=" in words[0] or words[0].startswith("python")):
        words.pop(0)
    assert words and words[0] == res.script, f"{res.name} was written by {recorded!r}"
    ignore = {"json", "plot", *rr.EXTERNAL}
    got, want = vars(_parse(res.script, words[1:])), vars(_parse(res.script, res.argv()[2:]))
    assert {k: v for k, v in got.items() if k not in ignore} == {k: v for k, v in want.items() if k not in ignore}, \
        f"{res.name}: the file was written by {recorded!r}, the registry says {res.command()!r}"


def test_pending_results_render_as_not_yet_measured(tmp_path):
    res = rr.Result("vericache_smollm2_64k", "vericache", "SmolLM2, 64K", "scripts/bench_vericache.py", (), 1,
                    pending=True)
    block = rt.render_block("vericache", [res], str(tmp_path))
    assert rt.PENDING in block and "--only vericache_smollm2_64k" in block


def test_renderers_read_the_schemas_of_results_still_to_come(tmp_path):
    """bench_attention_peers writes a list of per-shape records; bench_short_verify's step timings are a flat
    {'<impl> decode step' | '<impl> verify x=N': ms} mapping, wherever the file puts it."""
    os.makedirs(tmp_path / rr.RESULTS_DIR)
    peers = rr.Result("attention_peers_tiny", "attention_peers", "tiny", "scripts/bench_attention_peers.py", (), 1)
    (tmp_path / peers.path).write_text(json.dumps([dict(slots=9216, rows=5, native_ms=1.5, xla_ms=3.0,
                                                        torch_sdpa_ms=2.0, native_over_xla=0.5)]))
    assert "| tiny | 9,216 | 5 | 1.5 | 3 | 2 | 0.50x |" in rt.render_block("attention_peers", [peers], str(tmp_path))
    sv = rr.Result("short_verify_tiny_32k", "short_verify", "tiny, 32K", "scripts/bench_short_verify.py", (), 1)
    (tmp_path / sv.path).write_text(json.dumps(dict(meta={}, steps={"native decode step": 10.0,
                                                                    "native verify x=8": 26.0})))
    assert "x = 8: 26 = 2.6" in rt.render_block("short_verify", [sv], str(tmp_path))
    # the records bench_short_verify writes now: best against best, and the median of the rounds' own ratios
    (tmp_path / sv.path).write_text(json.dumps(dict(steps={
        "native decode step": dict(ms=10.0, runs_ms=[10.0, 12.0]),
        "native verify x=8": dict(ms=16.0, runs_ms=[16.0, 30.0], decode_steps=1.6, decode_steps_median=2.04)})))
    assert "| 10 | x = 8: 16 = 1.6 (median of rounds 2.0) |" in rt.render_block("short_verify", [sv], str(tmp_path))
    # ... with the verify's arithmetic floor (its multiply-adds at the machine's rate), and two draft lengths
    (tmp_path / sv.path).write_text(json.dumps(dict(steps={
        "native decode step": dict(ms=10.0, runs_ms=[10.0]),
        "native verify x=8": dict(ms=16.0, runs_ms=[16.0], decode_steps=1.6, decode_steps_median=1.6,
                                  multiply_add_floor=dict(ms=8.0, decode_steps=0.8)),
        "native verify x=32": dict(ms=50.0, runs_ms=[50.0], decode_steps=5.0, decode_steps_median=5.0)})))
    assert ("| 10 | x = 8: 16 = 1.6 (median of rounds 1.6); multiply-add floor 8 = 0.8, measured 2.0x it · "
            "x = 32: 50 = 5.0 (median of rounds 5.0) |") in rt.render_block("short_verify", [sv], str(tmp_path))


def test_machine_line_prefers_what_the_files_record():
    doc = dict(config=dict(cpu_model="AMD EPYC 9654", l3_cache="32 MiB (1 instance)", cpus=2))
    assert rt.machine_line([doc]) == "Machine: AMD EPYC 9654, 2 cores, 32 MiB (1 instance) L3."
    peers = dict(meta=dict(cpu="AMD EPYC 9654"), records=[])  # bench_attention_peers records `cpu`
    assert rt.machine_line([doc, peers]) == "Machine: AMD EPYC 9654, 2 cores, 32 MiB (1 instance) L3; AMD EPYC 9654."
    assert rt.DEFAULT_MACHINE in rt.machine_line([dict(records=[])])
    # columns from two machines: which ran where
    xeon = dict(config=dict(cpu_model="Xeon", cpus=2))
    assert rt.machine_line([doc, xeon, doc], ["a", "b", "c"]) == \
        "Machine: AMD EPYC 9654, 2 cores, 32 MiB (1 instance) L3 ('a', 'c'); Xeon, 2 cores ('b')."
    assert rt.machine_line([doc, doc], ["a", "c"]) == "Machine: AMD EPYC 9654, 2 cores, 32 MiB (1 instance) L3."


def test_scheduler_drafter_cell_names_its_fields():
    assert rt._drafter_fields(dict(ratio=8.0)) == ", 8x smaller"
    assert rt._drafter_fields(dict(max_kept=2048, draft_dtype="int8", draft_weights="int8")) == \
        ", <= 2,048 kept, int8 cache and weights"
    assert rt._drafter_fields(dict(draft_dtype="bfloat16", draft_weights="int8")) == ", bfloat16 cache, int8 weights"
    assert rt._drafter_fields(None) == ""


def test_cli_lists_dry_runs_and_rejects_unknown_names(capsys):
    assert rr.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(r.name in listed for r in rr.RESULTS)
    assert rr.main(["--dry-run", "--only", "prefill_tiny,roofline_tiny_8k"]) == 0
    out = capsys.readouterr().out
    assert "scripts/bench_prefill.py" in out and "--llama-bench PATH" in out
    with pytest.raises(SystemExit, match="unknown result"):
        rr.main(["--only", "vericache_8k_v4"])


def test_a_batch_stops_at_the_first_failure_and_names_it(capsys):
    fails = rr.Result("x_tiny_a", "prefill", "a", "scripts/regenerate_results.py", ("--only", "no_such_result"), 0)
    never = rr.Result("x_tiny_b", "prefill", "b", "scripts/regenerate_results.py", ("--list",), 0)
    assert rr.run([fails, never], {}, dry_run=False) != 0
    captured = capsys.readouterr()
    assert "x_tiny_a failed" in captured.err and "[x_tiny_b]" not in captured.out


def test_a_result_needing_an_external_file_says_which_option(capsys):
    needs = [r for r in rr.RESULTS if r.needs][0]
    assert rr.run([needs], {}, dry_run=False) == 2
    assert "--llama-bench PATH" in capsys.readouterr().err


def test_a_file_a_renderer_cannot_read_fails_loudly(tmp_path):
    os.makedirs(tmp_path / rr.RESULTS_DIR)
    sv = rr.Result("short_verify_tiny_32k", "short_verify", "tiny, 32K", "scripts/bench_short_verify.py", (), 1)
    (tmp_path / sv.path).write_text(json.dumps(dict(records=[dict(impl="native", ms=1.0)])))
    with pytest.raises(ValueError, match="short_verify_tiny_32k.json"):
        rt.render_block("short_verify", [sv], str(tmp_path))
