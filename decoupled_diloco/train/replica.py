"""A learner's device replica: its mesh, jitted train step, TrainState and the few device
operations the DiLoCo protocol asks for (fragment copies, shifts and mixes of leaves; the
jitted ops themselves are `fragment_ops.py`'s).

The protocol itself (`diloco/learner.py`) is numpy only; parameter bytes cross between the
two only through `transfer.py`. Train steps donate the state, so fragment copies are taken
by the learner's own thread at a step boundary (`fragment_copies`: on-device copies that
survive the next donation, whose host transfer is started at once).
"""

import concurrent.futures
import functools
import math
import os
import threading
import time

import jax
import numpy as np
from absl import logging

from decoupled_diloco import models, sharding, transfer
from decoupled_diloco.diloco.fragment_members import parse_member
from decoupled_diloco.models import flatten_params, unflatten_params
from decoupled_diloco.train import fragment_ops as ops
from decoupled_diloco.train import optimizer as optim
from decoupled_diloco.train.step import TrainState, make_train_step

# (Device ids, a fragment's members) -> the lock of `Replica.precompile`'s compile of it.
_PRECOMPILING: dict[tuple, threading.Lock] = {}


class Replica:
    """Learner state on its own mesh. `state` is None while the learner is down."""

    def __init__(self, model_cfg: models.ModelConfig, train_cfg: optim.TrainConfig, mesh):
        self.model_cfg, self.mesh = model_cfg, mesh
        self.batch_size = train_cfg.batch_size  # the global batch, over the learner's hosts
        self.optimizer = optim.make_inner_optimizer(train_cfg)
        learning_rate = optim.state_learning_rate(train_cfg)
        abstract = models.param_shapes(model_cfg)
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
        self._train_step = ops.launch(
            make_train_step(model_cfg, self.optimizer, learning_rate, mesh, train_cfg.microbatches),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, sharding.replicated(mesh)),
            donate_argnums=0,
        )
        self._init_params = jax.jit(
            lambda r: models.init_params(model_cfg, r), out_shardings=self.param_shardings
        )
        self._init_opt = jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)
        self._row_updates: dict = {}  # leaf -> jitted update of a row slice of it
        # A merge op's weight (α or 1 − α) goes in as a float32 scalar on the mesh, placed
        # explicitly (`_weight`): a Python float argument is an implicit host transfer, which
        # `jax.transfer_guard("disallow")` refuses. Its shape for `precompile`'s lowerings:
        self._weight_abstract = jax.ShapeDtypeStruct(
            (), np.float32, sharding=sharding.replicated(mesh)
        )
        self._weights: dict[float, jax.Array] = {}  # weight -> its placed scalar
        self._flat_abstract = flatten_params(abstract)  # leaf -> shape and dtype
        # Members of a fragment -> its background `precompile`, until a copy or update of
        # the fragment waits for it.
        self._compiling: dict[frozenset, concurrent.futures.Future] = {}
        self._precompiled = None  # what the last `precompile` compiled
        # Per thread (`.seconds`): how long its protocol ops waited for their fragment's
        # background compile (`compile_waited`).
        self._compile_waits = threading.local()
        self.state: TrainState | None = None
        # Member name -> R, the steps since an offer that a landing set aside (`land`): the
        # learner's parameters in the protocol's sense are θ + R. Empty unless
        # `diloco.apply` is "land"; reset with the parameters.
        self.held: dict[str, jax.Array] = {}

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
        self.held = {}

    def set_step(self, step: int) -> None:
        """Sets the inner step (the learning-rate schedule's position), keeping the rest."""
        value = jax.device_put(np.int32(step), sharding.replicated(self.mesh))
        self.state = self.state._replace(step=value)

    def _set(self, params, step: int) -> None:
        step = jax.device_put(np.int32(step), sharding.replicated(self.mesh))
        self.state = TrainState(step, params, self._init_opt(params))
        self.held = {}

    def drop(self) -> None:
        """The slice failed: its device state is gone."""
        self.state = None
        self.held = {}

    def abstract_state(self) -> TrainState:
        """The TrainState's shapes, dtypes and shardings (what a checkpoint restores onto),
        without allocating it."""
        params = models.param_shapes(self.model_cfg)
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
        """Host arrays of `fragment_copies` (waits for their transfer), read-only: an offer
        only reads them (`diloco.learner.materialize`)."""
        return transfer.to_host(copies, readonly=True)

    # --- steps and protocol operations -------------------------------------------------
    def put_batch(self, batch: np.ndarray) -> jax.Array:
        """This host's rows of a batch [B / hosts, T + 1] (all of it on one host) placed
        as the global batch with the step's batch sharding (transfer.batch_to_device)."""
        return transfer.batch_to_device(batch, self.batch_sharding, self.batch_size)

    def place(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host fragment members placed with their parameters' shardings (a merge staged
        ahead); a row slice takes its leaf's (diloco/fragment_members.py)."""
        return transfer.to_device(arrays, {k: self._member_sharding(k) for k in arrays})

    def rebase_delta(self, new: dict, anchor: dict, sent: dict | None) -> dict:
        """x = Θ_new − G + v̂ (v̂ None: Θ_new − G) on the devices, from arrays `place`d
        there; bit for bit `diloco.updates.rebase_delta` of their host values (but for
        subnormals, which XLA may flush to zero)."""
        self._await_precompiled(new)
        if sent is None:
            return ops.rebase_shift(new, anchor)
        return ops.rebase_held(new, anchor, sent)

    def _member_sharding(self, name: str) -> jax.sharding.Sharding:
        leaf, rows = parse_member(name)
        target = self.flat_shardings[leaf]
        return target if rows is None else _rows_sharding(target, rows.stop - rows.start)

    def step(self, batch) -> dict:
        """One inner step on a host batch or one `put_batch` placed; returns its metrics as
        device scalars (fetch when needed)."""
        if not isinstance(batch, jax.Array):
            batch = self.put_batch(batch)
        self.state, metrics = self._train_step(self.state, batch)
        return metrics

    def ready(self) -> None:
        """Blocks until every dispatched step has finished on the device."""
        jax.block_until_ready(self.state)

    def precompile(self, fragments, kinds, alpha: float, background: bool = True) -> None:
        """Compiles the device operations the protocol will ask for on each fragment (a list
        of its members: leaves, or row slices of one): the on-device copy an offer takes and
        the merge updates of `kinds` ("add", "mix", "land") with mixing weight `alpha`, as `apply`
        runs them. Else each compiles at the boundary where it is first needed, on the
        learner's critical path, while its device idles: 40-150 ms per `mid` fragment's add
        on a CPU host, at the first merges of every run. `background`: fragment by fragment
        on a thread, beside the first train step's compilation; a copy or update of a
        fragment waits for that fragment's. A fragment that fails to compile is logged (its
        ops then compile where first used)."""
        self._await_precompiled()
        fragments = [tuple(f) for f in fragments]
        key = (tuple(fragments), tuple(kinds), alpha)
        if key == self._precompiled:
            return  # a restarted learner: compiled for its earlier life
        self._precompiled = key
        if not background:
            for names in fragments:
                self._compile_fragment(names, kinds, alpha)
            return
        # Not daemon threads: the interpreter joins them at exit (XLA aborts the process if
        # it is torn down in the middle of a compilation). Fragments compile side by side
        # on half the host's cores (XLA compiles without the interpreter lock): an XLA:GPU
        # compile of each small op takes a good part of a second, and the first offers of
        # every fragment come within H steps of the start.
        threads = max(1, min(len(fragments), (os.cpu_count() or 2) // 2))
        pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="precompile")
        for names in fragments:
            job = self._compile_fragment, names, kinds, alpha
            self._compiling[frozenset(names)] = pool.submit(*job)
        pool.shutdown(wait=False)  # its thread ends with the last fragment

    def _compile_fragment(self, names, kinds, alpha: float) -> None:
        devices = tuple(sorted(d.id for d in self.mesh.devices.flat))
        # One compile of a fragment per set of devices: replicas sharing them find it
        # compiled. (dict.setdefault is atomic.)
        with _PRECOMPILING.setdefault((devices, tuple(sorted(names))), threading.Lock()):
            members = {k: self._abstract_member(k) for k in names}
            if "add" in kinds:  # a rebase staged on the devices (diloco.device_rebase)
                ops.rebase_shift.lower(members, members).compile()
                ops.rebase_held.lower(members, members, members).compile()
            if "land" in kinds:  # setting steps aside, and offering θ + R
                w = self._weight_abstract
                ops.set_aside.lower(members, members, members, w).compile()
                ops.set_aside_onto.lower(members, members, members, members, w).compile()
                ops.plus.lower(members, members).compile()
                ops.outer_plus.lower(members, members, members).compile()
            whole = {k: self._abstract_member(k) for k in names if parse_member(k)[1] is None}
            if whole:
                ops.copy_leaves.lower(whole).compile()
                if "add" in kinds:  # and an offer's v = G − θ from that G
                    ops.outer.lower(whole, whole).compile()
                for kind in kinds:
                    op = ops.leaf_update(kind, alpha)
                    if op is not None:
                        op[0].lower(whole, whole, self._weight_abstract).compile()
            for name in names:
                leaf, rows = parse_member(name)
                if rows is None:
                    continue
                full, part = self._abstract_member(leaf), self._abstract_member(name)
                _take_rows.lower(full, rows.start, rows.stop).compile()
                if "add" in kinds:
                    _outer_rows.lower(part, full, rows.start, rows.stop).compile()
                update = self._row_update(leaf)
                for kind in {"add" if kind == "add" else "mix" for kind in kinds}:
                    update.lower(full, part, rows.start, kind, self._weight_abstract).compile()

    def _abstract_member(self, name: str) -> jax.ShapeDtypeStruct:
        """A fragment member's shape, dtype and sharding on this replica (float32, as the
        parameters and the updates are)."""
        leaf, rows = parse_member(name)
        shape = self._flat_abstract[leaf].shape
        if rows is not None:
            shape = (rows.stop - rows.start, *shape[1:])
        dtype = self._flat_abstract[leaf].dtype
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._member_sharding(name))

    def _await_precompiled(self, names=None) -> None:
        """Waits for the background `precompile` of the fragment with these members (None:
        of every fragment)."""
        keys = list(self._compiling) if names is None else [frozenset(names)]
        for key in keys:
            # Removed only once done: the stager's thread (a device rebase) and the learner's
            # may both ask, and each must wait for it.
            future = self._compiling.get(key)
            if future is None:
                continue
            try:
                if not future.done():
                    t0 = time.perf_counter()
                    concurrent.futures.wait([future])
                    waited = time.perf_counter() - t0
                    self._compile_waits.seconds = self.compile_waited() + waited
                future.result()
            except Exception as e:  # noqa: BLE001 (the ops compile where first used)
                if self._compiling.pop(key, None) is not None:  # logged once
                    logging.warning("precompiling the device ops of fragment %s failed (%s: %s)",
                                    sorted(key), type(e).__name__, e)  # fmt: skip
            else:
                self._compiling.pop(key, None)

    def compile_waited(self) -> float:
        """Seconds the calling thread's protocol ops have waited for their fragment's
        background compile (`precompile`): start-up cost, which a speed measurement keeps
        out of its window. A learner's rows report its own thread's (`compile_wait_s`); a
        stager's waits delay placements, not steps."""
        return getattr(self._compile_waits, "seconds", 0.0)

    def fragment_copies(self, names) -> dict[str, jax.Array]:
        """Device copies of the named fragment members (leaves, or row slices of one:
        diloco/fragment_members.py) that survive the next donating step, with their host
        transfer already started: θ + R where a landing set steps aside (`land`)."""
        copies = self._copies(names)
        transfer.start_to_host(copies)
        return copies

    def outer_gradient(self, names, anchor: dict) -> dict[str, jax.Array]:
        """v = G − θ for the named fragment members, G (`anchor`) on the devices already, with
        the host transfer started: `fragment_copies`' counterpart for an offer whose
        outer gradient is computed here (`diloco.device_rebase`): G − (θ + R) where a
        landing set steps aside (the float32 operations of `materialize` on the copies)."""
        held = [k for k in names if k in self.held]
        rest = [k for k in names if k not in self.held]
        v = {}
        if rest:
            v = self._per_member(
                rest,
                lambda leaves: ops.outer({k: anchor[k] for k in leaves}, leaves),
                lambda name, x, r: _outer_rows(anchor[name], x, r.start, r.stop),
            )
        if held:
            v.update(ops.outer_plus(_pick(anchor, held), self._theta(held), _pick(self.held, held)))
        transfer.start_to_host(v)
        return v

    def _copies(self, names) -> dict[str, jax.Array]:
        """New arrays θ + R of the named members (θ where no landing set steps aside)."""
        held = [k for k in names if k in self.held]
        rest = [k for k in names if k not in self.held]
        # A row slice is a new array: it survives donation too.
        out = self._per_member(rest, ops.copy_leaves, _rows) if rest else {}
        if held:
            out.update(ops.plus(self._theta(held), _pick(self.held, held)))
        return out

    def _theta(self, names) -> dict[str, jax.Array]:
        """θ of the named members, to be read by an op that makes new arrays: whole leaves
        as they are (no copy), row slices taken."""
        return self._per_member(names, dict, _rows)

    def _per_member(self, names, whole, rows) -> dict[str, jax.Array]:
        """New device arrays of the named fragment members:
        `whole({leaf: θ leaf})` for the whole leaves among them, and for each row slice
        `rows(member name, θ leaf, its rows)`."""
        self._await_precompiled(names)
        flat = flatten_params(self.state.params)
        leaves = {k: flat[k] for k in names if parse_member(k)[1] is None}
        out = dict(whole(leaves)) if leaves else {}
        for k in names:
            leaf, part = parse_member(k)
            if part is not None:
                out[k] = rows(k, flat[leaf], part)
        return out

    def apply(self, kind: str, arrays: dict, alpha: float = 0.0) -> None:
        """θ ← θ + (1 − α)·x ("add") or θ ← α·θ + (1 − α)·x ("mix"; "land": the same mix,
        never replacing θ by x's buffers) for the named fragment members (leaves, or row
        slices of one); x host arrays, or device arrays from `place`."""
        self._await_precompiled(arrays)
        flat = flatten_params(self.state.params)
        placed = self._on_devices(arrays)
        x = {k: v for k, v in placed.items() if parse_member(k)[1] is None}
        op = ops.leaf_update(kind, alpha)
        try:
            if x and op is None:
                flat.update(x)
            elif x:
                flat.update(op[0]({k: flat[k] for k in x}, x, self._weight(op[1])))
            for k, value in placed.items():
                leaf, rows = parse_member(k)
                if rows is not None:
                    flat[leaf] = self._apply_rows(flat[leaf], leaf, rows.start, value, kind,
                                                  alpha)  # fmt: skip
        finally:  # even after a failure: θ's donated leaves were replaced in `flat`
            self.state = self.state._replace(params=unflatten_params(flat))

    def land(self, x: dict, new: dict, alpha: float = 0.0) -> None:
        """A landing (`diloco.apply` "land") for the named fragment members, from a rebase's
        x = Θ_new − G + v̂ and Θ_new (host arrays, or device arrays from `place`):
        R ← R + (1 − α)·(θ + x − Θ_new), then θ ← α·θ + (1 − α)·Θ_new. θ + R ends where the
        add θ ← θ + (1 − α)·x would have left θ (up to float rounding); α = 0 sets a finite θ
        to Θ_new exactly. `new` is only read: a stager keeps it as the next rebase's G."""
        self._await_precompiled(x)
        flat = flatten_params(self.state.params)
        x, new = self._on_devices(x), self._on_devices(new)
        views = {}
        for k in x:
            leaf, rows = parse_member(k)
            views[k] = flat[k] if rows is None else _take_rows(flat[leaf], rows.start, rows.stop)
        s = 1.0 - alpha
        onto, fresh = [k for k in x if k in self.held], [k for k in x if k not in self.held]
        if onto:
            args = (_pick(d, onto) for d in (self.held, views, x, new))
            self.held.update(ops.set_aside_onto(*args, self._weight(s)))
        if fresh:
            args = (_pick(d, fresh) for d in (views, x, new))
            self.held.update(ops.set_aside(*args, self._weight(s)))
        self.apply("land", new, alpha)  # the mix, into θ's buffers even at α = 0

    def _on_devices(self, arrays: dict) -> dict:
        """`arrays` as device arrays: as given if they are (`place`d ahead), else placed."""
        if all(isinstance(a, jax.Array) for a in arrays.values()):
            return dict(arrays)
        return self.place(arrays)

    def _apply_rows(self, full, leaf: str, start: int, x, kind: str, alpha: float):
        """`apply` on rows start.. of one leaf (x placed); the leaf keeps its sharding."""
        kind = kind if kind == "add" else "mix"
        return self._row_update(leaf)(full, x, start, kind, self._weight(alpha))

    def _weight(self, value: float) -> jax.Array:
        """`value` as a merge op's weight: a float32 scalar on the mesh (see __init__), placed
        once per value (a run merges with one α)."""
        if value not in self._weights:
            self._weights[value] = jax.device_put(np.float32(value), self._weight_abstract.sharding)
        return self._weights[value]

    def _row_update(self, leaf: str):
        """The jitted row-slice update of `leaf` (`_update_rows`, keeping its sharding)."""
        if leaf not in self._row_updates:
            self._row_updates[leaf] = ops.launch(
                _update_rows,
                static_argnums=(2, 3),
                out_shardings=self.flat_shardings[leaf],
                donate_argnums=0,
            )
        return self._row_updates[leaf]


