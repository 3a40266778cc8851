"""Held-out evaluation of a parameter set on a fixed list of eval batches."""

import jax
import numpy as np
from absl import logging

from decoupled_diloco import models, sharding, transfer
from decoupled_diloco.data import make_iterator
from decoupled_diloco.models import flatten_params, unflatten_params
from decoupled_diloco.train.step import make_eval_step

# Batches launched ahead of the ones done. Unbounded, XLA:CPU aborted an evaluation of more
# than ~32 batches on a mesh of several devices ("Termination timeout for all reduce": it
# holds at most 32 programs per device in flight, and a collective's participants queued
# behind others' never met).
IN_FLIGHT = 8


class Evaluator:
    """Mean eval cross-entropy over the first `num_batches` held-out batches (fixed set; at
    most as many as read the eval split once, where its windows are known in advance), or
    over `batches` given with their `weights` (how many distinct windows each stands for)."""

    def __init__(self, model_cfg, data_cfg, mesh, batch_size: int, num_batches: int,
                 batches: list | None = None, weights: list | None = None):  # fmt: skip
        if batches is None:
            it = make_iterator(data_cfg, "eval", batch_size=batch_size)
            whole = it.batches_per_epoch
            if whole is not None and num_batches > whole:
                # More would read the same windows again (and hold them all on the host).
                logging.warning(
                    "evaluation reads the eval split's %d batches of %d windows once, not the "
                    "%d of train.eval_batches", whole, batch_size, num_batches,
                )  # fmt: skip
                num_batches = whole
            batches = [next(it) for _ in range(num_batches)]
        self.batches, self.weights = batches, weights
        abstract = models.param_shapes(model_cfg)
        self.param_shardings = sharding.param_shardings(
            abstract, models.param_logical_axes(model_cfg), mesh
        )
        self.flat_shardings = flatten_params(self.param_shardings)
        self.batch_sharding = sharding.batch_sharding(mesh)
        self._eval = jax.jit(
            make_eval_step(model_cfg, mesh),
            in_shardings=(self.param_shardings, self.batch_sharding),
        )

    def __call__(self, params) -> float:
        """`params`: nested device params, or a flat dict of host arrays (syncer's Θ)."""
        if isinstance(next(iter(params.values())), np.ndarray):
            params = unflatten_params(transfer.to_device(params, self.flat_shardings))
        losses = []
        for b in self.batches:
            if len(losses) >= IN_FLIGHT:
                losses[-IN_FLIGHT].block_until_ready()
            batch = transfer.to_device({"b": b}, {"b": self.batch_sharding})["b"]
            losses.append(self._eval(params, batch))
        host = transfer.to_host({str(i): x for i, x in enumerate(losses)})
        values = [float(host[str(i)]) for i in range(len(losses))]
        if self.weights is None:
            return float(np.mean(values))
        return float(np.average(values, weights=self.weights))
