"""The GGUF reader on small files written here with `gguf.GGUFWriter` (no network): every tensor type it can write
plus a K-quant, llama.cpp's interleaved rotary rows undone, the tied output, the tokenizer and chat template from the
metadata, and a malformed, truncated or unsupported file failing in one line that names the fault."""

from __future__ import annotations

import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import kvjax  # noqa: E402
from kvjax.formats.gguf_file import GGUFError, GGUFFile  # noqa: E402
from kvjax.formats.gguf_weights import uninterleave_rotary  # noqa: E402
from kvjax.formats.gguf_write import add_llama_hparams  # noqa: E402

Q = gguf.GGMLQuantizationType
# one type per tensor kind, so every type the writer can produce is read back in one model
TYPES = {"attn_q": Q.Q4_1, "attn_k": Q.Q8_0, "attn_v": Q.Q4_0, "attn_output": Q.Q5_0, "ffn_gate": Q.Q5_1,
         "ffn_up": Q.BF16, "ffn_down": Q.F16}
TOKENS = ["<|end|>", "<|user|>", "a", "b", "ab", "Ġ", "Ġa", "Ġab", "1", "2", "<think>"]
MERGES = ["Ġ a", "a b", "Ġa b"]
TEMPLATE = "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"


def _interleave(w, heads):  # llama.cpp's converter permutation (HF half-split -> adjacent pairs)
    out = w.shape[0]
    return w.reshape(heads, 2, out // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _roundtrip(a, qtype):
    return np.asarray(gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype), np.float32).reshape(a.shape)


