"""Static shapes: decode runs and prompts of any length compile nothing after warm-up; capacity errors are loud."""

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from conftest import compile_count
from kvjax.errors import CapacityError
from kvjax.models.llama.cache import init_cache
from kvjax.cache.capacity import pick_capacity
from kvjax.decode import steps


def test_64_decode_steps_compile_once(hf_model_dir):
    _, path = hf_model_dir("qwen2")  # full + sliding layers
    m = kvjax.load(path)
    cache = init_cache(m.config, 1, 256)
    _, cache = steps.prefill(m.params, m.config, cache, np.arange(20) % m.config.vocab_size)
    tok = jnp.asarray([[3]], jnp.int32)
    one = jnp.asarray([1], jnp.int32)
    logits, cache = steps.forward_step(m.params, m.config, cache, tok, one)
    warm = compile_count(steps.forward_step)
    for _ in range(63):
        tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        logits, cache = steps.forward_step(m.params, m.config, cache, tok, one)
    assert compile_count(steps.forward_step) == warm
    assert int(cache.length[0]) == 20 + 64


def test_prompts_of_any_length_share_one_prefill_executable(hf_model_dir):
    _, path = hf_model_dir("mistral")
    m = kvjax.load(path)
    sizes = []
    for n in (5, 37, 64, 100):
        cache = init_cache(m.config, 1, 256)
        steps.prefill(m.params, m.config, cache, np.arange(n) % m.config.vocab_size, chunk=32)
        sizes.append(compile_count(steps.prefill_chunk))
    assert len(set(sizes)) == 1, sizes


def test_greedy_decode_loop_equals_step_by_step(hf_model_dir):
    _, path = hf_model_dir("llama")
    m = kvjax.load(path)
    ids = np.arange(30) % m.config.vocab_size
    c1 = init_cache(m.config, 1, 256)
    last, c1 = steps.prefill(m.params, m.config, c1, ids)
    first = jnp.argmax(last).astype(jnp.int32)[None]
    loop, _ = steps.greedy_decode(m.params, m.config, c1, first, num_steps=12)
    c2 = init_cache(m.config, 1, 256)
    _, c2 = steps.prefill(m.params, m.config, c2, ids)
    tok, manual = first, []
    for _ in range(12):
        lg, c2 = steps.forward_step(m.params, m.config, c2, tok[:, None], jnp.asarray([1], jnp.int32))
        tok = jnp.argmax(lg[:, 0], axis=-1).astype(jnp.int32)
        manual.append(int(tok[0]))
    assert list(np.asarray(loop[0])) == manual


def test_capacity_errors_are_clear(hf_model_dir):
    _, path = hf_model_dir("llama")
    m = kvjax.load(path)
    with pytest.raises(CapacityError, match="exceed the largest cache capacity"):
        pick_capacity(10**9)
    cache = init_cache(m.config, 1, 256)
    with pytest.raises(ValueError, match="does not fit the cache"):
        steps.prefill(m.params, m.config, cache, np.zeros(300, np.int32))
    with pytest.raises(ValueError, match="max_new_tokens"):
        kvjax.generate(m, [1, 2, 3], max_new_tokens=0)
