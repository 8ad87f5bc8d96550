"""`kvjax generate` honours every flag or refuses it in one line (issue [api-keeps-its-word]): VeriCache logprobs,
flags that another flag makes meaningless, no exactness check for rejection sampling, speed ratios only between
compiled runs, one stdout format per invocation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from builders import BUNDLED, cli_error

import kvjax
from kvjax import cli
from kvjax.cli import generate

@pytest.mark.parametrize("argv,needle", [
    (["--prompt", ""], "--prompt is empty"),
    (["--long-prompt", "0"], "--long-prompt must be >= 1 tokens, got 0"),
    (["--prompt-file", "x.txt", "--prompt-index", "3"], "--prompt-index picks the held-out text of --long-prompt"),
    (["--prompt", "x", "--prompt-index", "1"], "it means nothing with --prompt"),
    (["--long-prompt", "100", "--chat"], "--chat wraps text in the chat template; --long-prompt is raw"),
    (["--prompt", "x", "--mode", "vericache", "--temperature", "0.9", "--rejection", "--compare-full"],
     "--compare-full checks token-for-token exactness, which --rejection does not promise"),
])
def test_meaningless_flags_are_refused_by_name(capsys, argv, needle):
    assert cli.main(["generate", "--model", "/no/such/model", *argv]) == 2
    assert needle in cli_error(capsys)


def test_vericache_logprobs_reach_the_json(capsys):
    assert cli.main(["generate", "--model", BUNDLED, "--prompt", "def f(", "--mode", "vericache", "--draft-len", "4",
                     "--new-tokens", "6", "--ignore-eos", "--logprobs", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    model = kvjax.load(BUNDLED)
    full = kvjax.generate(model, model.tokenizer.encode("def f("), 6, ignore_eos=True, logprobs=True)
    assert res["tokens"] == full.tolist() and len(res["logprobs"]) == 6
    np.testing.assert_allclose(res["logprobs"], full.logprobs, atol=1e-4)


def test_no_warmup_compare_full_times_only_compiled_rounds(capsys):
    # x = 5 is a draft length no other test compiles: its first round here compiles
    assert cli.main(["generate", "--model", BUNDLED, "--prompt", "import os\n", "--mode", "vericache",
                     "--draft-len", "5", "--new-tokens", "20", "--ignore-eos", "--no-warmup", "--compare-full",
                     "--json"]) == 0
    cap = capsys.readouterr()
    res = json.loads(cap.out)
    assert res["identical_to_full_cache"] is True and res["compile_rounds"] >= 1
    assert res["timed_rounds"] + res["compile_rounds"] == res["verifications"]
    summary = [x for x in cap.err.splitlines() if x.startswith("summary:")][0]
    # the speedup is the ratio of the medians of alternated timings: TIMING_RUNS full-cache runs (compiled first) and
    # as many VeriCache runs, the first being the one above, which counts among them only when it had rounds to time
    times, n = res["timing_runs"], generate.TIMING_RUNS
    assert n >= 3 and len(times["full_cache_tokens_per_s"]) == n
    assert len(times["vericache_tokens_per_s"]) == (n if res["tokens_per_s"] is not None else n - 1)
    want = np.median(times["vericache_tokens_per_s"]) / np.median(times["full_cache_tokens_per_s"])
    assert abs(res["speedup_vs_full"] - want) < 2e-3 * want
    assert f"speedup_vs_full={res['speedup_vs_full']:.2f}x" in summary


def test_compare_full_prefills_once(monkeypatch, capsys):
    """--compare-full checks and times from the run's own prefilled state (no prefix cache here): one prefill in all,
    still identical to the reference."""
    from kvjax.decode import steps

    calls = []
    prefill = steps.prefill
    monkeypatch.setattr(steps, "prefill", lambda *a, **k: calls.append(1) or prefill(*a, **k))
    assert cli.main(["generate", "--model", BUNDLED, "--prompt", "import sys\n", "--mode", "vericache",
                     "--draft-len", "4", "--new-tokens", "12", "--ignore-eos", "--compare-full", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["identical_to_full_cache"] is True
    assert len(res["timing_runs"]["full_cache_tokens_per_s"]) == generate.TIMING_RUNS
    assert len(calls) == 1


def test_batch_stdout_is_jsonl_only_with_prompt_tokens(tmp_path, capsys):
    pf = tmp_path / "batch.jsonl"
    pf.write_text(json.dumps({"prompt": "def f("}) + "\n" + json.dumps({"token_ids": [5, 6, 7]}) + "\n")
    assert cli.main(["generate", "--model", BUNDLED, "--prompts-file", str(pf), "--new-tokens", "4", "--ignore-eos",
                     "--mode", "vericache", "--draft-len", "4", "--logprobs", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [json.loads(x) for x in lines]  # every line is one JSON row: no pretty-printed object after them
    assert len(rows) == 2 and [r["prompt_tokens"] for r in rows][1] == 3
    assert all(len(r["logprobs"]) == 4 for r in rows)
