"""`kvjax models` lists the named models and which are cached; `kvjax generate` refuses a prompt past the model's
trained context unless rope scaling is opted into, and the opt-in builds the scaled config HF would."""

from __future__ import annotations

import json

import pytest
from builders import BUNDLED

from kvjax import cli
from kvjax.errors import UnsupportedConfigError
from kvjax.models.llama.config import load_config, with_rope_scaling

def test_models_lists_names_and_cache_state(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path))
    assert cli.main(["models", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = next(r for r in out["models"] if r["name"] == "smollm2-135m-instruct")
    assert row["cached"] is False and out["cache_dir"] == str(tmp_path / "models")
    d = tmp_path / "models" / "smollm2-135m-instruct"
    d.mkdir(parents=True)
    (d / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"x")  # wrong size: not a cached model
    assert cli.main(["models", "--json"]) == 0
    assert not json.loads(capsys.readouterr().out)["models"][0]["cached"]


def test_prompt_past_the_trained_context_needs_rope_scaling(capsys):
    limit = load_config(BUNDLED).max_position_embeddings
    assert cli.main(["generate", "--prompt", "x = 1\n" * (limit // 2 + 100), "--new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert f"trained context of {limit} tokens" in err and "--rope-scaling yarn:" in err


def test_with_rope_scaling_is_the_hf_config():
    from kvjax.models.llama.config import config_from_hf

    hf = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=2, max_position_embeddings=8192, rope_theta=1e5)
    scaled = with_rope_scaling(config_from_hf(hf), "yarn", 2.0)
    want = config_from_hf({**hf, "max_position_embeddings": 16384, "rope_scaling": dict(
        rope_type="yarn", factor=2.0, original_max_position_embeddings=8192)})
    assert scaled == want
    with pytest.raises(UnsupportedConfigError, match="already uses 'yarn'"):
        with_rope_scaling(scaled, "yarn", 2.0)
