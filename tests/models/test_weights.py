"""Safetensors loading (single and sharded), errors naming tensors, dtype, Orbax round trip, HF export."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kvjax
from kvjax.errors import WeightsError
from kvjax.models.llama.weights import hf_config_dict, params_to_tensors
from kvjax.checkpoint import restore_orbax, save_orbax


def _copy_with(path, dst, edit):
    os.makedirs(dst, exist_ok=True)
    t = load_file(os.path.join(path, "model.safetensors"))
    edit(t)
    save_file(t, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())
    return dst


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"), "missing tensors: ['model.layers.1.self_attn.k_proj"),
    (lambda t: t.__setitem__("model.layers.0.extra.weight", np.zeros(3, np.float32)), "unexpected tensors"),
    (lambda t: t.__setitem__("model.norm.weight", np.zeros(7, np.float32)), "model.norm.weight: got (7,)"),
])
def test_bad_checkpoints_name_the_tensor(hf_model_dir, tmp_path, edit, needle):
    _, path = hf_model_dir("llama")
    dst = _copy_with(path, str(tmp_path / "bad"), edit)
    with pytest.raises(WeightsError) as e:
        kvjax.load(dst)
    assert needle in str(e.value)


def test_sharded_checkpoint_loads_identically(hf_model_dir, tmp_path):
    _, path = hf_model_dir("qwen2")
    t = load_file(os.path.join(path, "model.safetensors"))
    names = sorted(t)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    dst = tmp_path / "sharded"
    dst.mkdir()
    for fname, keys in shards.items():
        save_file({k: t[k] for k in keys}, str(dst / fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    (dst / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    a, b = kvjax.load(path), kvjax.load(str(dst))
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_bf16_load_and_orbax_round_trip(hf_model_dir, tmp_path):
    _, path = hf_model_dir("qwen3")
    m = kvjax.load(path, dtype="bf16")
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(m.params))
    save_orbax(tmp_path / "ckpt", m.params)
    back = restore_orbax(tmp_path / "ckpt", m.params)
    assert jax.tree.structure(back) == jax.tree.structure(m.params)
    for x, y in zip(jax.tree.leaves(m.params), jax.tree.leaves(back)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama_tied_linear"])
def test_export_round_trip_loads_in_transformers(hf_model_dir, tmp_path, name):
    import torch
    import transformers

    hf, path = hf_model_dir(name)
    m = kvjax.load(path)
    out = tmp_path / "export"
    out.mkdir()
    save_file(params_to_tensors(m.config, m.params), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(m.config)))
    again = kvjax.load(str(out))
    assert again.config == m.config
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    ids = torch.arange(20)[None] % m.config.vocab_size
    np.testing.assert_allclose(hf2(ids).logits.detach().numpy(), hf(ids).logits.detach().numpy(), atol=1e-5)