def write_model(path, model, *, tied, arch="llama", pre="smollm", drop=(), extra_meta=None, f32_only=False,
                one_type=None):
    """A GGUF of a toy kvjax model; returns the expected HF-layout tensors (after each type's rounding)."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    add_llama_hparams(w, c)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3] + [1] * (len(TOKENS) - 3) + [4])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_chat_template(TEMPLATE)
    for k, v in (extra_meta or {}).items():
        w.add_string(k, v)
    p = model.params
    f32 = lambda a: np.ascontiguousarray(np.asarray(a, np.float32))  # noqa: E731
    expected = {}

    def put(name, hf, a, qtype=Q.F32, heads=None):
        if name in drop:
            return
        stored = _interleave(a, heads) if heads else a
        qtype = Q.F32 if f32_only else (one_type if one_type is not None and stored.ndim == 2 else qtype)
        w.add_tensor(name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        expected[hf] = _roundtrip(stored, qtype)
        if heads:
            expected[hf] = uninterleave_rotary(expected[hf], heads)

    put("token_embd.weight", "embed", f32(p["embed"]), Q.Q8_0)
    put("output_norm.weight", "final_norm", f32(p["final_norm"]))
    if not tied:
        put("output.weight", "lm_head", f32(np.asarray(p["lm_head"]).T), Q.Q4_0)
    for i, lp in enumerate(p["layers"]):
        t = lambda k: f32(np.asarray(lp[k]).T)  # noqa: E731 - kvjax keeps [in, out], GGUF [out, in]
        put(f"blk.{i}.attn_norm.weight", (i, "attn_norm"), f32(lp["attn_norm"]))
        put(f"blk.{i}.ffn_norm.weight", (i, "mlp_norm"), f32(lp["mlp_norm"]))
        put(f"blk.{i}.attn_q.weight", (i, "wq"), t("wq"), TYPES["attn_q"], heads=c.num_heads)
        put(f"blk.{i}.attn_k.weight", (i, "wk"), t("wk"), TYPES["attn_k"], heads=c.num_kv_heads)
        for g, k in (("attn_v", "wv"), ("attn_output", "wo"), ("ffn_gate", "w_gate"), ("ffn_up", "w_up"),
                     ("ffn_down", "w_down")):
            put(f"blk.{i}.{g}.weight", (i, k), t(k), TYPES[g])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture
def toy(toy_model, toy_config):
    """A tiny random Llama (2 full-attention layers, GQA 4/2, D = 16)."""
    return toy_model(toy_config(("full_attention",) * 2, hidden=64, heads=4, kv_heads=2, head_dim=16))


@pytest.mark.parametrize("tied,f32_only", [(False, False), (True, False), (True, True)])
def test_every_tensor_type_loads_in_hf_layout(tmp_path, toy, tied, f32_only):
    path = tmp_path / "m.gguf"
    exp = write_model(path, toy, tied=tied, f32_only=f32_only)
    m = kvjax.load(str(path))
    c = m.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == (2, 4, 2, 16, tied)
    assert c.bos_token_id == 1 and c.eos_token_ids == (0,)
    np.testing.assert_array_equal(np.asarray(m.params["embed"]), exp["embed"])
    if not tied:
        np.testing.assert_array_equal(np.asarray(m.params["lm_head"]), exp["lm_head"].T)
    else:
        assert "lm_head" not in m.params
    for (i, k), want in ((k, v) for k, v in exp.items() if isinstance(k, tuple)):
        got = np.asarray(m.params["layers"][i][k])
        np.testing.assert_array_equal(got, want if want.ndim == 1 else want.T, err_msg=f"layer {i} {k}")
    # q/k rows back in HF order: the quantisation error is the only difference from the original weights
    for k in ("wq", "wk"):
        err = np.abs(np.asarray(m.params["layers"][0][k]) - np.asarray(toy.params["layers"][0][k])).max()
        assert err < (1e-7 if f32_only else 0.05), (k, err)
    if f32_only:  # unquantised: the loaded model computes exactly what the original (tied) model computes
        ids = [2, 3, 4, 5, 6, 7, 8, 9, 2, 4]
        ref = kvjax.Model(config=c, params={k: v for k, v in toy.params.items() if k != "lm_head"}, family=m.family)
        np.testing.assert_allclose(np.asarray(kvjax.logits(m, ids)), np.asarray(kvjax.logits(ref, ids)), atol=1e-5)


def test_two_quantisations_of_one_model_never_share_prefix_entries(tmp_path, toy):
    from kvjax.prefix.prefill import model_namespace

    ns = {}
    for qtype in (Q.Q8_0, Q.Q4_1):
        write_model(tmp_path / f"{qtype.name}.gguf", toy, tied=True, one_type=qtype)
        m = kvjax.load(str(tmp_path / f"{qtype.name}.gguf"))
        pc = kvjax.PrefixCache(kvjax.forms_for(m.config, m.cache_dtype))
        ns[qtype] = model_namespace(m, pc)
    a, b = ns.values()
    assert a.digest != b.digest  # same config, tokenizer and runtime: the weights' content tells them apart
    assert a.semantic["weights"] != b.semantic["weights"]
    assert {k: v for k, v in a.semantic.items() if k != "weights"} == {k: v for k, v in b.semantic.items()
                                                                      if k != "weights"}


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_0])
def test_a_quantised_models_loops_read_its_block_codes_exactly(tmp_path, toy, qtype):
    """A GGUF model's projections are exact block codes once loaded: the loops' layout keeps them as codes
    (`PackedAffine`, a quarter of the f32 bytes or less), the default drafter drafts with them, and the output is still
    the full-cache decoder's bit for bit; a model of unquantised weights keeps f32 panels and int8 draft codes."""
    from kvjax.families.llama import default_drafter_fields, reads_block_codes
    from pallas_kernels.affine import PackedAffine, unpack_affine
    from pallas_kernels.int_dot import int_dot_fast
    from pallas_kernels.linear import packed_weights_supported

    write_model(tmp_path / "m.gguf", toy, tied=True, one_type=qtype)
    m = kvjax.load(str(tmp_path / "m.gguf"))
    if not packed_weights_supported():
        assert not reads_block_codes(m)
        return
    codes, f32 = m.loop_params()["layers"][1]["w_down"], m.params["layers"][1]["w_down"]
    assert reads_block_codes(m) and not reads_block_codes(toy)
    assert isinstance(codes, PackedAffine) and codes.nbytes * 3 < f32.nbytes
    np.testing.assert_array_equal(np.asarray(unpack_affine(codes)), np.asarray(f32))
    # 4-bit codes draft by integer dot products where the CPU has them (`pallas_kernels.int_dot`), else exactly
    four_bit = qtype in (Q.Q4_1, Q.Q4_0)
    assert default_drafter_fields(m)["draft_weights"] == ("int_dot" if four_bit and int_dot_fast() else "float32")
    assert default_drafter_fields(toy)["draft_weights"] == "int8"
    ids = [2, 3, 4, 5, 6, 7, 8, 9, 2, 4, 6, 8]
    ref = kvjax.reference_decode(m, ids, 12, draft_len=4, return_logits=True)
    got = kvjax.generate_vericache(m, ids, 12, draft_len=4, ignore_eos=True, return_logits=True)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_array_equal(got.logits, ref.logits)
    if four_bit:  # the integer-dot draft asked for by name (on any CPU: without VNNI its portable loop)
        dot = kvjax.generate_vericache(m, ids, 12, draft_len=4, ignore_eos=True, return_logits=True,
                                       compressor_kw=dict(draft_weights="int_dot"))
        np.testing.assert_array_equal(dot.tokens, ref.tokens)
        np.testing.assert_array_equal(dot.logits, ref.logits)
    plain = kvjax.generate(m, ids, 12, ignore_eos=True)  # the one-token loop on the codes
    np.testing.assert_array_equal(plain.tokens, ref.tokens)


