"""Inner optimizer: AdamW with linear warmup, cosine decay and global-norm clipping.

The learning rate is a function of the learner's step (`TrainState.step`), passed to every
update as `optimizer.update(grads, opt_state, params, step=step)`, not of a counter inside
the optimizer state. A learner that resets its AdamW state (rejoining after a crash, or
restarting from Θ after a NaN) at step 500 therefore follows the run's schedule from
lr(500), not from the start of warmup again. A fresh state can be warmed up (Adam's first
bias-corrected updates are about sign(g), moving every coordinate by the full lr): with
W = `fresh_warmup_steps` > 0 (-1: `warmup_steps`), an optimizer state that has taken n < W
updates trains at lr(step) · min(1, ramp(n) / ramp(step)), ramp(t) = min(1, (t + 1) / W).
For a state as old as the run (n = step) the factor is exactly 1: the plain schedule. Off
by default: with four crash-rejoins in a 300-step tiny_decoupled run it measured the same
(eval 1.5407 with W = 30 against 1.5393 without, 2 seeds; experiments/README.md, 10).
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The `train.*` config section: inner (per-learner) training, evaluation, logging."""

    steps: int = 200  # inner steps per learner
    batch_size: int = 32  # sequences per inner step per learner
    # Gradient accumulation: each inner step runs its batch as this many equal microbatches
    # (batch_size / microbatches sequences each) and applies their mean gradient once, so
    # activation memory shrinks and the math stays the step's; steps, H and tau still
    # count inner steps (train/step.py). 1 = no accumulation.
    microbatches: int = 1
    learning_rate: float = 3e-3  # peak inner AdamW lr
    warmup_steps: int = 20  # linear warmup steps
    # Steps over which a fresh AdamW state (a rejoin after a crash, a restart after a NaN)
    # ramps up to the schedule's lr (module docstring); -1: warmup_steps, 0: none.
    fresh_warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decays to this fraction of the peak lr
    weight_decay: float = 0.1  # decoupled AdamW weight decay (matrices only)
    b1: float = 0.9  # Adam beta1
    b2: float = 0.95  # Adam beta2
    eps: float = 1e-8  # Adam epsilon
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    eval_every: int = 50  # steps between evaluations; 0 = only at the end
    eval_batches: int = 8  # held-out batches per evaluation
    log_every: int = 10  # steps between metrics.jsonl lines / progress updates
    checkpoint_every: int = 100  # steps between orbax checkpoints; 0 = only at the end
    # The most share of a learner's time its periodic checkpoints may take: a save of s
    # seconds (synchronous: the learner's device idles meanwhile) is followed by at least
    # s·(1/checkpoint_duty − 1) seconds of steps (counted in steps, alike on every host) before
    # the next; one that falls due sooner is taken at the first step after that
    # (runtime/save_schedule.py). 1 = every checkpoint_every steps as due:
    # the default, since a data-parallel job falls back to its last save; learners with a
    # syncer rejoin from Θ and save for a resume only (config.set_decoupled: 0.1).
    checkpoint_duty: float = 1.0
    # Batches a background thread reads and places on the devices ahead of the step that
    # trains on them (data/prefetch.py); 0 = read and transfer inside the step.
    prefetch: int = 2
    # Steps a learner dispatches before it reads a step's metrics (loss, NaN check) on the
    # host: the device keeps this many steps queued while the host works, so a host hiccup
    # shorter than that many steps idles nothing (runtime/learner_loop.py). A NaN is seen
    # this many steps late (the learner then restarts from Θ). The learner's step count runs
    # that far ahead of its device, so a merge of an offer made at step s has only about
    # diloco.overlap − metrics_lag device steps to come back before boundary s + τ (later
    # ones are applied later: staler): raise it only with τ > metrics_lag. >= 1.
    metrics_lag: int = 1
    # Also write the metrics rows as TensorBoard event files (no TensorFlow needed) under
    # <workdir>/tensorboard/{learner_<m>,global}/ (decoupled_diloco/tensorboard_events.py).
    tensorboard: bool = True
    seed: int = 0  # model init; the run's `seed` unless set


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """lr at inner step t (0-based): linear warmup peak * (t + 1) / warmup_steps for
    t < warmup_steps (step 0 already learns; the last warmup step reaches the peak), then
    cosine decay from the peak to `min_lr_ratio * learning_rate` at step `steps` (constant
    after). Without warmup, step 0 runs at the peak."""
    warmup = max(cfg.warmup_steps, 0)
    decay_steps = max(cfg.steps - warmup, 1)
    cosine = optax.cosine_decay_schedule(cfg.learning_rate, decay_steps, alpha=cfg.min_lr_ratio)
    if warmup == 0:
        return cosine

    def linear_warmup(step):
        return cfg.learning_rate * (step + 1) / warmup

    return optax.join_schedules([linear_warmup, cosine], boundaries=[warmup])


