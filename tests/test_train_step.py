"""Inner optimizer (schedule, decay mask, clipping) and the pure train step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decoupled_diloco import models
from decoupled_diloco.train.optimizer import (
    TrainConfig,
    learning_rate_schedule,
    make_inner_optimizer,
    state_learning_rate,
)
from decoupled_diloco.train.step import TrainState, init_train_state, loss_fn, make_train_step


def batch_of(cfg, batch=8, seq=32, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, cfg.vocab_size, size=(batch, seq + 1), dtype=np.int32))


# --- learning-rate schedule ------------------------------------------------------------------


def test_schedule_warms_up_then_cosine_decays_to_min():
    peak, ratio = 1e-2, 0.1
    schedule = learning_rate_schedule(
        TrainConfig(steps=100, warmup_steps=10, learning_rate=peak, min_lr_ratio=ratio)
    )
    lr = np.array([float(schedule(t)) for t in range(121)])
    # Linear warmup that already learns at step 0 and reaches the peak at its last step.
    np.testing.assert_allclose(lr[:10], peak * np.arange(1, 11) / 10, rtol=1e-6)
    assert lr[0] > 0
    assert lr.max() == pytest.approx(peak) and lr[10] == pytest.approx(peak)
    assert np.all(np.diff(lr[10:101]) < 0)  # strictly decaying after the peak
    # Cosine: halfway through the decay the lr is halfway between peak and floor.
    assert lr[55] == pytest.approx(peak * (ratio + (1 - ratio) / 2), rel=1e-5)
    assert lr[100] == pytest.approx(ratio * peak, rel=1e-5)
    np.testing.assert_allclose(lr[100:], ratio * peak, rtol=1e-5)  # floor after the end


def test_schedule_without_warmup_starts_at_peak():
    cfg = TrainConfig(steps=50, warmup_steps=0, learning_rate=3e-3, min_lr_ratio=0.2)
    schedule = learning_rate_schedule(cfg)
    assert float(schedule(0)) == pytest.approx(3e-3)
    assert float(schedule(50)) == pytest.approx(0.2 * 3e-3, rel=1e-5)


# --- AdamW details ---------------------------------------------------------------------------


def test_weight_decay_skips_1d_params():
    cfg = models.get_model_config("tiny")
    params = models.init_params(cfg, jax.random.key(0))
    # Norm scales start at 0 (a no-op for decay): move every leaf away from 0 first.
    params = jax.tree.map(lambda p: p + 0.5, params)
    train_cfg = TrainConfig(warmup_steps=0, learning_rate=1e-2, weight_decay=0.5)
    optimizer = make_inner_optimizer(train_cfg)
    # With zero gradients Adam's own update is 0, so only the decoupled decay moves params.
    zeros = jax.tree.map(jnp.zeros_like, params)
    # Jitted: one compile instead of many tiny eager ones.
    update = jax.jit(
        lambda g, p: optax.apply_updates(p, optimizer.update(g, optimizer.init(p), p, step=0)[0])
    )
    new = update(zeros, params)
    shrink = 1 - train_cfg.learning_rate * train_cfg.weight_decay
    ndims = set()
    for p, q in zip(jax.tree.leaves(params), jax.tree.leaves(new), strict=True):
        ndims.add(p.ndim)
        expected = p if p.ndim == 1 else p * shrink
        np.testing.assert_allclose(q, expected, rtol=1e-6, atol=1e-7)
    assert {1, 2, 3} <= ndims  # norm scales, matrices and head-shaped tensors all checked


def adam_first_moment_norm(opt_state):
    (adam,) = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    return float(optax.tree.norm(adam.mu))


@pytest.mark.parametrize("grad_clip", [1.0, 0.25])
def test_grad_clipping_caps_what_adam_sees(grad_clip):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(8, 8)), jnp.float32), "b": jnp.zeros(8)}
    grads = jax.tree.map(lambda p: jnp.asarray(1e3 * rng.normal(size=p.shape), p.dtype), params)
    assert float(optax.tree.norm(grads)) > 100 * grad_clip

    def first_moment_norm(clip):
        train_cfg = TrainConfig(grad_clip=clip, b1=0.9)
        optimizer = make_inner_optimizer(train_cfg)
        _, state = jax.jit(optimizer.update)(grads, optimizer.init(params), params, step=0)
        return adam_first_moment_norm(state) / (1 - train_cfg.b1)  # = ‖gradient fed to Adam‖

    assert first_moment_norm(grad_clip) == pytest.approx(grad_clip, rel=1e-5)
    assert first_moment_norm(0.0) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-5)
    # Small gradients pass through untouched.
    small = jax.tree.map(lambda g: g * (0.5 * grad_clip / float(optax.tree.norm(grads))), grads)
    optimizer = make_inner_optimizer(TrainConfig(grad_clip=grad_clip))
    _, state = jax.jit(optimizer.update)(small, optimizer.init(params), params, step=0)
    assert adam_first_moment_norm(state) / 0.1 == pytest.approx(0.5 * grad_clip, rel=1e-4)


def test_lr_follows_the_step_passed_to_update_and_ramps_a_fresh_state():
    peak, warmup = 1e-2, 100
    params = {"w": jnp.arange(1.0, 7.0).reshape(2, 3)}
    grads = {"w": jnp.full((2, 3), 0.5)}
    for fresh_warmup in (0, -1, 10):
        train_cfg = TrainConfig(steps=1000, warmup_steps=warmup, learning_rate=peak,
                                weight_decay=0.0, fresh_warmup_steps=fresh_warmup)  # fmt: skip
        schedule = learning_rate_schedule(train_cfg)
        optimizer = make_inner_optimizer(train_cfg)
        update = jax.jit(optimizer.update)
        fresh = optimizer.init(params)
        W = warmup if fresh_warmup < 0 else fresh_warmup
        for step in (0, 5, 50, 500):
            # Adam's first (bias-corrected) step is sign(g): the update is -lr per entry, the
            # schedule at the step, ramped as a state that has taken no update yet.
            ramp = 1.0 if W == 0 else min(1.0, (1 / W) / min(1.0, (step + 1) / W))
            updates, _ = update(grads, fresh, params, step=step)
            np.testing.assert_allclose(updates["w"], -float(schedule(step)) * ramp, rtol=1e-5)
    with pytest.raises(ValueError, match="step=train_state.step"):
        optimizer.update(grads, fresh, params)


# --- train step ------------------------------------------------------------------------------


def test_train_steps_reduce_loss_on_a_fixed_batch():
    cfg = models.get_model_config("tiny")
    train_cfg = TrainConfig(steps=20, warmup_steps=2, learning_rate=1e-2)
    optimizer = make_inner_optimizer(train_cfg)
    schedule = learning_rate_schedule(train_cfg)
    step = jax.jit(make_train_step(cfg, optimizer, state_learning_rate(train_cfg)))
    state = init_train_state(cfg, optimizer, jax.random.key(0))
    batch = batch_of(cfg)
    losses = []
    for t in range(10):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        assert float(metrics["learning_rate"]) == pytest.approx(float(schedule(t)))
        assert float(metrics["total_loss"]) == float(metrics["loss"])  # dense: no aux loss
        assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
    assert int(state.step) == 10
    assert losses[0] == pytest.approx(np.log(cfg.vocab_size), abs=0.3)
    assert losses[-1] < losses[0] - 0.3, losses


@functools.partial(jax.jit, static_argnums=0)
def loss_and_grads(cfg, params, batch):
    """(total, ce, aux), ∂total/∂params and ∂ce/∂params."""
    (total, (ce, aux)), g_total = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)(
        cfg, params, batch
    )
    g_ce = jax.grad(lambda p: loss_fn(cfg, p, batch)[1][0])(params)
    return (total, ce, aux), g_total, g_ce


def test_moe_aux_loss_is_added_to_the_training_loss():
    cfg = models.get_model_config("tiny_moe")
    params = models.init_params(cfg, jax.random.key(0))
    (total, ce, aux), g_total, g_ce = loss_and_grads(cfg, params, batch_of(cfg))
    aux_loss = float(aux["moe_aux_loss"])
    assert aux_loss > 0
    assert float(total) == pytest.approx(float(ce) + aux_loss, rel=1e-6)
    # Weighted sum over the MoE layers of the per-layer router losses.
    per_layer = (
        cfg.load_balance_weight * aux["load_balance_loss"]
        + cfg.router_z_weight * aux["router_z_loss"]
    )
    assert aux_loss == pytest.approx(cfg.num_moe_layers * float(per_layer), rel=1e-5)
    # The aux loss is differentiated too: it pulls on the routers beyond the LM loss.
    for layer in range(cfg.num_layers):
        router_total = g_total[f"block_{layer}"]["moe"]["router"]
        router_ce = g_ce[f"block_{layer}"]["moe"]["router"]
        assert float(jnp.abs(router_total - router_ce).max()) > 1e-6


def test_a_fresh_optimizer_state_at_step_500_ramps_up_to_lr_500_and_an_old_one_does_not():
    """A learner that rejoins at step 500 resets AdamW (optimizer.init) but keeps its step: it
    follows the schedule from lr(500), not from the start of warmup again, ramped over the
    first `fresh_warmup_steps` updates of its new state. A state as old as the run trains at
    the schedule exactly."""
    cfg = models.get_model_config("tiny")
    train_cfg = TrainConfig(steps=1000, warmup_steps=100, learning_rate=1e-2, weight_decay=0.0,
                            grad_clip=0.0, fresh_warmup_steps=4)  # fmt: skip
    optimizer = make_inner_optimizer(train_cfg)
    schedule = learning_rate_schedule(train_cfg)
    step = jax.jit(make_train_step(cfg, optimizer, state_learning_rate(train_cfg)))
    params = models.init_params(cfg, jax.random.key(0))
    batch = batch_of(cfg)
    for at in (0, 500):
        state = TrainState(jnp.asarray(at, jnp.int32), params, optimizer.init(params))
        for i in range(6):
            new, metrics = step(state, batch)
            assert int(new.step) == at + i + 1
            ramp = 1.0 if at == 0 else min(1.0, (i + 1) / 4)
            assert float(metrics["learning_rate"]) == pytest.approx(
                float(schedule(at + i)) * ramp, rel=1e-6
            )
            if i == 0:  # first Adam step: each entry moves by lr · |g| / (|g| + eps) ≈ lr
                moved = max(
                    float(jnp.max(jnp.abs(a - b)))
                    for a, b in zip(jax.tree.leaves(new.params),
                                    jax.tree.leaves(state.params), strict=True)
                )  # fmt: skip
                assert moved == pytest.approx(float(metrics["learning_rate"]), rel=1e-3)
            state = new
    assert schedule(0) > 0 and schedule(500) > 5 * schedule(0)
