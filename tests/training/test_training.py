"""kvjax.training: the training forward equals the decode forward, windows are reproducible from a cursor, phases
parse, and a run stopped and resumed from its Orbax state continues exactly where the uninterrupted run would be."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.models import llama
from kvjax.training import state as train_state
from kvjax.training.flops import train_flops_per_token
from kvjax.training.forward import next_token_loss
from kvjax.training.model_config import tiny_llama_config
from kvjax.training.phases import parse_count, parse_phases, phase_at, total_steps
from kvjax.training.step import make_optimizer, make_train_step
from kvjax.training.windows import WindowSampler


def toy_config():
    return tiny_llama_config(context=32, vocab=64, hidden=32, intermediate=48, layers=2, heads=4, kv_heads=2,
                             head_dim=8)


@pytest.mark.slow  # CI time; training makes the bundled checkpoint, serving never runs it
def test_training_loss_matches_the_decode_forward():
    cfg = toy_config()
    params = llama.init_params(cfg, jax.random.PRNGKey(0))
    windows = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 17)), jnp.int32)
    logits = llama.forward_train(params, cfg, windows[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    want = -jnp.mean(jnp.take_along_axis(logp, windows[:, 1:, None], axis=-1))
    np.testing.assert_allclose(float(next_token_loss(params, cfg, windows)), float(want), rtol=1e-5)


@pytest.mark.slow  # CI time; training makes the bundled checkpoint, serving never runs it
def test_accumulated_step_equals_one_big_batch():
    cfg = toy_config()
    opt = make_optimizer(1e-2, 1, 10)
    windows = np.random.default_rng(1).integers(0, cfg.vocab_size, (4, 17)).astype(np.int32)
    outs = []
    for shape in ((1, 4, 17), (2, 2, 17)):
        params = llama.init_params(cfg, jax.random.PRNGKey(0))
        step = make_train_step(cfg, opt)
        params, _, loss = step(params, opt.init(params), jnp.asarray(windows.reshape(shape)))
        outs.append((float(loss), np.asarray(params["layers"][0]["wq"])))
    assert outs[0][0] == pytest.approx(outs[1][0], rel=1e-5)
    np.testing.assert_allclose(outs[0][1], outs[1][1], atol=1e-5)


def test_windows_cover_an_epoch_once_and_replay_from_a_cursor():
    stream = np.arange(1000, dtype=np.int32)
    s = WindowSampler(stream, 10, seed=3, phase=1)
    epoch = s.starts(0, s.per_epoch)
    assert len(set(epoch.tolist())) == s.per_epoch and epoch.max() + 11 <= stream.size
    assert np.all(np.diff(np.sort(epoch)) == 10)  # disjoint inputs: every token once per epoch
    again = WindowSampler(stream, 10, seed=3, phase=1)
    np.testing.assert_array_equal(again.batch(95, 7), s.batch(95, 7))  # crosses into epoch 1
    assert not np.array_equal(s.starts(0, 5), WindowSampler(stream, 10, seed=4, phase=1).starts(0, 5))
    with pytest.raises(ValueError, match="too short"):
        WindowSampler(stream[:15], 10, 0, 0)


def test_phases_parse_and_locate_steps():
    assert parse_count("4M") == 4_000_000 and parse_count("250k") == 250_000 and parse_count("1.5M") == 1_500_000
    phases = parse_phases("512:16384,4096:8192", tokens_per_step=8192)
    assert [(p.context, p.batch, p.steps) for p in phases] == [(512, 16, 2), (4096, 2, 1)]
    assert total_steps(phases) == 3 and phase_at(phases, 1) == (0, 1) and phase_at(phases, 2) == (1, 0)
    for bad in ("512", "x:1M", "512:abc", "1:100", ""):
        with pytest.raises(ValueError):
            parse_phases(bad, 8192)


def test_flops_count_grows_with_context():
    cfg = tiny_llama_config(context=4096)
    assert train_flops_per_token(cfg, 4096) > train_flops_per_token(cfg, 512) > 6 * 3.1e6


def _run(cfg, opt, step_fn, state, sampler, steps):
    for _ in range(steps):
        w = sampler.batch(state["cursor"], 2).reshape(1, 2, -1)
        state["params"], state["opt_state"], _ = step_fn(state["params"], state["opt_state"], jnp.asarray(w))
        state.update(step=state["step"] + 1, cursor=state["cursor"] + 2, tokens=state["tokens"] + 32)
    return state


@pytest.mark.slow  # CI time; training makes the bundled checkpoint, serving never runs it
def test_resume_continues_exactly_where_it_stopped(tmp_path):
    cfg = toy_config()
    opt = make_optimizer(1e-2, 1, 10)
    step_fn = make_train_step(cfg, opt)
    stream = np.random.default_rng(2).integers(0, cfg.vocab_size, 2000).astype(np.int32)

    def fresh():
        p = llama.init_params(cfg, jax.random.PRNGKey(0))
        return dict(params=p, opt_state=opt.init(p), rng=jax.random.PRNGKey(1), step=0, phase=0, cursor=0,
                    seed=0, tokens=0)

    straight = _run(cfg, opt, step_fn, fresh(), WindowSampler(stream, 16, 0, 0), 4)
    first = _run(cfg, opt, step_fn, fresh(), WindowSampler(stream, 16, 0, 0), 2)
    train_state.save_state(str(tmp_path), first)
    first = _run(cfg, opt, step_fn, first, WindowSampler(stream, 16, 0, 0), 1)  # progress after the save is lost
    train_state.save_state(str(tmp_path), _run(cfg, opt, step_fn, fresh(), WindowSampler(stream, 16, 0, 0), 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train_state"]  # replaced, no leftovers
    resumed = train_state.restore_state(str(tmp_path), fresh())
    assert (resumed["step"], resumed["cursor"], resumed["tokens"]) == (2, 4, 64)
    resumed = _run(cfg, opt, step_fn, resumed, WindowSampler(stream, 16, 0, 0), 2)
    for a, b in zip(jax.tree.leaves(straight["params"]) + jax.tree.leaves(straight["opt_state"]),
                    jax.tree.leaves(resumed["params"]) + jax.tree.leaves(resumed["opt_state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_restore_without_state_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no training state"):
        train_state.restore_state(str(tmp_path), {})


@pytest.mark.slow  # CI time; training makes the bundled checkpoint, serving never runs it
def test_blocked_causal_attention_equals_dense_with_gradients():
    from kvjax.training.forward import blocked_causal_attention, causal_attention

    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(2, 40, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 40, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 40, 2, 8)), jnp.float32)
    np.testing.assert_allclose(blocked_causal_attention(q, k, v, 16), causal_attention(q, k, v), atol=1e-5)
    gd = jax.grad(lambda a: jnp.sum(causal_attention(a, k, v) ** 2))(q)
    gb = jax.grad(lambda a: jnp.sum(blocked_causal_attention(a, k, v, 16) ** 2))(q)
    np.testing.assert_allclose(gb, gd, atol=1e-4)
