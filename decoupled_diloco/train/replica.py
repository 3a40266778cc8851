"""A learner's device replica: its mesh, jitted train step, TrainState and the few device
operations the DiLoCo protocol asks for (fragment copies, shifts and mixes of leaves).

The protocol itself (`diloco/learner.py`) is numpy only; parameter bytes cross between the
two only through `transfer.py`. Train steps donate the state, so fragment copies are taken
by the learner's own thread at a step boundary (`fragment_copies`: on-device copies that
survive the next donation, whose host transfer is started at once).
"""

import jax
import numpy as np

from decoupled_diloco import models, sharding, transfer
from decoupled_diloco.models import flatten_params, unflatten_params
from decoupled_diloco.train import optimizer as optim
from decoupled_diloco.train.step import TrainState, make_train_step


class Replica:
    """Learner state on its own mesh. `state` is None while the learner is down."""

    def __init__(self, model_cfg: models.ModelConfig, train_cfg: optim.TrainConfig, mesh):
        self.model_cfg, self.mesh = model_cfg, mesh
        self.optimizer = optim.make_inner_optimizer(train_cfg)
        schedule = optim.learning_rate_schedule(train_cfg)
        abstract = jax.eval_shape(lambda: models.init_params(model_cfg, jax.random.key(0)))
        self.param_shardings = sharding.param_shardings(
            abstract, models.param_logical_axes(model_cfg), mesh
        )
        self.flat_shardings = flatten_params(self.param_shardings)
        self.batch_sharding = sharding.batch_sharding(mesh)
        opt_abstract = jax.eval_shape(self.optimizer.init, abstract)
        # Optimizer moments follow their parameter's sharding; scalars are replicated.
        self.opt_shardings = _match_shardings(opt_abstract, self.param_shardings, mesh)
        self.state_shardings = TrainState(
            sharding.replicated(mesh), self.param_shardings, self.opt_shardings
        )
        self._train_step = jax.jit(
            make_train_step(model_cfg, self.optimizer, schedule, mesh, train_cfg.microbatches),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, sharding.replicated(mesh)),
            donate_argnums=0,
        )
        self._init_params = jax.jit(
            lambda r: models.init_params(model_cfg, r), out_shardings=self.param_shardings
        )
        self._init_opt = jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)
        self._mix = jax.jit(  # α·a + (1 − α)·b
            lambda a, b, alpha: jax.tree.map(lambda x, y: alpha * x + (1 - alpha) * y, a, b)
        )
        self._add = jax.jit(lambda a, d: jax.tree.map(lambda x, y: x + y, a, d))
        self._copy = jax.jit(lambda a: jax.tree.map(lambda x: x.copy(), a))
        self.state: TrainState | None = None

    # --- state -------------------------------------------------------------------------
    def init_from_rng(self, rng: jax.Array, step: int = 0) -> None:
        """Fresh parameters (the run's starting point) and fresh AdamW state."""
        self._set(self._init_params(rng), step)

    def init_from_host(self, flat: dict[str, np.ndarray], step: int = 0) -> None:
        """Parameters from host arrays (the syncer's snapshot), fresh AdamW state: the old
        moments belong to a model the learner no longer has."""
        self._set(unflatten_params(transfer.to_device(flat, self.flat_shardings)), step)

    def set_params(self, flat: dict[str, np.ndarray]) -> None:
        """Replaces the parameters, keeping AdamW state and step (a resumed learner)."""
        params = unflatten_params(transfer.to_device(flat, self.flat_shardings))
        self.state = self.state._replace(params=params)

    def set_step(self, step: int) -> None:
        """Sets the inner step (the learning-rate schedule's position), keeping the rest."""
        value = jax.device_put(np.int32(step), sharding.replicated(self.mesh))
        self.state = self.state._replace(step=value)

    def _set(self, params, step: int) -> None:
        step = jax.device_put(np.int32(step), sharding.replicated(self.mesh))
        self.state = TrainState(step, params, self._init_opt(params))

    def drop(self) -> None:
        """The slice failed: its device state is gone."""
        self.state = None

    def abstract_state(self) -> TrainState:
        """The TrainState's shapes, dtypes and shardings (what a checkpoint restores onto),
        without allocating it."""
        params = jax.eval_shape(lambda: models.init_params(self.model_cfg, jax.random.key(0)))
        state = TrainState(
            jax.ShapeDtypeStruct((), np.int32), params, jax.eval_shape(self.optimizer.init, params)
        )
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            state,
            self.state_shardings,
        )

    def host_params(self) -> dict[str, np.ndarray]:
        return transfer.to_host(flatten_params(self.state.params))

    @staticmethod
    def to_host(copies: dict[str, jax.Array]) -> dict[str, np.ndarray]:
        """Host arrays of `fragment_copies` (waits for their transfer)."""
        return transfer.to_host(copies)

    # --- steps and protocol operations -------------------------------------------------
    def step(self, batch: np.ndarray) -> dict:
        """One inner step; returns its metrics as device scalars (fetch when needed)."""
        batch = transfer.to_device({"b": batch}, {"b": self.batch_sharding})["b"]
        self.state, metrics = self._train_step(self.state, batch)
        return metrics

    def ready(self) -> None:
        """Blocks until every dispatched step has finished on the device."""
        jax.block_until_ready(self.state)

    def fragment_copies(self, names) -> dict[str, jax.Array]:
        """Device copies of the named leaves (they survive the next donating step), with
        their host transfer already started."""
        flat = flatten_params(self.state.params)
        copies = self._copy({k: flat[k] for k in names})
        transfer.start_to_host(copies)
        return copies

    def apply(self, kind: str, arrays: dict[str, np.ndarray], alpha: float = 0.0) -> None:
        """θ ← θ + x ("add") or θ ← α·θ + (1 − α)·x ("mix") for the named leaves."""
        flat = flatten_params(self.state.params)
        x = transfer.to_device(arrays, {k: self.flat_shardings[k] for k in arrays})
        mine = {k: flat[k] for k in x}
        if kind == "add":
            flat.update(self._add(mine, x))
        elif alpha:
            flat.update(self._mix(mine, x, alpha))
        else:
            flat.update(x)
        self.state = self.state._replace(params=unflatten_params(flat))


def _match_shardings(opt_abstract, param_shardings, mesh):
    """Gives each optimizer leaf stored per parameter (Adam moments) that parameter's sharding.

    optax nests the moments as copies of the param tree inside its own state tuples, so a
    leaf is matched by the longest suffix of its path that names a parameter.
    """
    by_name = flatten_params(param_shardings)

    def pick(path, leaf):
        keys = [str(k.key) for k in path if hasattr(k, "key")]
        for start in range(len(keys)):
            name = "/".join(keys[start:])
            if name in by_name:
                return by_name[name]
        return sharding.replicated(mesh)

    return jax.tree_util.tree_map_with_path(pick, opt_abstract)
