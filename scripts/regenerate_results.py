"""Regenerate the benchmark results in docs/results/ and the README "Results" tables drawn from them.

One registry (`RESULTS`) names every current result: its file `docs/results/<name>.json` (+ `.png` when the script
draws one), the README table it appears in, the exact command that writes it, what that command needs from outside
the repository, and roughly how long it runs on the 2-core CPU the published files came from. Adding a result is one
line here (and, for a new table, one render function in `results_tables.py`). A new run of a command replaces its
file; history lives in git.

Usage:
    python scripts/regenerate_results.py --list                    # every result, its file and command
    python scripts/regenerate_results.py --only vericache_tiny_8k  # run these (comma-separated), in order
    python scripts/regenerate_results.py --all [--llama-bench PATH --gguf PATH]
    python scripts/regenerate_results.py --dry-run --all           # print the commands only
    python scripts/regenerate_results.py --tables                  # re-render README "Results" from the JSON files

Each run is a subprocess in the repository root; the first failure stops the batch and names the result. Benchmarks
compare their contenders side by side in one run: run them on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = "docs/results"
README = "README.md"

# Things a command needs from outside the repository: placeholder -> (this script's option, what to pass).
EXTERNAL = {
    "llama_bench": ("--llama-bench", "a llama.cpp `llama-bench` binary (README: how to build it, ~6 minutes)"),
    "gguf": ("--gguf", "SmolLM2-135M-Instruct.Q4_1.gguf as shipped (`kvjax models` shows where it is cached)"),
}
# the model names a result file may carry (COMMON naming rule: <benchmark>_<model>[_<setting>])
MODELS = {"smollm2": "SmolLM2-135M-Instruct", "tiny": "kvjax-code-tiny", "random": "random weights"}


@dataclasses.dataclass(frozen=True)
class Result:
    """One current result file and the command that writes it.

    Attributes:
        name: the file's stem under docs/results/ (`<benchmark>_<model>[_<setting>]`).
        table: the README block (`<!-- results:TABLE -->`) that shows it.
        label: its column (or row group) heading in that table.
        script: the script (or, for pytest-measured figures, the test file) that writes it.
        args: the script's exact arguments; `{llama_bench}`-style placeholders are filled from `EXTERNAL`.
        minutes: rough run time on the 2-core CPU (load excluded).
        env: environment variables the command sets (name, value).
        png: whether the command also writes `<name>.png`.
        pending: not measured yet (the file may be missing; tables say "not yet measured").
    """

    name: str
    table: str
    label: str
    script: str
    args: tuple[str, ...]
    minutes: float
    env: tuple[tuple[str, str], ...] = ()
    png: bool = False
    pending: bool = False

    @property
    def path(self) -> str:
        return f"{RESULTS_DIR}/{self.name}.json"

    @property
    def needs(self) -> tuple[str, ...]:
        return tuple(k for k in EXTERNAL if any("{" + k + "}" in a for a in self.args))

    @property
    def is_pytest(self) -> bool:
        return self.script.startswith("tests/")

    def argv(self, values: dict | None = None) -> list[str]:
        """The command as a list; placeholders take `values` (or their option's PATH when absent)."""
        fill = {k: (values or {}).get(k) or "PATH" for k in EXTERNAL}
        args = [a.format(**fill) for a in self.args]
        if self.is_pytest:
            return ["python", "-m", "pytest", "-q", self.script, *args]
        return ["python", self.script, *args]

    def command(self, values: dict | None = None) -> str:
        return " ".join([f"{k}={v}" for k, v in self.env] + [shlex.quote(a) for a in self.argv(values)])


def _vericache(name, label, args, minutes, pending=False):
    return Result(name, "vericache", label, "scripts/bench_vericache.py",
                  (*args, "--json", f"{RESULTS_DIR}/{name}.json"), minutes, png=True, pending=pending)


SMOLLM2 = ("--model", "smollm2-135m-instruct")
REAL_DRAFTERS = ("--compressors", "streaming,snapkv,kivi4,refresh,refresh_kivi4", "--offload", "none",
                 "--no-baselines")

RESULTS: tuple[Result, ...] = (
    Result("exact_tasks_smollm2", "exact_tasks", "SmolLM2, 4K", "scripts/bench_exact_tasks.py",
           (*SMOLLM2, "--context", "4096", "--tasks", "8", "--kinds", "value", "--depths", "0.1,0.3,0.5,0.7,0.9",
            "--new-tokens", "16", "--draft-len", "8", "--compressors", "streaming,snapkv,kivi2,kivi4,refresh",
            "--json", f"{RESULTS_DIR}/exact_tasks_smollm2.json"), 60, png=True),
    Result("parity_smollm2", "parity", "SmolLM2", "tests/formats/test_smollm2_parity.py", (), 5,
           env=(("KVJAX_RESULTS_DIR", RESULTS_DIR),)),
    Result("parity_random", "parity", "random", "tests/models/test_parity.py", ("-k", "prefill_logits"), 1,
           env=(("KVJAX_PARITY_JSON", f"{RESULTS_DIR}/parity_random.json"),)),
    Result("roofline_smollm2_4k", "roofline", "SmolLM2, 4K", "scripts/bench_roofline.py",
           (*SMOLLM2, "--context", "4096", "--compressors", "refresh", "--new-tokens", "32",
            "--llama-bench", "{llama_bench}", "--gguf", "{gguf}", "--json", f"{RESULTS_DIR}/roofline_smollm2_4k.json"),
           25, png=True),
    Result("roofline_smollm2_8k", "roofline", "SmolLM2, 8K", "scripts/bench_roofline.py",
           (*SMOLLM2, "--context", "8192", "--compressors", "refresh", "--new-tokens", "32",
            "--llama-bench", "{llama_bench}", "--gguf", "{gguf}", "--json", f"{RESULTS_DIR}/roofline_smollm2_8k.json"),
           25, png=True),
    Result("step_ops_smollm2_8k", "step_ops", "SmolLM2, 8K", "scripts/bench_step_ops.py",
           ("--model", "smollm2-135m-instruct", "--context", "8192", "--compressor",
            "refresh:draft_dtype=int8:max_kept=2048:draft_weights=int_dot", "--json",
            f"{RESULTS_DIR}/step_ops_smollm2_8k.json"), 3),
    Result("step_ops_tiny_32k", "step_ops", "tiny, 32K", "scripts/bench_step_ops.py",
           ("--context", "32768", "--compressor", "refresh:draft_dtype=bfloat16:draft_weights=int8:max_kept=2048",
            "--json", f"{RESULTS_DIR}/step_ops_tiny_32k.json"), 2),
    Result("roofline_tiny_8k", "roofline", "tiny, 8K", "scripts/bench_roofline.py",
           ("--context", "8192", "--llama-bench", "{llama_bench}", "--json", f"{RESULTS_DIR}/roofline_tiny_8k.json"),
           10, png=True),
    Result("roofline_tiny_32k", "roofline", "tiny, 32K", "scripts/bench_roofline.py",
           ("--context", "32768", "--compressors", "streaming,snapkv,refresh,kivi4,refresh_kivi4",
            "--llama-bench", "{llama_bench}", "--json", f"{RESULTS_DIR}/roofline_tiny_32k.json"), 15, png=True),
    _vericache("vericache_smollm2_2k", "SmolLM2, 2K", (*SMOLLM2, "--context", "2048", "--new-tokens", "32",
                                                      "--draft-len", "16", "--prompts", "8", *REAL_DRAFTERS), 12),
    _vericache("vericache_smollm2_4k", "SmolLM2, 4K", (*SMOLLM2, "--context", "4096", "--new-tokens", "32",
                                                      "--draft-len", "16", "--prompts", "8", *REAL_DRAFTERS), 12),
    _vericache("vericache_smollm2_8k", "SmolLM2, 8K", (*SMOLLM2, "--context", "8192", "--new-tokens", "64",
                                                      "--prompts", "8", *REAL_DRAFTERS[:-1], "--adaptive", "refresh"),
               45),
    _vericache("vericache_tiny_8k", "tiny, 8K",
               ("--context", "8192", "--new-tokens", "128", "--prompts", "8", "--compressors",
                "refresh_kivi2,refresh_kivi4,refresh,kivi4,snapkv,streaming", "--offload", "none",
                "--adaptive", "refresh_kivi2,refresh"), 25),
    _vericache("vericache_tiny_32k", "tiny, 32K",
               ("--context", "32768", "--new-tokens", "128", "--prompts", "4", "--compressors",
                "refresh,snapkv,streaming", "--offload", "none", "--adaptive", "refresh"), 40),
    _vericache("vericache_tiny_32k_refresh", "tiny, 32K, transposed-panel kernel",
               ("--context", "32768", "--new-tokens", "128", "--prompts", "2", "--compressors", "refresh",
                "--offload", "none", "--adaptive", "refresh"), 20),
    dataclasses.replace(
        _vericache("vericache_tiny_32k_draft_dtype", "tiny, 32K: ratio 4/8 x f32/bf16 draft cache",
                   ("--context", "32768", "--new-tokens", "128", "--prompts", "2", "--draft-len", "32,16",
                    "--compressors",
                    "refresh,refresh:draft_dtype=bfloat16,refresh:ratio=8,refresh:ratio=8:draft_dtype=bfloat16",
                    "--offload", "none", "--no-baselines", "--no-lossy"), 10), table="vericache_cheap_drafts"),
    dataclasses.replace(
        _vericache("vericache_tiny_32k_draft_weights", "tiny, 32K: + bf16 draft weights",
                   ("--context", "32768", "--new-tokens", "128", "--prompts", "2", "--draft-len", "16,32",
                    "--compressors", "refresh,refresh:ratio=8:draft_dtype=bfloat16,"
                    "refresh:ratio=8:draft_dtype=bfloat16:draft_weights=bfloat16",
                    "--offload", "none", "--no-baselines", "--no-lossy"), 10), table="vericache_cheap_drafts"),
    dataclasses.replace(
        _vericache("vericache_tiny_32k_default", "tiny, 32K, 8 prompts: the default drafter (2K kept, int8) and bf16's",
                   ("--context", "32768", "--new-tokens", "128", "--prompts", "8", "--draft-len", "8,16",
                    "--compressors", "refresh:draft_dtype=int8:draft_weights=int8:max_kept=2048,"
                    "refresh:draft_dtype=bfloat16:draft_weights=bfloat16:max_kept=2048",
                    "--adaptive", "refresh:draft_dtype=int8:draft_weights=int8:max_kept=2048",
                    "--offload", "none", "--no-baselines", "--no-lossy"), 12), table="vericache_cheap_drafts"),
    dataclasses.replace(
        _vericache("vericache_smollm2_8k_draft_bf16", "SmolLM2, 8K: bf16 draft cache and weights",
                   (*SMOLLM2, "--context", "8192", "--new-tokens", "64", "--prompts", "2", "--draft-len", "16,32",
                    "--compressors", "refresh,refresh:draft_dtype=bfloat16:draft_weights=bfloat16,"
                    "refresh:ratio=8:draft_dtype=bfloat16:draft_weights=bfloat16",
                    "--offload", "none", "--no-baselines", "--no-lossy"), 20), table="vericache_cheap_drafts"),
    _vericache("vericache_random_32k", "random, 32K",
               ("--random", "--context", "32768", "--new-tokens", "128", "--prompts", "1", "--compressors",
                "snapkv,streaming", "--offload", "none"), 15),
    dataclasses.replace(
        _vericache("vericache_tiny_8k_refresh_kivi4_ablation", "tiny, 8K",
                   ("--context", "8192", "--new-tokens", "128", "--prompts", "4", "--compressors",
                    "refresh_kivi4,refresh_kivi4:ratio=8.0,refresh_kivi4:block=32,refresh_kivi4:period=2",
                    "--offload", "none", "--no-baselines"), 15), table="vericache_ablation"),
    dataclasses.replace(
        _vericache("vericache_tiny_2k_50x256", "tiny, 2K",
                   ("--context", "2048", "--new-tokens", "256", "--prompts", "50", "--draft-len", "8",
                    "--compressors", "streaming,snapkv,kvzip,kivi4,kivi2,dropquant", "--offload", "none",
                    "--no-baselines"), 30), table="vericache_exactness"),
    Result("scheduler_smollm2_6x4k", "scheduler", "SmolLM2, 6 x 4K", "scripts/bench_scheduler.py",
           (*SMOLLM2, "--requests", "6", "--context", "4096", "--new-tokens", "64", "--compressor", "refresh",
            "--draft-len", "16", "--json", f"{RESULTS_DIR}/scheduler_smollm2_6x4k.json"), 15, png=True),
    Result("scheduler_smollm2_6x4k_default", "scheduler", "SmolLM2, 6 x 4K, the default drafter, x = 8, best of 2",
           "scripts/bench_scheduler.py",
           (*SMOLLM2, "--requests", "6", "--context", "4096", "--new-tokens", "64", "--compressor", "default",
            "--draft-len", "8", "--repeats", "2", "--json", f"{RESULTS_DIR}/scheduler_smollm2_6x4k_default.json"), 15,
           png=True),
    Result("scheduler_smollm2_8x8k_default", "scheduler", "SmolLM2, 8 x 8K, the default drafter, x = 8, best of 2",
           "scripts/bench_scheduler.py",
           (*SMOLLM2, "--requests", "8", "--context", "8192", "--new-tokens", "128", "--compressor", "default",
            "--draft-len", "8", "--repeats", "2", "--json", f"{RESULTS_DIR}/scheduler_smollm2_8x8k_default.json"), 20,
           png=True),
    Result("scheduler_tiny_8x16k", "scheduler", "tiny, 8 x 16K, x = 8", "scripts/bench_scheduler.py",
           ("--requests", "8", "--context", "16384", "--new-tokens", "128", "--compressor", "refresh",
            "--json", f"{RESULTS_DIR}/scheduler_tiny_8x16k.json"), 15, png=True),
    Result("scheduler_tiny_8x16k_x4", "scheduler", "tiny, 8 x 16K, x = 4", "scripts/bench_scheduler.py",
           ("--requests", "8", "--context", "16384", "--new-tokens", "128", "--compressor", "refresh",
            "--draft-len", "4", "--json", f"{RESULTS_DIR}/scheduler_tiny_8x16k_x4.json"), 15, png=True),
    Result("scheduler_tiny_8x16k_default", "scheduler", "tiny, 8 x 16K, the default drafter, x = 8, best of 3",
           "scripts/bench_scheduler.py",
           ("--requests", "8", "--context", "16384", "--new-tokens", "128", "--compressor", "default",
            "--draft-len", "8", "--repeats", "3", "--json", f"{RESULTS_DIR}/scheduler_tiny_8x16k_default.json"), 15,
           png=True),
    Result("prefill_tiny", "prefill", "tiny", "scripts/bench_prefill.py",
           ("--context", "8192,32768", "--reps", "2", "--json", f"{RESULTS_DIR}/prefill_tiny.json"), 10),
    Result("fused_loops_tiny", "fused_loops", "tiny", "scripts/bench_fused_loops.py",
           ("--context", "64,8192,32768", "--reps", "5", "--json", f"{RESULTS_DIR}/fused_loops_tiny.json"), 10),
    Result("prefix_cache_tiny", "prefix_cache", "tiny", "scripts/bench_prefix_cache.py",
           ("--model", "checkpoints/kvjax-code-tiny", "--json", f"{RESULTS_DIR}/prefix_cache_tiny.json"), 5),
    Result("remote_prefix_tiny_16k", "remote_prefix", "tiny, 16K", "scripts/bench_remote_prefix.py",
           ("--context", "16384", "--new-tokens", "256", "--link-gbps", "1", "--compressor", "kvzip",
            "--json", f"{RESULTS_DIR}/remote_prefix_tiny_16k.json"), 5),
    Result("attention_peers_tiny", "attention_peers", "tiny (8 heads, 4 KV, D = 32)",
           "scripts/bench_attention_peers.py",
           ("--rows", "1,5,9,17,33,256", "--slots", "9216,36864", "--reps", "3",
            "--json", f"{RESULTS_DIR}/attention_peers_tiny.json"), 5),
    Result("attention_peers_smollm2", "attention_peers", "SmolLM2 (9 heads, 3 KV, D = 64)",
           "scripts/bench_attention_peers.py",
           ("--heads", "9,3,64", "--rows", "1,5,9,17,33,256", "--slots", "2048,4096,8192", "--reps", "3",
            "--json", f"{RESULTS_DIR}/attention_peers_smollm2.json"), 5),
    Result("short_verify_tiny_32k", "short_verify", "tiny, 32K", "scripts/bench_short_verify.py",
           ("--skip-layer", "--context", "32768", "--draft-lens", "8,32", "--rounds", "5",
            "--json", f"{RESULTS_DIR}/short_verify_tiny_32k.json"), 10),
    Result("short_verify_smollm2_8k", "short_verify", "SmolLM2, 8K", "scripts/bench_short_verify.py",
           (*SMOLLM2, "--skip-layer", "--context", "8192", "--draft-lens", "8,32", "--rounds", "3", "--impls", "native",
            "--json", f"{RESULTS_DIR}/short_verify_smollm2_8k.json"), 3),
)

BY_NAME = {r.name: r for r in RESULTS}


def select(only: str | None, run_all: bool) -> list[Result]:
    """The results `--only a,b` or `--all` names, in registry order; an unknown name is an error naming it."""
    if run_all:
        return list(RESULTS)
    names = [n for n in (only or "").split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"regenerate_results: unknown result(s) {', '.join(unknown)}; --list shows the names")
    return [BY_NAME[n] for n in names]


def list_results() -> str:
    lines = []
    for r in RESULTS:
        state = "pending" if r.pending else ("ok" if os.path.exists(os.path.join(REPO, r.path)) else "MISSING")
        needs = f"  needs: {', '.join(EXTERNAL[k][0] + ' PATH' for k in r.needs)}" if r.needs else ""
        lines.append(f"{r.name:44s} [{r.table}] ~{r.minutes:g} min, {state}{needs}\n    {r.command()}")
    return "\n".join(lines)


def run(results: list[Result], values: dict, dry_run: bool) -> int:
    """Run each result's command in order (or print it); stop at the first failure, naming it."""
    for r in results:
        missing = [EXTERNAL[k][0] for k in r.needs if not values.get(k)]
        if missing and not dry_run:
            print(f"regenerate_results: {r.name} needs {', '.join(m + ' PATH' for m in missing)} "
                  f"({'; '.join(EXTERNAL[k][1] for k in r.needs)})", file=sys.stderr)
            return 2
        print(f"[{r.name}] ~{r.minutes:g} min: {r.command(values)}", flush=True)
        if dry_run:
            continue
        argv = r.argv(values)
        argv[0] = sys.executable
        rc = subprocess.run(argv, cwd=REPO, env={**os.environ, **dict(r.env)}).returncode
        if rc != 0:
            print(f"regenerate_results: {r.name} failed (exit {rc}); the results after it were not run",
                  file=sys.stderr)
            return rc
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--list", action="store_true", help="print every result, its state and command")
    what.add_argument("--only", default=None, help="comma-separated result names to run")
    what.add_argument("--all", action="store_true", help="run every result in registry order")
    what.add_argument("--tables", action="store_true", help="re-render README 'Results' tables from the JSON files")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    for key, (opt, help_) in EXTERNAL.items():
        ap.add_argument(opt, dest=key, default=None, help=help_)
    args = ap.parse_args(argv)
    if args.list:
        print(list_results())
        return 0
    if args.tables:
        from results_tables import update_readme

        changed = update_readme(os.path.join(REPO, README), RESULTS, REPO)
        print(f"README.md: {', '.join(changed) if changed else 'tables already current'}")
        return 0
    return run(select(args.only, args.all), {k: getattr(args, k) for k in EXTERNAL}, args.dry_run)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    raise SystemExit(main())
