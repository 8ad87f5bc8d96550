"""The bundled checkpoint: loads through every path (kvjax, Orbax, transformers) and generates code."""

import json
import os

import jax
import numpy as np
import pytest

import kvjax
from kvjax.checkpoint import restore_orbax
from builders import CHECKPOINTS

CKPT = os.path.join(CHECKPOINTS, "kvjax-code-tiny")


@pytest.fixture(scope="module")
def model():
    return kvjax.load(CKPT)


def test_orbax_checkpoint_equals_safetensors():
    m = kvjax.load(CKPT, dtype="bf16")
    restored = restore_orbax(os.path.join(CKPT, "orbax"), m.params)
    for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_transformers_loads_it_and_agrees(model):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(CKPT)
    text = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\nclass "
    ids = tok.encode(text)
    assert ids == model.tokenizer.encode(text)
    ref = hf(torch.tensor([ids])).logits[0].detach().numpy()
    np.testing.assert_allclose(kvjax.logits(model, ids), ref, atol=1e-4)


def test_generates_code_from_a_held_out_prompt(model):
    from kvjax.data import corpus

    prompt = corpus.long_prompts(model.tokenizer, 1024, 1)[0]
    out = kvjax.generate(model, prompt, max_new_tokens=24, ignore_eos=True)
    assert out.shape == (24,)
    text = model.tokenizer.decode([int(t) for t in out])
    assert len(text) > 24  # a trained BPE model emits multi-character tokens
    # the model is real: its next-token loss on held-out code is far below uniform (log 4096 = 8.3 nats)
    lg = kvjax.logits(model, prompt[:512])
    lp = lg - lg.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    nll = -lp[np.arange(511), prompt[1:512]].mean()
    assert nll < 6.0, nll


def test_model_card_matches_training_log():
    log = json.load(open(os.path.join(CKPT, "train_log.json")))
    card = open(os.path.join(CKPT, "README.md")).read()
    for ctx, ppl in log["val_ppl"].items():
        assert f"| {ctx} | {ppl} |" in card
    assert f"{log['params']:,}" in card


def test_perplexity_by_context_scores_the_same_tokens(model):
    """At the longest context it is the plain windowed perplexity of the same windows; shorter contexts score the
    same tokens from truncated windows, so they differ (the text before the scored tokens changes the logits)."""
    from kvjax.training.evaluate import perplexity, perplexity_by_context

    by_ctx = perplexity_by_context(model, model.tokenizer, [64, 256], 2, scored=48, seed=3)
    plain = perplexity(model, model.tokenizer, 256, 2, scored=48, seed=3)
    np.testing.assert_allclose(by_ctx[256], plain, rtol=1e-9)
    assert by_ctx[64] != by_ctx[256]
    assert all(np.isfinite(v) and v > 1 for v in by_ctx.values())
