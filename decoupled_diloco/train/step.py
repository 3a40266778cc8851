"""Pure train and eval steps of one learner (jitted by the caller with its shardings)."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from decoupled_diloco import models
from decoupled_diloco.sharding import constraint_mesh


class TrainState(NamedTuple):
    """A learner's device state. `params` is the plain nested dict of `models.init_params`."""

    step: jax.Array  # int32 scalar: inner steps taken
    params: Any
    opt_state: Any


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return nll_BT.mean()


def loss_fn(model_cfg: models.ModelConfig, params, batch_BT1: jax.Array):
    """Returns (training loss incl. MoE auxiliary losses, (cross-entropy, aux dict))."""
    inputs_BT, targets_BT = batch_BT1[:, :-1], batch_BT1[:, 1:]
    logits_BTV, aux = models.forward(model_cfg, params, inputs_BT)
    ce = cross_entropy(logits_BTV, targets_BT)
    total = ce + aux.get("moe_aux_loss", 0.0)
    return total, (ce, aux)


def init_train_state(model_cfg, optimizer: optax.GradientTransformation, rng) -> TrainState:
    params = models.init_params(model_cfg, rng)
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))


def make_train_step(
    model_cfg,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    mesh: jax.sharding.Mesh | None = None,
):
    """(state, batch [B, T+1] int32) -> (new state, metrics dict of scalars).

    The optimizer's update receives `step=state.step`, so the lr is `schedule(state.step)`
    (`make_inner_optimizer` reads it there) however old the optimizer state is; "learning_rate"
    logs that value. With `mesh`, jit the step with shardings on that mesh: the model then
    also shards its activations by the rules table (MoE expert parallelism needs this).
    """
    optimizer = optax.with_extra_args_support(optimizer)  # plain optax ignores `step`

    def train_step(state: TrainState, batch_BT1: jax.Array):
        with constraint_mesh(mesh):
            grad_fn = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)
            (total, (ce, aux)), grads = grad_fn(model_cfg, state.params, batch_BT1)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params, step=state.step)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": ce,
            "total_loss": total,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": schedule(state.step),
        }
        for k, v in aux.items():
            metrics[k] = v
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def make_eval_step(model_cfg, mesh: jax.sharding.Mesh | None = None):
    """(params, batch [B, T+1]) -> mean cross-entropy of the batch. `mesh` as in train."""

    def eval_step(params, batch_BT1):
        with constraint_mesh(mesh):
            return loss_fn(model_cfg, params, batch_BT1)[1][0]

    return eval_step
