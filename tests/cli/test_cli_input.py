"""`kvjax generate` as a user meets it: checked flags (one-line errors, before any work), EOS / stop handled as the
API does, JSONL batches, streamed text on stdout only, --version, help for every flag, no tracebacks on pipes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from builders import BUNDLED, REPO, cli_error

import kvjax
from kvjax import cli

@pytest.mark.parametrize("argv,needle", [
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--tp", "-1"], "--tp must be >= 1, got -1"),
    (["--dp", "0"], "--dp must be >= 1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--mode", "vericache", "--draft-len", "100000"], "--draft-len must be in [1, 256]"),
    (["--compressor", "kvzip"], "--compressor means nothing with --mode full"),
    (["--draft-len", "4"], "--draft-len means nothing with --mode full"),
    (["--offload"], "--offload means nothing with --mode full"),
    (["--compare-full"], "--compare-full means nothing with --mode full"),
    (["--prompt-file", "x.txt"], "give exactly one of --prompt, --prompt-file"),
    (["--mode", "vericache", "--offload", "--tp", "2"], "--offload cannot be combined with --tp/--dp"),
    (["--json", "/nonexistent/dir/out.json"], "--json /nonexistent/dir/out.json: folder /nonexistent/dir does not"),
    (["--mode", "vericache", "--rejection"], "--rejection needs --temperature > 0"),
])
def test_bad_flags_fail_in_one_line_before_any_work(capsys, argv, needle):
    assert cli.main(["generate", "--model", "/no/such/model", "--prompt", "x", *argv]) == 2
    assert needle in cli_error(capsys)  # checked before the (missing) model is even looked at


def test_files_at_fault_are_named(tmp_path, capsys):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"def f():\n\xff\xfe\n")
    assert cli.main(["generate", "--model", BUNDLED, "--prompt-file", str(bad)]) == 2
    assert f"--prompt-file {bad}: not UTF-8 text" in cli_error(capsys)
    d = tmp_path / "model"
    shutil.copytree(BUNDLED, d, ignore=shutil.ignore_patterns("orbax", "train_state"))
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])  # truncated
    assert cli.main(["generate", "--model", str(d), "--prompt", "x"]) == 2
    assert f"{st}: not a readable safetensors file" in cli_error(capsys)


def test_eos_and_stop_as_the_api(capsys):
    model = kvjax.load(BUNDLED)
    prompt = "def parse(text):\n"
    ids = model.tokenizer.encode(prompt)
    for extra, kw in [([], {}), (["--stop-id", "0", "--ignore-eos"], dict(stop=[0], ignore_eos=True)),
                      (["--stop", "self"], dict(stop=["self"]))]:
        assert cli.main(["generate", "--model", BUNDLED, "--prompt", prompt, "--new-tokens", "48", "--json",
                         *extra]) == 0
        res = json.loads(capsys.readouterr().out)
        want = kvjax.generate(model, ids, 48, **kw)
        assert res["tokens"] == want.tolist() and res["finish_reason"] == want.finish_reason
        assert res["text"] == want.text


def test_streamed_stdout_is_exactly_the_text(capsys):
    for mode in (["--mode", "full"], ["--mode", "vericache", "--draft-len", "4"]):
        assert cli.main(["generate", "--model", BUNDLED, "--prompt", "class A:\n", "--new-tokens", "30",
                         "--ignore-eos", *mode]) == 0
        cap = capsys.readouterr()
        model = kvjax.load(BUNDLED)
        want = kvjax.generate(model, model.tokenizer.encode("class A:\n"), 30, ignore_eos=True)
        assert cap.out == want.text + "\n"  # the first token too; no progress bar in stdout
        assert "summary:" in cap.err
        if "vericache" in mode:
            assert "warm-up (compile)" in cap.err


def test_prompts_file_writes_one_json_line_per_prompt(tmp_path, capsys):
    pf = tmp_path / "batch.jsonl"
    pf.write_text("\n".join([json.dumps({"prompt": "def f("}), json.dumps({"token_ids": [5, 6, 7]}),
                             json.dumps({"prompt": "import os\n"})]) + "\n")
    for mode in (["--mode", "full"], ["--mode", "vericache", "--draft-len", "4"]):
        assert cli.main(["generate", "--model", BUNDLED, "--prompts-file", str(pf), "--new-tokens", "8",
                         "--ignore-eos", *mode]) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        rows = [json.loads(x) for x in lines]
        assert [r["index"] for r in rows] == [0, 1, 2] and all(r["new_tokens"] == 8 for r in rows)
        model = kvjax.load(BUNDLED)
        np.testing.assert_array_equal(rows[1]["tokens"], kvjax.generate(model, [5, 6, 7], 8, ignore_eos=True))
    pf.write_text('{"text": "x"}\n')
    assert cli.main(["generate", "--model", BUNDLED, "--prompts-file", str(pf)]) == 2
    assert "line 1: expected an object with exactly one of" in cli_error(capsys)


def test_version_help_and_broken_pipes(capsys):
    with pytest.raises(SystemExit) as exit_:  # in-process: the pipe below is the one check that needs a process
        cli.main(["--version"])
    assert exit_.value.code in (0, None)
    first, cpu = capsys.readouterr().out.strip().splitlines()
    assert first == f"kvjax {kvjax.__version__}"
    assert cpu in ("CPU attention: native", ) or cpu.startswith("CPU attention: xla (native kernel unavailable: ")
    # `kvjax bench --list --json | head -1`: the reader goes away; no traceback
    p = subprocess.run(f"{sys.executable} -m kvjax.cli.main bench --list --json | head -1", shell=True,
                       capture_output=True, text=True, cwd=REPO)
    assert "Traceback" not in p.stderr and p.stdout.strip() == "{"
    parser = cli.main.__globals__["build_parser"]()
    gen = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("generate"))
    missing = [a.dest for a in gen._actions if a.dest != "help" and not a.help]
    assert not missing, f"flags without help: {missing}"
    suites = cli.main.__globals__["bench"].bench_suites()
    assert "common" not in suites  # the benchmarks' helper module is not a benchmark


def test_prefix_store_is_created_then_reused(tmp_path, capsys):
    store = tmp_path / "store"
    argv = ["generate", "--model", BUNDLED, "--long-prompt", "300", "--new-tokens", "6", "--prefix-store",
            str(store), "--json"]
    assert cli.main(argv) == 0
    cold = json.loads(capsys.readouterr().out)
    assert cold["prefix_hit_tokens"] == 0 and (store / "kvjax-prefix-store.json").exists()
    assert cli.main(argv) == 0  # a new PrefixCache over the same store: what the first run wrote is read back
    cap = capsys.readouterr()
    warm = json.loads(cap.out)
    assert warm["prefix_hit_tokens"] == 256 and warm["tokens"] == cold["tokens"]
    assert "prefix cache: Plan(restore 256 of 300 prompt tokens" in cap.err
    assert cli.main([*argv[:-1], "--mode", "vericache", "--draft-len", "4", "--compare-full", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["prefix_hit_tokens"] == 256 and res["identical_to_full_cache"] is True
    # a directory that is not a store is refused, one line
    other = tmp_path / "notastore"
    other.mkdir()
    (other / "weights.bin").write_bytes(b"x")
    assert cli.main([*argv[:-2], str(other)]) == 2
    assert "is not a kvjax prefix-cache store" in cli_error(capsys)


def test_a_plan_prints_a_summary_not_arrays():
    model = kvjax.load(BUNDLED)
    pc = kvjax.PrefixCache(kvjax.forms_for(model.config, "f32"))
    from kvjax.prefix.prefill import model_namespace

    plan = pc.lookup(model_namespace(model, pc), np.arange(100, dtype=np.int32))
    text = repr(plan)
    assert text.startswith("Plan(restore 0 of 100 prompt tokens") and "array" not in text and len(text) < 400
    plan.lease.release() if plan.lease is not None else None