def test_an_int_dot_draft_reads_a_tied_head_as_coarse_codes_and_stays_exact(tmp_path, toy_model, toy_config):
    """A Q4_1 model with tied embeddings and a vocabulary of whole 64-column panels: the integer-dot draft reads its
    head as 4-bit codes with the best blocks re-scored exactly (`lm_head_coarse`), and VeriCache is still the reference
    decoder's bit for bit."""
    from kvjax.decode.draft_weights import draft_params
    from pallas_kernels.linear import packed_weights_supported

    m128 = toy_model(toy_config(("full_attention",) * 2, vocab=128, hidden=64, heads=4, kv_heads=2, head_dim=16))
    write_model(tmp_path / "m.gguf", m128, tied=True, one_type=Q.Q4_1)
    m = kvjax.load(str(tmp_path / "m.gguf"))
    if not packed_weights_supported():
        return
    d = draft_params(m, "int_dot")
    assert "lm_head" not in d and d["lm_head_coarse"].shape == (64, 128) and d["lm_head_rows"] is m.params["embed"]
    ids = [2, 3, 4, 5, 6, 7, 8, 9, 2, 4, 6, 8]
    ref = kvjax.reference_decode(m, ids, 12, draft_len=4, return_logits=True)
    dot = kvjax.generate_vericache(m, ids, 12, draft_len=4, ignore_eos=True, return_logits=True,
                                   compressor_kw=dict(draft_weights="int_dot"))
    np.testing.assert_array_equal(dot.tokens, ref.tokens)
    np.testing.assert_array_equal(dot.logits, ref.logits)


def test_rotary_rows_are_llama_cpp_pairs_undone():
    w = np.arange(2 * 8 * 3).reshape(16, 3).astype(np.float32)  # 2 heads of D = 8
    stored = _interleave(w, 2)
    np.testing.assert_array_equal(stored[1], w[4])  # llama.cpp row 1 of head 0 = HF row D/2
    np.testing.assert_array_equal(uninterleave_rotary(stored, 2), w)


def test_k_quant_tensor_dequantises_as_gguf_does(tmp_path):
    rng = np.random.default_rng(0)
    block = gguf.GGML_QUANT_SIZES[Q.Q4_K][1]
    raw = rng.integers(0, 256, (2, block), dtype=np.uint8)
    raw[:, :4] = np.frombuffer(np.array([0.01, 0.002], np.float16).tobytes(), np.uint8)  # finite d, dmin
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("x", raw, raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(tmp_path / "k.gguf")
    assert f.tensors["x"].shape == (2, 256) and f.tensors["x"].type_name == "Q4_K"
    np.testing.assert_array_equal(f.tensor("x"), gguf.quants.dequantize(raw, Q.Q4_K))


def test_tokenizer_and_chat_template_from_metadata(tmp_path, toy):
    path = tmp_path / "m.gguf"
    write_model(path, toy, tied=True)
    tok = kvjax.load(str(path)).tokenizer
    assert tok.encode("ab ab") == [4, 7]
    assert tok.encode("a<|user|>12") == [2, 1, 8, 9]  # control token whole, digits one by one
    assert tok.encode("<think>") == [10]  # a user-defined token stays whole
    assert tok.bos_token == "<|user|>" and tok.eos_token == "<|end|>" and tok.eos_token_id == 0
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}]) == [1, 4, 0]
    assert tok.decode([7, 6]) == " ab a"


