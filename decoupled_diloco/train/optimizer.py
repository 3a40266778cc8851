"""Inner optimizer: AdamW with linear warmup, cosine decay and global-norm clipping."""

import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Inner (per-learner) training hyper-parameters; see `decoupled_diloco/config.py`."""

    steps: int = 200
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 10
    checkpoint_every: int = 100
    uptime_window: float = 2.0
    seed: int = 0


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to `learning_rate`, then cosine decay to `min_lr_ratio *
    learning_rate` at step `steps` (constant after). Without warmup, step 0 runs at the peak."""
    warmup = max(cfg.warmup_steps, 0)
    decay_steps = max(cfg.steps - warmup, 1)
    cosine = optax.cosine_decay_schedule(cfg.learning_rate, decay_steps, alpha=cfg.min_lr_ratio)
    if warmup == 0:
        return cosine
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.learning_rate, warmup), cosine], boundaries=[warmup]
    )


def _decay_mask(params):
    # Norm scales (1-D) are not decayed: decaying them pulls (1 + scale) towards 1,
    # which is a prior on the norm, not a regulariser on the weights.
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_inner_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW as used by DiLoCo's inner loop (clip → Adam → decoupled weight decay)."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(),
        optax.adamw(
            learning_rate=learning_rate_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=_decay_mask,
        ),
    )
