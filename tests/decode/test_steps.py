"""Static shapes: decode runs and prompts of any length compile nothing after warm-up; capacity errors are loud."""

import jax
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


# DeepSeek-V4 (17 s here) runs with -m slow; CI covers its last-row prefill through every V4 test that checks logits
@pytest.mark.parametrize("kind", ["llama", pytest.param("deepseek_v4", marks=pytest.mark.slow)])
def test_prefill_projects_only_the_last_row_unless_all_logits_are_asked(hf_model_dir, kind):
    """The default prefill computes the vocabulary projection of each chunk's last real row only; its logits and the
    cache it leaves equal the all-rows form's (the cache bit for bit: logits never feed it)."""
    from builders import make_v4

    m = kvjax.load(hf_model_dir("llama")[1] if kind == "llama" else make_v4("hybrid")[1])
    ids = (np.arange(100) * 7) % m.config.vocab_size
    last, c1 = steps.prefill(m, _cache(m, 256), ids, chunk=32)
    rows, c2 = steps.prefill(m, _cache(m, 256), ids, chunk=32, all_logits=True)
    assert rows.shape == (100, m.config.vocab_size)
    np.testing.assert_allclose(np.asarray(last), rows[-1], atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(c1), jax.tree.leaves(c2)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    _, lg, _ = steps.prefill_chunk(m.params, m.config, _cache(m, 256), jnp.asarray(ids[None, :32], jnp.int32),
                                   jnp.asarray([32], jnp.int32), family=m.family, impl=m.attention)
    assert lg is None


def test_chunk_plan_takes_bulk_chunks_while_they_fit_then_short_ones():
    assert steps.chunk_plan(2600, 256, 1024) == [(0, 1024), (1024, 1024), (2048, 256), (2304, 256), (2560, 256)]
    assert steps.chunk_plan(2048, 256, 1024) == [(0, 1024), (1024, 1024)]
    assert steps.chunk_plan(300, 256, 1024) == [(0, 256), (256, 256)]
    assert steps.chunk_plan(300, 256, None) == steps.chunk_plan(300, 256, 128) == [(0, 256), (256, 256)]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # full attention; full + sliding layers
def test_bulk_chunks_leave_the_cache_and_logits_of_short_chunks(hf_model_dir, kind):
    """The bulk-then-short schedule gives the cache and the last row's logits of short chunks only, up to f32 rounding
    (XLA may group a 64-wide model's products differently by chunk width), and the same next token."""
    m = kvjax.load(hf_model_dir(kind)[1])
    ids = (np.arange(300) * 7) % m.config.vocab_size
    last_a, a = steps.prefill(m, _cache(m, 512), ids, chunk=32, bulk_chunk=128)
    last_b, b = steps.prefill(m, _cache(m, 512), ids, chunk=32, bulk_chunk=None)
    np.testing.assert_allclose(np.asarray(last_a), np.asarray(last_b), rtol=1e-5, atol=1e-5)
    assert int(np.argmax(last_a)) == int(np.argmax(last_b))
    assert int(a.length[0]) == int(b.length[0]) == 300
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
