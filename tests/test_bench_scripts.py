import pytest
"""The many-request benchmark runs end to end at a tiny size (a name clash once made it fail before its first
timing, and nothing ran it)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # ~33 s end to end; the schedulers' exactness stays in CI through tests/scheduling/test_scheduler.py
def test_bench_scheduler_runs_and_every_contender_is_exact(tmp_path):
    out = tmp_path / "sched.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_scheduler.py"), "--random",
                        "--requests", "2", "--context", "512", "--new-tokens", "8", "--draft-len", "2",
                        "--repeats", "1", "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    records = doc["records"]
    assert [x["name"] for x in records] == ["full", "vericache-lockstep", "vericache-staggered"]
    assert all(x["identical_fraction"] == 1.0 and x["within_budget"] for x in records)
    seq = doc["one_at_a_time"]  # plain decoding, one request after another: the CPU's unthrottled comparison
    assert seq["tokens_per_s"] > 0 and 0.0 <= seq["identical_fraction"] <= 1.0
    assert doc["ratios"]["lockstep_vs_one_at_a_time"] > 0
    # no --compressor: the scheduler's own drafter, its fields recorded
    config = doc["config"]
    assert config["compressor_spec"] == "default" and config["compressor"] == "refresh"
    assert config["compressor_kw"]["max_kept"] == 2048


@pytest.mark.slow  # CI time; the task set is checked in tests/data/test_exact_tasks.py, VeriCache == full everywhere
def test_bench_exact_tasks_runs_and_vericache_answers_as_full_cache(tmp_path):
    """One tiny task on the bundled checkpoint: every contender reported, VeriCache identical to the reference
    (the script itself stops with an error otherwise), and `kvjax plot` draws the result."""
    out = tmp_path / "exact.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_exact_tasks.py"), "--context", "384",
                        "--tasks", "1", "--new-tokens", "6", "--draft-len", "2", "--compressors", "streaming",
                        "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    records = {x["name"]: x for x in doc["records"]}
    assert sorted(records) == ["full", "lossy[streaming]", "reference", "vc[streaming]"]
    assert records["vc[streaming]"]["identical_fraction"] == 1.0
    assert records["vc[streaming]"]["accuracy"] == records["reference"]["accuracy"]
    task = doc["tasks"][0]
    assert task["prompt_tokens"] == 384 - 6 - 2 - 2 and set(task["continuations"]) == set(records)
    png = tmp_path / "exact.png"
    from kvjax import plots

    assert plots.plot_files([str(out)], str(png))[0] == "accuracy" and png.stat().st_size > 0


def _bench_common():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import bench_common

    return bench_common


def test_a_named_model_is_loaded_never_replaced_by_a_random_one():
    """`--model smollm2-135m-instruct` once fell through to a random model of the tiny shape (no config.json)."""
    bc = _bench_common()
    assert bc.is_model_source("smollm2-135m-instruct")
    assert not bc.is_model_source(os.path.join(ROOT, "checkpoints", "kvjax-code-tiny"))


def test_prompts_for_a_pretrained_model_come_from_source_newer_than_its_data():
    """The bundled checkpoint keeps its held-out corpus split; any other model gets transformers source dated 2025
    or later (the standard library is in every pretrained model's data), exactly n tokens each."""
    import types

    import numpy as np

    bc = _bench_common()
    files = bc.recent_source_files()
    assert files and all(f.endswith(".py") and "modeling_" in f for f in files)

    class Chars:  # one token per character: enough to check lengths and the text's origin
        def encode(self, text):
            return [ord(c) % 4096 for c in text]

    model = types.SimpleNamespace(tokenizer=Chars())
    prompts, source = bc.heldout_prompts(model, "smollm2-135m-instruct", 3000, 2, seed=0)
    assert "dated >= 2025" in source and [p.size for p in prompts] == [3000, 3000]
    assert not np.array_equal(prompts[0], prompts[1])
    text = "".join(chr(int(t)) for t in prompts[0][:400])
    assert "Copyright 2025" in text or "Copyright 2026" in text


def test_run_meta_names_the_command_and_cpu_but_no_machine_path():
    bc = _bench_common()
    meta = bc.run_meta([os.path.join(ROOT, "scripts", "bench_roofline.py"), "--gguf", "/some/dir/model.Q4_1.gguf"])
    assert meta["command"] == "python scripts/bench_roofline.py --gguf model.Q4_1.gguf"
    assert {"cpu_model", "l3_cache", "cpus", "backend", "commit"} <= set(meta)


def test_gguf_export_dequantised_keeps_metadata_and_the_dequantised_values(tmp_path):
    """llama.cpp's f32 peer runs the shipped GGUF's tensors dequantised (the values kvjax computes with), its
    metadata (tokenizer, rope, ...) unchanged."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from gguf_export import export_dequantised

    src, out = str(tmp_path / "q8.gguf"), str(tmp_path / "f32.gguf")
    w = gguf.GGUFWriter(src, "llama")
    w.add_block_count(2)
    w.add_rope_freq_base(1e5)
    w.add_token_list(["a", "b", "<s>"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    weight = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.arange(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    export_dequantised(src, out)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(out)
    for key in ("llama.block_count", "llama.rope.freq_base", "tokenizer.ggml.tokens", "general.architecture"):
        assert a.fields[key].contents() == b.fields[key].contents()
    assert b.fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    got = {t.name: t for t in b.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in b.tensors)
    q = next(t for t in a.tensors if t.name == "blk.0.ffn_up.weight")
    want = gguf.quants.dequantize(q.data, q.tensor_type)
    assert np.array_equal(np.asarray(got["blk.0.ffn_up.weight"].data), want)
    assert not np.array_equal(want, weight)  # Q8_0 is lossy: the export holds what the codes say
    assert np.array_equal(np.asarray(got["output_norm.weight"].data), np.arange(64, dtype=np.float32))


def _op_profile():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import op_profile

    return op_profile


def test_op_profile_reads_custom_calls_and_their_operand_bytes_from_hlo_text():
    """A custom call's target and the bytes of the shapes it reads (nested layout braces and all); XLA instructions
    grouped by kind; loops and branches, which span their contents, left out."""
    op = _op_profile()
    line = ('  %ffi_call.7 = f32[1,1,960]{2,1,0} custom-call(%a, %b, %c, %d), '
            'custom_call_target="kvjax_matmul_int_dot", operand_layout_constraints={f32[1,1,576]{2,1,0}, '
            'u8[15,288,64]{2,1,0}, f16[15,18,64]{2,1,0}, f16[15,18,64]{2,1,0}}, api_version=API_VERSION_TYPED_FFI')
    calls = op.custom_calls("HloModule jit_step, entry\n" + line)
    assert calls == {"ffi_call.7": ("kvjax_matmul_int_dot", 576 * 4 + 15 * 288 * 64 + 2 * 2 * 15 * 18 * 64)}
    assert op.shape_bytes("s8[1,3,2016,64]{3,2,1,0} pred[] bf16[4]") == 3 * 2016 * 64 + 1 + 8
    assert op.group_of("ffi_call.7", calls) == "kvjax_matmul_int_dot"
    assert op.group_of("multiply_add_fusion.29", calls) == "xla: multiply_add_fusion"
    assert op.group_of("while.3", calls) is None and op.group_of("ThunkExecutor::Execute", calls) is None


def test_bench_step_ops_accounts_each_step_by_operation(tmp_path):
    """On the bundled model: a prefill chunk, a decode step, a draft token, a verify and the refreshing draft's
    re-selection, each broken into its operations; the decode's attention reads the whole filled cache and the weights
    are read by the products, each kernel with its floor; the re-selection scores the cache with the block masses."""
    from pallas_kernels import native

    out = tmp_path / "ops.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_step_ops.py"), "--context", "256",
                        "--reps", "1", "--compressor", "refresh", "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    assert [x["step"] for x in records] == ["prefill chunk (128 rows at 128 cached)", "full-cache decode",
                                           "draft token [refresh]", "verify x=8", "re-selection"]
    for rec in records:
        assert rec["ops"] and rec["ops_ms"] > 0 and rec["step_ms"] > 0
        assert all(o["count"] > 0 and (o["bytes"] == 0 or o["floor_ms"] > 0) for o in rec["ops"])
    if native.available():
        import kvjax

        m = kvjax.load(os.path.join(ROOT, "checkpoints", "kvjax-code-tiny"))
        c = m.config
        decode = {o["op"]: o for o in records[1]["ops"]}
        attend = decode["kvjax_attend"]
        assert attend["count"] % c.num_layers == 0  # the same calls in every layer
        # the calls' operands hold every layer's keys and values of the 256-token prompt at least
        assert attend["bytes"] > c.num_layers * 2 * c.num_kv_heads * 256 * c.head_dim * 4
        assert any(o["op"].startswith("kvjax_matmul") for o in records[1]["ops"])
        assert "kvjax_attend" in {o["op"] for o in records[0]["ops"]}  # the prefill chunk's attention too
        # the re-selection's scores come from the verify's own pass over the cache (`kvjax_attend_mass`), not a second
        assert "kvjax_attend_mass" in {o["op"] for o in records[3]["ops"]}
        assert "kvjax_block_mass" not in {o["op"] for o in records[4]["ops"]}


def test_multiply_add_counts_match_the_checkpoints_weights_and_the_verify_floor_adds_them_up():
    """A row's product multiply-adds are its weight matrices' elements (the bundled checkpoint ties its LM head to
    the embedding); a verify block's floor counts row t's prompt_len + t + 1 keys."""
    import jax
    import numpy as np

    import kvjax

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_common import attention_multiply_adds, product_multiply_adds
    from bench_short_verify import arithmetic_floor

    m = kvjax.load(os.path.join(ROOT, "checkpoints", "kvjax-code-tiny"))
    cfg = m.config
    weights = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(m.params) if x.ndim == 2)
    assert cfg.tie_word_embeddings and product_multiply_adds(cfg) == weights
    assert attention_multiply_adds(cfg.num_heads, cfg.head_dim, 10, layers=cfg.num_layers) == \
        cfg.num_layers * cfg.num_heads * 2 * cfg.head_dim * 10
    f = arithmetic_floor(cfg, 100, 2, rate=1e9)
    seen = 101 + 102 + 103  # three rows at positions 100, 101, 102
    assert f["attention_multiply_adds"] == attention_multiply_adds(cfg.num_heads, cfg.head_dim, seen,
                                                                   layers=cfg.num_layers)
    assert f["product_multiply_adds"] == 3 * weights
    assert abs(f["ms"] - (f["attention_multiply_adds"] + f["product_multiply_adds"]) / 1e9 * 1e3) < 1e-9
    assert arithmetic_floor(cfg, 100, 2, rate=None) is None


@pytest.mark.slow  # ~20 s end to end; the bits themselves are asserted in tests/models/test_verify_params.py
def test_bench_bf16_panels_runs_and_both_layouts_give_the_same_bits(tmp_path):
    out = tmp_path / "panels.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_bf16_panels.py"), "--context", "600",
                        "--reps", "1", "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rec = json.loads(out.read_text())["records"][0]
    assert rec["same_bits"] == {"decode": True, "verify": True}
    assert rec["weight_bytes"]["bf16 panels"] < rec["weight_bytes"]["f32 panels"]
