"""A learner: its own mesh, data shard, AdamW state and jitted step; never waits on peers.

The learner only talks to the syncer through a `LearnerLink` and only at step boundaries,
by its own thread, because train steps donate their input buffers (reading a donated array
from another thread fails). Fragments leave as on-device copies whose host transfer,
outer-gradient subtraction and encoding run in the link, off the learner's critical path.

Applying a merged fragment (`apply`):
  "rebase" (default) keeps the learner's work that the merge does not hold. If the merge
      holds this learner's offer from step s: θ ← Θ_new + (θ − θ_s), i.e. the steps since
      the offer (and, with lossy offers, the part of the offer the syncer did not receive:
      error feedback) move onto the new global fragment. If it does not (a round closed
      without this learner): θ ← θ + (Θ_new − anchor), a rebase that keeps all local work
      since the last merge, which the next offer then carries; counters keep counting the
      steps not merged yet. With τ = 0 and every learner in every merge (DiLoCo), this is
      exactly the overwrite.
  "overwrite" is Streaming DiLoCo's rule: θ ← α·θ + (1 − α)·Θ_new for every merge, resetting
      the counters, so work a merge does not hold is discarded.

The same class is the data-parallel trainer: without a link (`sync_every = 0`) it is plain
training on its mesh.
"""

import dataclasses
import math
import time
from collections.abc import Callable

import jax
import numpy as np

from decoupled_diloco import models, sharding, transfer
from decoupled_diloco.diloco import compression
from decoupled_diloco.diloco.fragments import FragmentPlan, flatten_params, unflatten_params
from decoupled_diloco.diloco.messages import Heartbeat, Join, Leave, Merged, Offer, Snapshot
from decoupled_diloco.diloco.transport import LearnerLink
from decoupled_diloco.train import optimizer as optim
from decoupled_diloco.train.step import TrainState, make_train_step

APPLY_MODES = ("rebase", "overwrite")
MAX_UNMERGED_OFFERS = 4  # per fragment: references kept to subtract a merged offer


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    sync_every: int = 0  # H; 0 = no syncer (data-parallel)
    overlap: int = 0  # τ
    alpha: float = 0.0  # θ ← α·θ + (1−α)·Θ when a merged fragment is applied
    apply: str = "rebase"  # "rebase" | "overwrite" (see the module docstring)
    max_wait: float = 0.0  # seconds to wait at t+τ for a late merge; inf = synchronous
    compression: str = "none"  # offers' wire format
    final_sync: bool = True
    heartbeat_every: float = 0.5  # seconds
    join_timeout: float = 600.0  # seconds to wait for the syncer's snapshot when (re)joining

    def validate(self) -> None:
        if self.sync_every < 0:
            raise ValueError(f"diloco.sync_every must be >= 0, got {self.sync_every}")
        if self.overlap < 0 or (self.sync_every and self.overlap >= self.sync_every):
            raise ValueError(
                f"diloco.overlap (tau={self.overlap}) must be in [0, diloco.sync_every="
                f"{self.sync_every}): a merge must land before the fragment is due again"
            )
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"diloco.alpha must be in [0, 1), got {self.alpha}")
        if self.apply not in APPLY_MODES:
            raise ValueError(f"diloco.apply must be one of {APPLY_MODES}, got {self.apply!r}")
        if self.max_wait < 0:
            raise ValueError(f"diloco.max_wait must be >= 0 or inf, got {self.max_wait}")
        if self.compression not in compression.METHODS:
            raise ValueError(
                f"diloco.compression must be one of {compression.METHODS}, got {self.compression!r}"
            )


class PendingFragment:
    """An offer's payload before it is sent: device copies plus the learner's anchor.

    `materialize` runs on the transport's thread: device→host, v = Θ^(base) − θ, encode.

    With `keep`, it also keeps the outer gradient as the syncer will decode it (`sent`), so
    the learner can later subtract exactly what a merge received.
    """

    def __init__(self, arrays: dict[str, jax.Array], anchor: dict[str, np.ndarray], keep=False):
        self.arrays, self.anchor, self.keep = arrays, anchor, keep
        self.sent: dict[str, np.ndarray] | None = None
        transfer.start_to_host(arrays)

    def materialize(self, method: str) -> compression.Encoded:
        local = transfer.to_host(self.arrays)
        self.arrays = None  # the device copies are no longer needed
        outer_grad = {k: np.subtract(self.anchor[k], local[k], dtype=np.float32) for k in local}
        encoded = compression.encode(outer_grad, method)
        if self.keep:
            self.sent = outer_grad if method == "none" else compression.decode(encoded)
        return encoded


