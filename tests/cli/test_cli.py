"""The `kvjax` command: generate (full / VeriCache, streaming, --json), bench, cache, and one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import string

import numpy as np
import pytest

from kvjax import cli

TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}:{% endif %}"


@pytest.fixture(scope="module")
def model_dir(hf_model_dir, tmp_path_factory):
    """The tiny random llama plus a character-level tokenizer (ids < its vocab of 97) and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    _, src = hf_model_dir("llama")
    d = str(tmp_path_factory.mktemp("cli") / "model")
    shutil.copytree(src, d)
    chars = string.ascii_letters + string.digits + " .,:;()[]<>=+-*/_'\"\n#"
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(["[UNK]", *chars])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(dict(chat_template=TEMPLATE), f)
    return d


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("kvjax: error: "), err
    return err[0]


def test_generate_full_json_matches_api(model_dir, capsys):
    import kvjax

    prompt = "def add(a, b):\n    return a + b\n\nclass Point:\n"
    assert cli.main(["generate", "--model", model_dir, "--prompt", prompt, "--new-tokens", "40", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)  # stdout is exactly the JSON: no streamed text
    model = kvjax.load(model_dir)
    ids = model.tokenizer.encode(prompt)
    want = kvjax.generate(model, ids, max_new_tokens=40)
    assert res["prompt_tokens"] == len(ids) and res["new_tokens"] == 40
    assert res["tokens"] == want.tolist()  # chunked streaming decode = one-call greedy decode
    assert res["text"] == model.tokenizer.decode(want)


def test_generate_vericache_chat_file_compare_full(model_dir, tmp_path, capsys):
    pf = tmp_path / "p.txt"
    pf.write_text("x = [i * i for i in range(10)]\nprint(x)\n" * 3)
    out = tmp_path / "r.json"
    rc = cli.main(["generate", "--model", model_dir, "--prompt-file", str(pf), "--chat", "--mode", "vericache",
                   "--draft-len", "4", "--new-tokens", "24", "--compare-full", "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    res = json.loads(out.read_text())
    assert res["identical_to_full_cache"] is True and res["verifications"] >= 2
    assert res["prompt_tokens"] == len(pf.read_text()) + 3  # chat template: "<", ">", ":" around the text
    assert cap.out.strip() == res["text"].strip()  # streamed to stdout
    assert "summary: mode=vericache" in cap.err


@pytest.mark.slow  # CI time; adaptive x is exact in tests/decode/test_draft_length.py and the default in test_api_result.py
def test_generate_vericache_adaptive_draft_length(model_dir, tmp_path, capsys):
    """--adaptive: each round's x comes from the CLI's set (kept equal to the engine's), output still identical."""
    from kvjax.cli.generate import ADAPTIVE_SET
    from kvjax.decode.draft_length import DEFAULT_SET

    assert ADAPTIVE_SET == DEFAULT_SET
    out = tmp_path / "r.json"
    rc = cli.main(["generate", "--model", model_dir, "--prompt", "def parse(text):\n    return", "--mode",
                   "vericache", "--adaptive", "--draft-len", "4", "--new-tokens", "20", "--ignore-eos",
                   "--compare-full", "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    res = json.loads(out.read_text())
    assert res["identical_to_full_cache"] is True and res["new_tokens"] == 20
    assert set(res["draft_lengths"]) <= set(DEFAULT_SET)
    assert cli.main(["generate", "--model", model_dir, "--prompt", "x", "--mode", "vericache", "--adaptive",
                     "--draft-len", "5"]) == 2
    assert "--adaptive starts at --draft-len, which must be one of" in capsys.readouterr().err


@pytest.mark.slow  # ~40 s of compiling on the 2-core CPU; the flags are family-generic, each V4 piece is tested alone
def test_generate_vericache_offload_hybrid_checkpoint(tmp_path, capsys):
    """The bundled DeepSeek-V4 checkpoint through the same flags: offloaded VeriCache, identical to full-cache
    decoding, host->device traffic reported."""
    from builders import CHECKPOINTS

    out = tmp_path / "r.json"
    rc = cli.main(["generate", "--model", os.path.join(CHECKPOINTS, "kvjax-hybrid-tiny"), "--prompt",
                   "import os\n\ndef walk(root):\n    for name in os.listdir(root):\n        path = os.path.join(",
                   "--mode", "vericache", "--offload", "--compare-full", "--draft-len", "4", "--new-tokens", "12",
                   "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    res = json.loads(out.read_text())
    assert res["identical_to_full_cache"] is True and res["new_tokens"] == 12
    assert res["h2d_bytes_per_token"] > 0 and res["verifications"] >= 1


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--model", "/nonexistent/model", "--prompt", "x"], "no model at /nonexistent/model"),
    (["generate", "--new-tokens", "4"], "give exactly one of --prompt"),
    (["generate", "--prompt", "a", "--tp", "3"], "needs 3 devices"),
    (["generate", "--prompt", "a", "--new-tokens", "0"], "--new-tokens must be >= 1"),
    (["generate", "--prompt", "a", "--host-devices", "64"], "JAX already started with"),
    (["bench", "nosuch"], "unknown benchmark 'nosuch'"),
    (["plot", "/nonexistent.json", "-o", "x.png"], "No such file"),
    (["cache", "/nonexistent/store"], "no prefix-cache store at /nonexistent/store"),
    (["plot", "a.json", "-o", "x.png", "--", "--oops"], "arguments after -- are for `kvjax bench` only"),
])
def test_errors_are_one_line(model_dir, capsys, argv, needle):
    if argv[0] == "generate" and "--model" not in argv:
        argv = [*argv, "--model", model_dir]
    assert cli.main(argv) == 2
    assert needle in _one_error_line(capsys)


def test_bench_list_and_passthrough(capsys):
    assert cli.main(["bench", "--list", "--json"]) == 0
    suites = json.loads(capsys.readouterr().out)["suites"]
    assert {"vericache", "scheduler", "kernels", "prefix_cache"} <= set(suites)
    assert all(isinstance(v, str) and v for v in suites.values())
    # arguments after -- reach the script untouched (its --help exits 0 without running anything)
    assert cli.main(["bench", "scheduler", "--json", "--", "--help"]) == 0
    cap = capsys.readouterr()
    res = json.loads(cap.out)
    assert res["suite"] == "scheduler" and res["args"] == ["--help"] and res["returncode"] == 0
    assert "--requests" in cap.err  # the script's own output went to stderr (stdout carries the JSON)


def _make_store(path):
    """A store written through the prefix cache's own tier code: one namespace, 3 blocks of 2 forms."""
    from kvjax.prefix.identity import block_keys, make_namespace
    from kvjax.prefix.layouts.llama import PATH, FormSpec
    from kvjax.prefix.radix import Block
    from kvjax.prefix.tiers import StoreTier
    from kvjax.models.llama.config import config_from_hf

    cfg = config_from_hf(dict(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64))
    specs = [FormSpec("dense", PATH, (0, 1), (2, 2, 2, 4, 16), "float32", "L2KPD"),
             FormSpec("swa", PATH, (1,), (1, 2, 2, 4, 16), "float32", "L2KPD")]
    ns = make_namespace(cfg, weights="ab" * 32, kv_dtype="float32", formats={s.name: s.fingerprint for s in specs},
                        block_size=4)
    st = StoreTier(str(path))
    st.write_namespace(ns)
    toks = np.arange(12, dtype=np.int32)
    keys = block_keys(ns.digest, toks, 4)
    rng = np.random.default_rng(0)
    futs = []
    for i, k in enumerate(keys):
        blk = Block(index=i, key=k, parent_key=keys[i - 1] if i else bytes(32), tokens=toks[4 * i:4 * i + 4])
        futs.append(st.write_block_record(ns.hex, k, blk.parent_key, i, blk.tokens))
        for s in specs:
            futs.append(st.write_entry(ns.hex, s, blk, rng.standard_normal(s.entry_shape).astype(np.float32)))
    for f in futs:
        f.result()
    return ns, specs, keys


def test_cache_inspect_verify_evict(tmp_path, capsys):
    store = tmp_path / "store"
    ns, specs, keys = _make_store(store)
    assert cli.main(["cache", str(store), "--verify", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    (n,) = r["namespaces"]
    assert n["namespace"] == ns.hex and n["blocks"] == 3 and r["corrupt"] == []
    assert n["identity"]["weights"] == ("ab" * 32)[:16] and n["identity"]["block_size"] == 4
    assert {f: v["entries"] for f, v in n["forms"].items()} == {"dense": 3, "swa": 3}
    assert n["forms"]["dense"]["bytes"] > 3 * specs[0].nbytes  # payload + header
    # flip one payload byte on disk: --verify names the entry and the failed check, in one line, exit 2
    victim = store / ns.hex / "swa" / keys[1].hex()
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0xFF
    victim.write_bytes(bytes(raw))
    assert cli.main(["cache", str(store), "--verify"]) == 2
    cap = capsys.readouterr()
    assert f"CORRUPT {ns.hex}/swa/{keys[1].hex()}: checksum mismatch" in cap.out
    assert "1 corrupt entries" in _one_error_line_from(cap.err)
    assert cli.main(["cache", str(store), "--evict-corrupt", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["evicted_corrupt"] == 1 and r["corrupt"] == []  # the report is the store after the eviction
    assert r["namespaces"][0]["forms"]["swa"]["entries"] == 2
    assert not victim.exists()
    assert cli.main(["cache", str(store), "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["namespaces"][0]["forms"]["swa"]["entries"] == 2
    assert cli.main(["cache", str(store), "--evict", ns.hex[:8], "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["evicted_namespaces"] == [ns.hex] and r["namespaces"] == []  # printed after the eviction
    assert cli.main(["cache", str(store), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["namespaces"] == []


def _one_error_line_from(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvjax: error: "), lines
    return lines[0]
