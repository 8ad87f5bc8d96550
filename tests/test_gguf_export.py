"""The GGUF export llama.cpp runs as a peer holds the checkpoint's weights, in llama.cpp's orientation and rotary
layout, and its tokenizer."""

import os
import shutil
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
gguf = pytest.importorskip("gguf")


def test_export_writes_every_tensor_in_llama_cpp_layout(hf_model_dir, tmp_path):
    from gguf_export import export

    import kvjax

    hf, d = hf_model_dir("llama")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(d, ckpt)
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.BPE({"<|endoftext|>": 0, "a": 3, "b": 4, "ab": 5}, [("a", "b")]))
    tok.save(str(ckpt / "tokenizer.json"))
    path = export(str(ckpt), str(tmp_path / "m.gguf"))
    reader = gguf.GGUFReader(path)
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    m = kvjax.load(str(ckpt))
    cfg, p = m.config, m.params
    assert len(tensors) == 2 + (0 if cfg.tie_word_embeddings else 1) + 9 * cfg.num_layers
    np.testing.assert_array_equal(tensors["token_embd.weight"], np.asarray(p["embed"]))
    lp = p["layers"][1]
    np.testing.assert_array_equal(tensors["blk.1.ffn_down.weight"], np.asarray(lp["w_down"]).T)
    # llama.cpp's rotary pairs (2i, 2i+1) are HF's (i, i + D/2): row 1 of head 0 is HF row D/2
    D = cfg.head_dim
    q = tensors["blk.1.attn_q.weight"]
    wq = np.asarray(lp["wq"]).T
    np.testing.assert_array_equal(q[1], wq[D // 2])
    np.testing.assert_array_equal(q[D + 2], wq[D + 1])
    k = tensors["blk.1.attn_k.weight"]
    np.testing.assert_array_equal(np.sort(k, axis=0), np.sort(np.asarray(lp["wk"]).T, axis=0))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    assert len(tokens.data) == cfg.vocab_size
    assert bytes(tokens.parts[tokens.data[5]]).decode() == "ab"
    assert int(reader.get_field("llama.block_count").parts[-1][0]) == cfg.num_layers
