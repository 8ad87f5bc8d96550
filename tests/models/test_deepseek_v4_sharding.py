"""DeepSeek-V4 on a tensor-parallel mesh: the split rules (query heads, experts, MLP on "tp"; the one shared K=V head
and the compressors replicated), and — slow, in subprocesses with 2 simulated CPU devices — `kvjax generate --tp 2`
on the bundled hybrid checkpoint: VeriCache equals full-cache decoding on the mesh, and the tokens equal one
device's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
from builders import CHECKPOINTS, REPO
from jax.sharding import PartitionSpec as P

import kvjax
from kvjax.models.deepseek_v4.sharding import param_specs

HYBRID = os.path.join(CHECKPOINTS, "kvjax-hybrid-tiny")


def test_param_specs_split_heads_experts_mlp_and_replicate_the_kv_head():
    m = kvjax.load(HYBRID)
    specs = param_specs(m.params, m.config, 2, axis="tp")
    attn, ffn = specs["layers"][1]["attn"], specs["layers"][1]["ffn"]
    assert attn["wq_b"] == P(None, "tp") and attn["sinks"] == P("tp")
    assert attn["wo_a"] == P("tp", None, None) and attn["wo_b"] == P("tp", None)  # o_groups = 2
    assert attn["wkv"] == P(None, None) and all(s == P(*[None] * len(s)) for s in jax.tree.leaves(
        attn["compressor"], is_leaf=lambda x: isinstance(x, P)))
    assert ffn["w1"] == P("tp", None, None) and ffn["shared"]["w2"] == P("tp", None)
    assert specs["embed"] == P("tp", None) and specs["lm_head"] == P(None, "tp")
    with pytest.raises(ValueError, match="num_heads=4"):
        param_specs(m.params, m.config, 3, axis="tp")


def _generate(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "kvjax.cli.main", "generate", "--model", HYBRID, "--prompt",
           "def parse(text):\n    return [line.split() for line in text", "--mode", "vericache", "--draft-len", "4",
           "--new-tokens", "12", "--compare-full", "--json", str(out), *extra]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # two subprocesses compile the hybrid model's steps (~1 min on the shared 2-core CPU)
def test_cli_tp2_vericache_exact_and_equal_to_one_device(tmp_path):
    sharded = _generate(tmp_path, "tp2", "--tp", "2", "--host-devices", "2")
    single = _generate(tmp_path, "tp1")
    assert sharded["mesh"] == {"tp": 2, "dp": 1}
    assert sharded["identical_to_full_cache"] is True and single["identical_to_full_cache"] is True
    assert sharded["tokens"] == single["tokens"]  # sums over heads differ in the last bits; the tokens do not here