def test_directory_with_one_gguf_loads(tmp_path, toy):
    write_model(tmp_path / "m.gguf", toy, tied=True)
    assert kvjax.load(str(tmp_path)).config.num_layers == 2
    write_model(tmp_path / "n.gguf", toy, tied=True)
    with pytest.raises(GGUFError, match="2 GGUF files"):
        kvjax.load(str(tmp_path))


# ------------------------------------------------------------------------------------------------ refusals
def test_unknown_architecture_pre_tokenizer_and_missing_tensor_are_named(tmp_path, toy):
    write_model(tmp_path / "a.gguf", toy, tied=True, arch="gpt2")
    with pytest.raises(kvjax.UnsupportedConfigError, match="general.architecture='gpt2'"):
        kvjax.load(str(tmp_path / "a.gguf"))
    write_model(tmp_path / "p.gguf", toy, tied=True, pre="klingon")
    with pytest.raises(kvjax.UnsupportedConfigError, match="tokenizer.ggml.pre='klingon'"):
        kvjax.load(str(tmp_path / "p.gguf"))
    write_model(tmp_path / "t.gguf", toy, tied=True, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(kvjax.WeightsError, match="model.layers.1.mlp.up_proj.weight"):
        kvjax.load(str(tmp_path / "t.gguf"))


def _header(n_tensors=0, n_kv=0, version=3, magic=b"GGUF"):
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv)


def _string(s: bytes):
    return struct.pack("<Q", len(s)) + s


def _broken_files(valid: bytes):
    tensor = _string(b"w") + struct.pack("<I", 1) + struct.pack("<Q", 32)
    return {
        "not a GGUF file": b"GGML" + valid[4:],
        "version 1 is not supported": _header(version=1) + bytes(64),
        "absurd counts": _header(n_tensors=1 << 60, n_kv=3) + bytes(64),
        "truncated: metadata key 0 (1152921504606846976 bytes)": _header(n_kv=1) + struct.pack("<Q", 1 << 60)
                                                                  + bytes(64),
        "truncated: k (1099511627776 elements)": _header(n_kv=1) + _string(b"k") + struct.pack("<IIQ", 9, 4, 1 << 40)
                                                 + bytes(64),
        "unknown ggml type 99": _header(n_tensors=1) + tensor + struct.pack("<IQ", 99, 0) + bytes(64),
        "has 7 dimensions": _header(n_tensors=1) + _string(b"w") + struct.pack("<I", 7) + bytes(80),
        "run past the end of the file": _header(n_tensors=1) + tensor + struct.pack("<IQ", 0, 0) + bytes(100),
        "truncated or corrupt: tensor": valid[: len(valid) // 3],  # cut in the tensor data
        "truncated or absurd counts": valid[:300],  # cut in the metadata
        "truncated: ": valid[:1500],
    }


def test_malformed_files_fail_in_one_line_before_allocating(tmp_path, toy):
    import tracemalloc

    write_model(tmp_path / "ok.gguf", toy, tied=True)
    valid = (tmp_path / "ok.gguf").read_bytes()
    for fault, data in _broken_files(valid).items():
        p = tmp_path / "bad.gguf"
        p.write_bytes(data)
        tracemalloc.start()
        with pytest.raises(GGUFError) as e:
            kvjax.load(str(p))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(str(p)) and fault in msg, (fault, msg)
        assert peak < 8 << 20, (fault, peak)  # nothing of the claimed size was allocated