class Learner:
    """One learner. Drive it with `start()`, then `run_step()` until done, then `finish()`."""

    def __init__(
        self,
        learner_id: int,
        cfg: LearnerConfig,
        model_cfg: models.ModelConfig,
        train_cfg: optim.TrainConfig,
        mesh: jax.sharding.Mesh,
        data_iter,
        plan: FragmentPlan | None = None,
        link: LearnerLink | None = None,
        incarnation: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.id, self.cfg, self.model_cfg, self.train_cfg = learner_id, cfg, model_cfg, train_cfg
        self.mesh, self.data, self.plan, self.link = mesh, data_iter, plan, link
        self.incarnation, self.clock = incarnation, clock
        self.tokens_per_batch = data_iter.tokens_per_batch
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
            make_train_step(model_cfg, self.optimizer, schedule, mesh),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, sharding.replicated(mesh)),
            donate_argnums=0,
        )
        self._init_opt = jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)
        self._mix = jax.jit(
            lambda a, b, alpha: jax.tree.map(lambda x, y: alpha * x + (1 - alpha) * y, a, b)
        )
        self._shift = jax.jit(  # θ + (1 − α)·δ, for the rebase
            lambda a, d, alpha: jax.tree.map(lambda x, y: x + (1 - alpha) * y, a, d)
        )

        self.state: TrainState | None = None
        self.step = 0  # inner steps taken by this learner (across incarnations)
        nfrag = plan.num_fragments if plan else 0
        self.c_steps = [0] * nfrag
        self.c_tokens = [0] * nfrag
        self.w_steps = [0] * nfrag  # steps since the last offer of p (counted once each)
        self.base_version = [0] * nfrag
        self.epoch = [0] * nfrag  # the syncer life of base_version (Snapshot.epoch)
        self.anchor: list[dict[str, np.ndarray]] = [{} for _ in range(nfrag)]
        self.offer_step: list[int | None] = [None] * nfrag
        self.arrived: list[Merged | None] = [None] * nfrag
        # Rebase mode: offers not merged yet, step -> (payload, c_steps, c_tokens), and the
        # (version, step) of the latest arrived merge that holds one of them.
        self.sent: list[dict[int, tuple[PendingFragment, int, int]]] = [{} for _ in range(nfrag)]
        self.merged_in: list[tuple[int, int] | None] = [None] * nfrag
        self.applied_merges = 0
        self.wait_seconds = 0.0  # total time blocked on late merges: idle, not compute
        self.step_seconds = 0.0  # moving average of seconds per step, sent in heartbeats
        self._last_step_start: float | None = None
        self.timed_intervals = 0  # step-start intervals seen since the last (re)start
        self._last_heartbeat = -math.inf

    # --- state -----------------------------------------------------------------------
    def init_from_rng(self, rng: jax.Array) -> None:
        """Fresh parameters (the run's starting point) and fresh AdamW state."""
        params = jax.jit(
            lambda r: models.init_params(self.model_cfg, r), out_shardings=self.param_shardings
        )(rng)
        self._set_state(params)

    def init_from_host(self, flat: dict[str, np.ndarray]) -> None:
        """Parameters from host arrays (e.g. the syncer's snapshot), fresh AdamW state.

        The inner AdamW state is reset on (re)join: the old moments belong to a model the
        learner no longer has, and bias correction restarts cleanly from zero.
        """
        params = unflatten_params(transfer.to_device(flat, self.flat_shardings))
        self._set_state(params)

    def _set_state(self, params) -> None:
        step = jax.device_put(np.int32(self.step), sharding.replicated(self.mesh))
        self.state = TrainState(step, params, self._init_opt(params))
        if self.plan is not None:
            host = self.host_params()
            self.anchor = [{k: host[k] for k in names} for names in self.plan.names]

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

    # --- protocol --------------------------------------------------------------------
    def start(self, rng: jax.Array | None = None, restored: TrainState | None = None) -> None:
        """Joins the syncer and starts from its global parameters (or from `rng` without one).

        With `restored` (a resumed run) the learner keeps its checkpointed state and the
        syncer's snapshot only re-anchors it (see `_resync`).
        """
        if self.link is None:
            if restored is not None:
                self.state = restored
            else:
                self.init_from_rng(rng if rng is not None else jax.random.key(self.train_cfg.seed))
            return
        self.link.send(Join(self.id, self.incarnation, self.clock(), self.step))
        deadline = self.clock() + self.cfg.join_timeout
        snapshots, merged, covered = [], [], set()
        while len(covered) < self.plan.num_fragments:
            if self.clock() > deadline:
                raise TimeoutError(f"learner {self.id}: no snapshot from the syncer")
            for msg in self.link.receive(timeout=0.5):
                if isinstance(msg, Snapshot):
                    snapshots.append(msg)
                    covered.update(msg.versions)
                elif isinstance(msg, Merged):  # a merge that overtook a shard's snapshot
                    merged.append(msg)
        if restored is not None:
            self.state = restored
        else:
            params = {}
            for snap in snapshots:  # one per syncer shard
                params.update(snap.params)
            self.init_from_host(params)
        self._handle(snapshots + merged)

    def run_step(self) -> dict[str, float]:
        """One inner step and its step boundary. Returns host metrics of the step."""
        now = self.clock()
        if self._last_step_start is not None:
            # The first interval after a (re)start holds the train step's compilation (or
            # its load from the cache): seconds, where a step is milliseconds on a TPU. It
            # would inflate the syncer's step-time average, hence the grace window, for
            # dozens of steps, so it is not a step time.
            if self.timed_intervals > 0:
                dt = now - self._last_step_start
                ema = 0.8 * self.step_seconds + 0.2 * dt
                self.step_seconds = dt if self.step_seconds == 0 else ema
            self.timed_intervals += 1
        self._last_step_start = now
        batch = next(self.data)
        batch = transfer.to_device({"b": batch}, {"b": self.batch_sharding})["b"]
        self.state, metrics = self._train_step(self.state, batch)
        self.step += 1
        for p in range(len(self.c_steps)):
            self.c_steps[p] += 1
            self.c_tokens[p] += self.tokens_per_batch
            self.w_steps[p] += 1
        host = {k: np.asarray(v) for k, v in transfer.to_host(metrics).items()}
        if self.link is not None:
            self._boundary()
        return {k: float(v) if v.ndim == 0 else v for k, v in host.items()}

    def _boundary(self) -> None:
        # Offer first: with tau = 0 a fragment offered at step t is applied at boundary t.
        for p in self.plan.due(self.step):
            self._offer(p)
        self._receive(0.0)
        self._wait_for_due_merges()
        self._apply_due()
        now = self.clock()
        if now - self._last_heartbeat >= self.cfg.heartbeat_every:
            self._last_heartbeat = now
            self.link.send(Heartbeat(self.id, self.incarnation, self.step, self.step_seconds, now))

    def _receive(self, timeout: float) -> None:
        self._handle(self.link.receive(timeout=timeout))

    def _handle(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, Snapshot):
                self._resync(msg)
            if (
                isinstance(msg, Merged)
                and msg.epoch == self.epoch[msg.fragment]  # not from a lost syncer life
                and msg.version > self.base_version[msg.fragment]
            ):
                p = msg.fragment
                old = self.arrived[p]
                if old is None or msg.version > old.version:
                    self.arrived[p] = msg
                step = self._my_merged_step(msg)
                newest = self.merged_in[p] is None or (step or 0) >= self.merged_in[p][1]
                if step is not None and self.cfg.apply == "rebase" and newest:
                    self.merged_in[p] = (msg.version, step)

    def _my_merged_step(self, msg: Merged) -> int | None:
        """The step of this learner's offer that `msg` merged, if it merged one of ours."""
        for m, step, inc in zip(msg.learners, msg.steps, msg.incarnations, strict=False):
            if m == self.id and inc == self.incarnation:
                return step
        return None

    def _resync(self, snap: Snapshot) -> None:
        """A restored syncer's state: re-anchor on it, keep local params and progress.

        The next outer gradient Θ_restored − θ then carries everything this learner has
        that the restored global model lacks, so no learner work is thrown away.
        """
        for p, version in snap.versions.items():
            self.base_version[p] = int(version)
            self.epoch[p] = snap.epoch
            self.anchor[p] = {k: snap.params[k] for k in self.plan.names[p]}
            self.arrived[p] = self.merged_in[p] = self.offer_step[p] = None
            self.sent[p] = {}  # a restored syncer holds no offers of ours
        # Tell the syncer our step at once: it bounds how far ahead our next offer may be.
        self._last_heartbeat = -math.inf

    def crash(self) -> None:
        """Loses everything the failed slice held: device state and unsent messages."""
        self.state = None
        self.incarnation += 1
        n = len(self.c_steps)
        self.c_steps, self.c_tokens, self.w_steps = [0] * n, [0] * n, [0] * n
        self.offer_step, self.arrived = [None] * n, [None] * n
        self.sent, self.merged_in = [{} for _ in range(n)], [None] * n
        self.step_seconds, self._last_step_start, self.timed_intervals = 0.0, None, 0
        if hasattr(self.link, "drop_pending"):
            self.link.drop_pending()
            self.link.receive(0.0)

    def _due(self, p: int) -> bool:
        """May the arrived merge of fragment p be applied at this step boundary?

        A merge holding our offer from step s waits until s + τ; in rebase mode a merge
        without it is applied at once (it discards nothing); in overwrite mode any merge
        waits for our outstanding offer's s + τ.
        """
        if self.cfg.apply == "rebase":
            if self.merged_in[p] is None:
                return True
            return self.step >= self.merged_in[p][1] + self.cfg.overlap
        return self.offer_step[p] is None or self.step >= self.offer_step[p] + self.cfg.overlap

    def _wait_for_due_merges(self) -> None:
        if self.cfg.max_wait <= 0:
            return
        tau = self.cfg.overlap
        waiting = [
            p for p, s in enumerate(self.offer_step) if s is not None and self.step >= s + tau
        ]
        start = self.clock()
        deadline = start + self.cfg.max_wait
        try:
            while any(self.arrived[p] is None for p in waiting):
                left = deadline - self.clock()
                if left <= 0:
                    return
                self._receive(min(left, 1.0))
        finally:
            self.wait_seconds += self.clock() - start

    def _apply_due(self) -> None:
        updates, shifts = {}, {}
        for p, msg in enumerate(self.arrived):
            if msg is None or not self._due(p):
                continue
            theta = compression.decode(msg.payload)
            delta = self._rebase(p, theta) if self.cfg.apply == "rebase" else None
            if delta is None:  # overwrite
                updates.update(theta)
                self.c_steps[p] = self.c_tokens[p] = 0
                self.offer_step[p] = None
            else:
                shifts.update(delta)
            self.anchor[p] = theta
            self.base_version[p] = msg.version
            self.arrived[p] = None
            self.applied_merges += 1
        if not updates and not shifts:
            return
        flat = flatten_params(self.state.params)
        if updates:
            new = transfer.to_device(updates, {k: self.flat_shardings[k] for k in updates})
            if self.cfg.alpha > 0:
                new = self._mix({k: flat[k] for k in new}, new, self.cfg.alpha)
            flat.update(new)
        if shifts:
            delta = transfer.to_device(shifts, {k: self.flat_shardings[k] for k in shifts})
            flat.update(self._shift({k: flat[k] for k in delta}, delta, self.cfg.alpha))
        self.state = self.state._replace(params=unflatten_params(flat))

    def _rebase(self, p: int, theta: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """δ with θ ← θ + δ (module docstring), or None to overwrite; updates p's counters."""
        anchor = self.anchor[p]
        if self.merged_in[p] is None:  # our work is not in Θ_new: move all of it onto it
            return {k: np.subtract(theta[k], anchor[k], dtype=np.float32) for k in theta}
        _, step = self.merged_in[p]
        entry = self.sent[p].get(step)
        self.sent[p], self.merged_in[p], self.offer_step[p] = {}, None, None
        if entry is None or entry[0].sent is None:
            return None  # no reference left for the merged offer: overwrite (loses, never repeats)
        payload, c_steps, c_tokens = entry
        # Offers made after step s repeat work Θ_new holds: the syncer drops them, so the
        # steps since s are credited to the next offer instead.
        self.w_steps[p] = self.step - step
        if self.step == step and self.cfg.compression == "none":
            return None  # θ = θ_s exactly: the overwrite, without rounding
        self.c_steps[p] -= c_steps
        self.c_tokens[p] -= c_tokens
        # θ_s = anchor − v̂_s, so Θ_new + (θ − θ_s) = θ + (Θ_new − anchor + v̂_s).
        return {
            k: np.add(np.subtract(theta[k], anchor[k], dtype=np.float32), payload.sent[k])
            for k in theta
        }

    def _offer(self, p: int) -> None:
        if self.c_steps[p] == 0:
            return
        flat = flatten_params(self.state.params)
        copies = {k: flat[k].copy() for k in self.plan.names[p]}  # survives the next donation
        rebase = self.cfg.apply == "rebase"
        payload = PendingFragment(copies, self.anchor[p], keep=rebase)
        if rebase:
            sent = self.sent[p]
            sent[self.step] = (payload, self.c_steps[p], self.c_tokens[p])
            while len(sent) > MAX_UNMERGED_OFFERS:
                # The syncer keeps only a learner's latest offer, so one this old is almost
                # surely replaced; if it is merged after all, the merge overwrites.
                del sent[min(sent)]
        self.link.send(
            Offer(
                learner=self.id,
                incarnation=self.incarnation,
                fragment=p,
                step=self.step,
                c_steps=self.c_steps[p],
                c_tokens=self.c_tokens[p],
                base_version=self.base_version[p],
                time=self.clock(),
                work_steps=self.w_steps[p],
                payload=payload,
                epoch=self.epoch[p],
            )
        )
        self.w_steps[p] = 0
        self.offer_step[p] = self.step

    def finish(self) -> None:
        """Final offers of every fragment (if configured), then leave."""
        if self.link is None:
            return
        self._receive(0.0)
        self._apply_due()
        if self.cfg.final_sync:
            for p in range(self.plan.num_fragments):
                self._offer(p)
        self.link.send(Leave(self.id, self.incarnation, self.clock()))


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
