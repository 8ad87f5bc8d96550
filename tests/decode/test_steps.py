"""Static shapes: decode runs and prompts of any length compile nothing after warm-up; capacity errors are loud."""

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.cache.capacity import pick_capacity
from kvjax.decode import steps
from kvjax.errors import CapacityError, InputError


def _cache(m, capacity):
    return m.family.init_cache(m.config, 1, capacity, m.cache_dtype)


def _fwd(m, cache, tok):
    return steps.forward_step(m.params, m.config, cache, tok, jnp.asarray([1], jnp.int32), family=m.family,
                              impl=m.attention)


def test_64_decode_steps_compile_once(hf_model_dir, compile_count):
    m = kvjax.load(hf_model_dir("qwen2")[1])  # full + sliding layers
    _, cache = steps.prefill(m, _cache(m, 256), np.arange(20) % m.config.vocab_size)
    logits, cache = _fwd(m, cache, jnp.asarray([[3]], jnp.int32))
    warm = compile_count(steps.forward_step)
    for _ in range(63):
        logits, cache = _fwd(m, cache, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None])
    assert compile_count(steps.forward_step) == warm
    assert int(cache.length[0]) == 20 + 64


def test_prompts_of_any_length_share_one_prefill_executable(hf_model_dir, compile_count):
    m = kvjax.load(hf_model_dir("mistral")[1])
    sizes = []
    for n in (70, 100, 37 + 64, 128):
        steps.prefill(m, _cache(m, 256), np.arange(n) % m.config.vocab_size, chunk=32)
        sizes.append(compile_count(steps.prefill_chunk))
    assert len(set(sizes)) == 1, sizes


def test_decode_loop_equals_step_by_step(hf_model_dir):
    m = kvjax.load(hf_model_dir("llama")[1])
    ids = np.arange(30) % m.config.vocab_size
    last, c1 = steps.prefill(m, _cache(m, 256), ids)
    first = jnp.argmax(last).astype(jnp.int32)[None]
    loop, _ = steps.decode(m.params, m.config, c1, first, jnp.zeros((1,), jnp.int32), num_steps=12,
                           family=m.family, impl=m.attention)
    _, c2 = steps.prefill(m, _cache(m, 256), ids)
    tok, manual = first, []
    for _ in range(12):
        lg, c2 = _fwd(m, c2, tok[:, None])
        tok = jnp.argmax(lg[:, 0], axis=-1).astype(jnp.int32)
        manual.append(int(tok[0]))
    assert list(np.asarray(loop[0])) == manual


def test_capacity_errors_are_clear(hf_model_dir):
    m = kvjax.load(hf_model_dir("llama")[1])
    with pytest.raises(CapacityError, match="exceed the largest cache capacity"):
        pick_capacity(10**9)
    with pytest.raises(CapacityError, match="does not fit the cache"):
        steps.prefill(m, _cache(m, 256), np.zeros(300, np.int32))
    with pytest.raises(InputError, match="max_new_tokens"):
        kvjax.generate(m, [1, 2, 3], max_new_tokens=0)
