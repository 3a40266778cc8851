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

# The peak resident memory of an evaluation on XLA:CPU over its step's planned bytes
# (argument, output and temporaries, per device, times the devices): 1.9 for the tiny model
# at 32 x 5000 tokens on 2 devices (plan 12.7 GiB, peak 24.4 GiB RSS, 2026-11-30).
PEAK_OVER_PLAN = 2.0


def available_host_bytes(root: str = "/") -> int | None:
    """The host memory this process may still use, or None if unknown: Linux's MemAvailable,
    or less where the process's memory cgroup (a container's `--memory`) leaves less."""
    free = [int(n) * 1024 for n in _fields(root + "proc/meminfo", "MemAvailable:")]
    headroom = cgroup_headroom(root)
    if headroom is not None:
        free.append(headroom)
    return min(free, default=None)


def cgroup_headroom(root: str = "/") -> int | None:
    """Bytes left under the memory limit of this process's cgroup (v2 `memory.max`, v1
    `memory.limit_in_bytes`) above its usage, counting inactive page cache (which the kernel
    reclaims first) as free; None without a limit."""
    try:
        with open(root + "proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        if controllers == "":  # v2: the unified hierarchy
            folder, names = f"{root}sys/fs/cgroup{path}", ("memory.max", "memory.current")
            cache = "inactive_file"
        elif "memory" in controllers.split(","):
            folder = f"{root}sys/fs/cgroup/memory{path}"
            names, cache = ("memory.limit_in_bytes", "memory.usage_in_bytes"), "total_inactive_file"
        else:
            continue
        for where in (folder.rstrip("/"), folder[: len(folder) - len(path)].rstrip("/")):
            # (In a container's cgroup namespace its own group is the mount's root.)
            values = [_read_int(f"{where}/{name}") for name in names]
            if None in values:
                continue
            limit, usage = values
            if limit >= 2**60:  # "max", or v1's page-rounded 2**63
                break
            inactive = sum(int(n) for n in _fields(f"{where}/memory.stat", cache + " "))
            return max(limit - usage + inactive, 0)
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return 2**63 if text == "max" else int(text) if text.isdigit() else None


def _fields(path: str, prefix: str) -> list[str]:
    """The first value of each line of `path` starting with `prefix` ([] if unreadable)."""
    try:
        with open(path) as f:
            return [line.split()[1] for line in f if line.startswith(prefix)]
    except OSError:
        return []


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
                    "evaluation reads the eval split's %d batches of %d windows once, not the "
                    "%d of train.eval_batches", whole, batch_size, num_batches,
                )  # fmt: skip
                num_batches = whole
            batches = [next(it) for _ in range(num_batches)]
            row_weights = first_reads(batches, it.windows_per_epoch)
        if row_weights is None:
            row_weights = [np.ones(len(b), np.float32) for b in batches]
        if [len(w) for w in row_weights] != [len(b) for b in batches]:
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
