"""One jitted optimizer step over a large batch of windows, optionally accumulated over micro-batches.

The batch arrives as i32[M, b, T + 1]: M micro-batches of b windows. Gradients of the M micro-batches are summed
in a `lax.scan` (so peak memory is one micro-batch's activations) and applied once. Params and optimizer state
are donated, so XLA updates them in place; the loss stays on the device until the caller asks for it.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from kvjax.models.llama.config import ModelConfig
from kvjax.training.forward import next_token_loss


def make_optimizer(lr: float, warmup: int, steps: int, weight_decay: float = 0.1,
                   clip: float = 1.0) -> optax.GradientTransformation:
    """AdamW with warm-up then cosine decay to 5% of `lr` over `steps` optimizer steps, global-norm clipping."""
    warmup = max(1, min(warmup, steps // 4 if steps >= 4 else 1))
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(sched, b1=0.9, b2=0.95,
                                                                       weight_decay=weight_decay))


def make_train_step(config: ModelConfig, opt: optax.GradientTransformation,
                    loss_fn: Callable = next_token_loss) -> Callable:
    """`step(params, opt_state, windows i32[M, b, T + 1]) -> (params, opt_state, mean loss f32[])`, jitted."""
    grad_fn = jax.value_and_grad(lambda p, w: loss_fn(p, config, w))

    def step(params, opt_state, windows):
        if windows.shape[0] == 1:
            loss, grads = grad_fn(params, windows[0])
        else:
            def accumulate(carry, micro):
                loss_sum, grad_sum = carry
                loss, grads = grad_fn(params, micro)
                return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), windows)
            m = windows.shape[0]
            loss = loss / m
            grads = jax.tree.map(lambda g: g / m, grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))
