"""Held-out evaluation of a parameter set on a fixed list of eval batches."""

import jax
import numpy as np
from absl import logging

from decoupled_diloco import models, sharding, transfer
from decoupled_diloco.data import make_iterator
from decoupled_diloco.host_memory import available_host_bytes
from decoupled_diloco.models import flatten_params, unflatten_params
from decoupled_diloco.train.step import make_eval_step

# Batches launched ahead of the ones done. Unbounded, XLA:CPU aborted an evaluation of more
# than ~32 batches on a mesh of several devices ("Termination timeout for all reduce": it
# holds at most 32 programs per device in flight, and a collective's participants queued
# behind others' never met).
IN_FLIGHT = 8

# The peak resident memory of an evaluation on XLA:CPU over its step's planned bytes
# (argument, output and temporaries, per device, times the devices): 1.9 for the tiny model
# at 32 x 5000 tokens on 2 devices (plan 12.7 GiB, peak 24.4 GiB RSS, 2026-11-30).
PEAK_OVER_PLAN = 2.0


class Evaluator:
    """Mean eval cross-entropy per token over the first `num_batches` held-out batches
    (fixed set; at most as many as read the eval split once, where its windows are known in
    advance: rows of the last batch that wrap around to windows already read count 0), or
    over `batches` given with their `row_weights` (per batch, float [B]: how many times each
    row's window counts; default 1)."""

    def __init__(self, model_cfg, data_cfg, mesh, batch_size: int, num_batches: int,
                 batches: list | None = None, row_weights: list | None = None):  # fmt: skip
        if batches is None:
            it = make_iterator(data_cfg, "eval", batch_size=batch_size)
            whole = it.batches_per_epoch
            if whole is not None and num_batches > whole:
                # More would read the same windows again (and hold them all on the host).
                logging.warning(
                    "evaluation reads the eval split's %d batch%s of %d windows once, not the "
                    "%d of train.eval_batches", whole, "" if whole == 1 else "es", batch_size,
                    num_batches,
                )  # fmt: skip
                num_batches = whole
            batches = [next(it) for _ in range(num_batches)]
            row_weights = first_reads(batches, it.windows_per_epoch)
        if row_weights is None:
            row_weights = [np.ones(len(b), np.float32) for b in batches]
        if [np.size(w) for w in row_weights] != [len(b) for b in batches]:
            raise ValueError("row_weights must hold one weight per row of each batch")
        self.batches = batches
        self.row_weights = [np.asarray(w, np.float32) for w in row_weights]
        abstract = models.param_shapes(model_cfg)
        self.param_shardings = sharding.param_shardings(
            abstract, models.param_logical_axes(model_cfg), mesh
        )
        self.flat_shardings = flatten_params(self.param_shardings)
        self.batch_sharding = sharding.batch_sharding(mesh)
        self.row_sharding = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(self.batch_sharding.spec[0])
        )
        self._eval = jax.jit(
            make_eval_step(model_cfg, mesh),
            in_shardings=(self.param_shardings, self.batch_sharding, self.row_sharding),
        )

    def check_host_memory(self, model_cfg) -> None:
        """On XLA:CPU (the host's memory, which the OS, not XLA, runs out of: the process is
        killed without a word), ValueError if one batch's plan (XLA's memory analysis of
        the compiled step, per device, times the devices) exceeds the host's available
        memory. A no-op on accelerators, whose out-of-memory is XLA's own error."""
        if jax.default_backend() != "cpu" or not self.batches:
            return
        abstract = models.param_shapes(model_cfg)
        params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              abstract, self.param_shardings)  # fmt: skip
        widest = max(self.batches, key=lambda b: b.size)
        batch = jax.ShapeDtypeStruct(widest.shape, widest.dtype, sharding=self.batch_sharding)
        rows = jax.ShapeDtypeStruct(widest.shape[:1], np.float32, sharding=self.row_sharding)
        plan = self._eval.lower(params, batch, rows).compile().memory_analysis()
        if plan is None:
            return
        per_device = plan.argument_size_in_bytes + plan.output_size_in_bytes
        need = (per_device + plan.temp_size_in_bytes) * self.batch_sharding.mesh.size
        free = available_host_bytes()
        rows, tokens = widest.shape[0], widest.shape[1] - 1
        what = (f"one evaluation batch ({rows} x {tokens} tokens) needs at least "
                f"{need / 2**30:.1f} GiB of host memory (XLA's plan)")  # fmt: skip
        if free is not None and need > free:
            raise ValueError(f"{what}, more than the {free / 2**30:.1f} GiB available: a "
                             "shorter --config.data.seq_len")  # fmt: skip
        if free is not None and PEAK_OVER_PLAN * need > free:
            logging.warning("%s, and may peak at %.0fx that: %.1f GiB are available", what,
                            PEAK_OVER_PLAN, free / 2**30)  # fmt: skip

    def __call__(self, params) -> float:
        """`params`: nested device params, or a flat dict of host arrays (syncer's Θ)."""
        if isinstance(next(iter(params.values())), np.ndarray):
            params = unflatten_params(transfer.to_device(params, self.flat_shardings))
        losses, counts = [], []
        shardings = {"b": self.batch_sharding, "w": self.row_sharding}
        for b, w in zip(self.batches, self.row_weights, strict=True):
            if not w.any():  # (its weighted mean is 0 / 0)
                continue
            if len(losses) >= IN_FLIGHT:
                losses[-IN_FLIGHT].block_until_ready()
            placed = transfer.to_device({"b": b, "w": w}, shardings)
            losses.append(self._eval(params, placed["b"], placed["w"]))
            counts.append(float(w.sum()))
        host = transfer.to_host({str(i): x for i, x in enumerate(losses)})
        values = [float(host[str(i)]) for i in range(len(losses))]
        return float(np.average(values, weights=counts))


def first_reads(batches: list, windows: int | None) -> list:
    """Row weights of batches read from the start of an epoch of `windows` windows: 1 for
    each window's first read, 0 for rows past the epoch's end (windows read again); all 1
    when the count is unknown (None)."""
    limit = np.inf if windows is None else windows
    weights, seen = [], 0
    for b in batches:
        weights.append((seen + np.arange(len(b)) < limit).astype(np.float32))
        seen += len(b)
    return weights