def fresh_warmup(cfg: TrainConfig) -> int:
    """W of the fresh-state ramp (module docstring)."""
    return cfg.warmup_steps if cfg.fresh_warmup_steps < 0 else cfg.fresh_warmup_steps


def learning_rate(cfg: TrainConfig, step, count):
    """The lr of an update at `step` by an optimizer state that has taken `count` updates:
    the schedule, ramped while the state is fresh (module docstring)."""
    lr = learning_rate_schedule(cfg)(step)
    warmup = fresh_warmup(cfg)
    if warmup <= 0:
        return lr

    def ramp(t):
        return jnp.minimum(1.0, (jnp.asarray(t, jnp.float32) + 1.0) / warmup)

    return lr * jnp.minimum(1.0, ramp(count) / ramp(step))


def state_learning_rate(cfg: TrainConfig):
    """(step, opt_state) -> the lr an update from that state trains at (what steps log)."""
    return lambda step, opt_state: learning_rate(cfg, step, updates_done(opt_state))


_ADAM = 1  # scale_by_adam's place in make_inner_optimizer's chain (its state has `count`)


def updates_done(opt_state) -> jax.Array:
    """Updates the inner optimizer's state has taken (Adam's count; 0 for a fresh state)."""
    return opt_state[_ADAM].count


def scale_by_step_schedule(cfg: TrainConfig) -> optax.GradientTransformationExtraArgs:
    """Multiplies updates by -learning_rate(cfg, step, count); both are keyword arguments of
    `update` (`make_inner_optimizer` passes `count`; without it the state counts as old)."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, step=None, count=None, **extra_args):
        del params, extra_args
        if step is None:
            raise ValueError(
                "the inner optimizer's learning rate follows the learner's step: call "
                "optimizer.update(grads, opt_state, params, step=train_state.step)"
            )
        lr = learning_rate(cfg, step, step if count is None else count)
        return jax.tree.map(lambda u: -lr * u, updates), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _decay_mask(params):
    # Norm scales (1-D) are not decayed: decaying them pulls (1 + scale) towards 1,
    # which is a prior on the norm, not a regulariser on the weights.
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_inner_optimizer(cfg: TrainConfig) -> optax.GradientTransformationExtraArgs:
    """AdamW as used by DiLoCo's inner loop (clip → Adam → decoupled weight decay → lr).

    Same math as `optax.adamw` with the schedule of `learning_rate_schedule(cfg)`, except
    that the lr is read at the `step` passed to `update`, and ramped for a fresh state when
    `fresh_warmup_steps` != 0 (see the module docstring).
    """
    chain = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(),
        optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
        optax.add_decayed_weights(cfg.weight_decay, mask=_decay_mask),
        scale_by_step_schedule(cfg),
    )  # scale_by_adam at _ADAM
    if fresh_warmup(cfg) <= 0:
        return chain

    def update_fn(updates, state, params=None, **extra_args):
        # The state's age, read before this update: the fresh-state ramp's n.
        return chain.update(updates, state, params, count=updates_done(state), **extra_args)

    return optax.GradientTransformationExtraArgs(chain.init, update_fn)