def _pick(d: dict, keys) -> dict:
    return {k: d[k] for k in keys}


@ops.Launch
@functools.partial(jax.jit, static_argnums=(1, 2))
def _take_rows(x: jax.Array, start: int, stop: int) -> jax.Array:
    return x[start:stop]


def _rows(name: str, x: jax.Array, rows: slice) -> jax.Array:
    """`_per_member`'s row-slice op that takes the rows (a new array)."""
    del name
    return _take_rows(x, rows.start, rows.stop)


@ops.Launch
@functools.partial(jax.jit, static_argnums=(2, 3))
def _outer_rows(anchor: jax.Array, x: jax.Array, start: int, stop: int) -> jax.Array:
    return anchor - x[start:stop]


def _update_rows(full, x, start: int, kind: str, alpha):
    """Rows start..start+len(x) of `full` ← + (1 − α)·x ("add"), or α·rows + (1 − α)·x."""
    rows = jax.lax.dynamic_slice_in_dim(full, start, x.shape[0])
    new = rows + (1 - alpha) * x if kind == "add" else alpha * rows + (1 - alpha) * x
    return jax.lax.dynamic_update_slice_in_dim(full, new.astype(full.dtype), start, 0)


def _rows_sharding(leaf_sharding, rows: int):
    """The leaf's sharding for a slice of `rows` rows: its first axis stays split only
    where `rows` divides evenly."""
    spec = list(leaf_sharding.spec) + [None] * (1 - len(leaf_sharding.spec))
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],) if spec[0] else ()
    ways = math.prod(leaf_sharding.mesh.shape[a] for a in axes)
    if ways > 1 and rows % ways:
        spec[0] = None
    return jax.sharding.NamedSharding(leaf_sharding.mesh, jax.sharding.PartitionSpec(*spec))


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
