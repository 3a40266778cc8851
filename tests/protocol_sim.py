"""Learners without devices: the real protocol, step boundary and syncer over a simulated
network with a virtual clock.

`NumpyReplica` stands in for `train.replica.Replica` (flat float32 params; an inner step
applies a deterministic update), `Sim` runs M learners against one real `Syncer`: learner m
takes a step every `step_time[m]` virtual seconds, messages arrive after programmable
delays, and a learner whose offer is past s + τ unresolved waits (virtually) as long as
`diloco.max_wait` allows. Everything is deterministic; nothing sleeps.
"""

import concurrent.futures
import dataclasses
import heapq
import itertools
import math
import zlib

import numpy as np

from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragments import make_fragment_plan
from decoupled_diloco.diloco.learner import Learner, materialize
from decoupled_diloco.diloco.messages import Offer, Snapshot
from decoupled_diloco.diloco.syncer import Syncer
from decoupled_diloco.runtime.boundary import (
    MergeStager,
    apply_and_beat,
    apply_updates,
    beat,
    final_offers,
    handle,
    offer_and_receive,
)
from decoupled_diloco.runtime.outbox import Outbox

SHAPES = {"embedder/input_embedding": (6, 4), "block_0/w": (4, 4), "block_0/b": (4,),
          "block_1/w": (4, 4), "final_norm/scale": (4,)}  # fmt: skip
TOKENS_PER_STEP = 64


class NumpyReplica:
    """Flat float32 params. `update(params, m, step) -> dict` is one inner step's change."""

    def __init__(self, m: int, update):
        self.m, self.update, self.state, self.step_count = m, update, None, 0
        self.held = {}  # `Replica.held`

    def init_from_host(self, flat: dict, step: int = 0) -> None:
        self.state = {k: np.array(v, np.float32) for k, v in flat.items()}
        self.step_count = step
        self.held = {}

    def step(self, batch=None) -> dict:
        delta = self.update(self.state, self.m, self.step_count)
        self.state = {k: (v + delta[k]).astype(np.float32) for k, v in self.state.items()}
        self.step_count += 1
        return {"loss": np.float32(0.0)}

    def ready(self) -> None:
        pass

    @staticmethod
    def place(arrays: dict) -> dict:
        return {k: np.array(v, np.float32) for k, v in arrays.items()}

    def outer_gradient(self, names, anchor: dict) -> dict:
        """`Replica.outer_gradient`: v = G − (θ + R), the same float32 operations."""
        phi = self.fragment_copies(names)
        return {k: np.subtract(anchor[k], phi[k], dtype=np.float32) for k in names}

    @staticmethod
    def rebase_delta(new: dict, anchor: dict, sent: dict | None) -> dict:
        """`Replica.rebase_delta` of placed arrays: the same float32 operations."""
        x = {k: np.subtract(t, anchor[k], dtype=np.float32) for k, t in new.items()}
        return x if sent is None else {k: np.add(d, sent[k]) for k, d in x.items()}

    def fragment_copies(self, names) -> dict:
        """`Replica.fragment_copies`: θ + R."""
        return {k: self.state[k] + self.held[k] if k in self.held else self.state[k].copy()
                for k in names}  # fmt: skip

    @staticmethod
    def to_host(copies: dict) -> dict:
        return copies

    def apply(self, kind: str, arrays: dict, alpha: float = 0.0) -> None:
        for k, x in arrays.items():
            if kind == "add":
                self.state[k] = (self.state[k] + (1 - alpha) * x).astype(np.float32)
            else:
                self.state[k] = (alpha * self.state[k] + (1 - alpha) * x).astype(np.float32)

    def land(self, x: dict, new: dict, alpha: float = 0.0) -> None:
        """`Replica.land`, the same float32 operations."""
        s = np.float32(1.0 - alpha)
        for k in x:
            aside = s * ((self.state[k] + x[k]) - new[k])
            self.held[k] = self.held[k] + aside if k in self.held else aside
        self.apply("mix", new, alpha)

    def host_params(self) -> dict:
        return {k: v.copy() for k, v in self.state.items()}


def linear_update(scale: float = 1e-2, seed: int = 0):
    """An inner step that adds a fixed pseudo-random vector per (learner, step), whatever θ
    is: Θ's value then says exactly which steps it holds, and with which coefficient."""

    def update(params, m, step):
        return {k: (scale * _rng(seed, m, step, k).standard_normal(np.shape(v))).astype(np.float32)
                for k, v in params.items()}  # fmt: skip

    return update


def _rng(*key) -> np.random.Generator:
    """A generator per (seed, learner, step, leaf name): independent of dict order."""
    *ints, name = key
    return np.random.default_rng([*ints, zlib.crc32(name.encode())])


def work_sum(update, m: int, steps: int, shapes=SHAPES) -> dict:
    """Σ of `update` over learner m's first `steps` steps (float64), for linear updates."""
    zero = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    out = {k: np.zeros(s, np.float64) for k, s in shapes.items()}
    for t in range(steps):
        for k, v in update(zero, m, t).items():
            out[k] += v
    return out


def initial_params(seed: int = 0, shapes=SHAPES) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


class _SimLink:
    """A learner's end of the simulated network."""

    def __init__(self, sim: "Sim", m: int):
        self.sim, self.m, self.inbox = sim, m, []

    def send(self, msg) -> None:
        self.sim.to_syncer(self.m, msg)

    def receive(self, timeout: float = 0.0) -> list:
        out, self.inbox = self.inbox, []
        return out

    def flush(self, timeout: float = 600.0) -> bool:
        return True

    def reset(self) -> None:
        self.inbox = []


class ImmediateExecutor(concurrent.futures.Executor):
    """Runs each task when it is submitted: staged updates are always ready."""

    def submit(self, fn, /, *args, **kwargs):
        future = concurrent.futures.Future()
        future.set_result(fn(*args, **kwargs))
        return future


class _HeldFuture(concurrent.futures.Future):
    """Not done until its executor releases it; `result()` before that runs the task there
    and then (the learner waiting for its update)."""

    def __init__(self, task):
        super().__init__()
        self.task, self.forced = task, False

    def run(self) -> None:
        if self.set_running_or_notify_cancel():
            fn, args, kwargs = self.task
            self.set_result(fn(*args, **kwargs))

    def result(self, timeout=None):
        if not self.done():
            self.forced = True
            self.run()
        return super().result(timeout)


class HeldExecutor(concurrent.futures.Executor):
    """Runs tasks only when `release()` is called (or a caller insists, `_HeldFuture`): staged
    updates stay not ready until then."""

    def __init__(self):
        self.queue: list[_HeldFuture] = []
        self.futures: list[_HeldFuture] = []

    def submit(self, fn, /, *args, **kwargs):
        future = _HeldFuture((fn, args, kwargs))
        self.queue.append(future)
        self.futures.append(future)
        return future

    def release(self) -> None:
        """Runs every task queued so far."""
        done, self.queue = self.queue, []
        for future in done:
            if not future.done():
                future.run()


@dataclasses.dataclass
class _Learner:
    proto: Learner
    replica: NumpyReplica
    link: _SimLink
    outbox: Outbox
    next_at: float
    steps_left: int
    blocked: bool = False
    done: bool = False
    stager: MergeStager | None = None


class Sim:
    """M learners and one syncer on a virtual clock.

    up_delay(m, msg) / down_delay(m, msg): seconds a message takes to the syncer / to learner
    m (defaults 0). `step_time[m]`: seconds per inner step of learner m, or a function
    (m, step) -> seconds. `stage`: learners stage merges (runtime/boundary.MergeStager) on
    `stage_executor` (default: computed at once, so nothing depends on thread timing), with
    `device_rebase` their rebases "on the devices" (`NumpyReplica.rebase_delta`, G kept).
    """

    def __init__(self, cfg: DilocoConfig, steps: int, update=None, step_time=None,
                 up_delay=None, down_delay=None, shapes=SHAPES, params=None,
                 stage: bool = False, stage_executor=None,
                 device_rebase: bool = False):  # fmt: skip
        self.cfg, self.shapes = cfg, shapes
        self.update = update or linear_update()
        self.plan = make_fragment_plan(shapes, cfg.fragments, "balanced", cfg.sync_every)
        self.theta0 = params if params is not None else initial_params(shapes=shapes)
        self.records: list[dict] = []
        self.syncer = Syncer(cfg, self.plan, self.theta0, record=self.records.append)
        self.t = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.up_delay = up_delay or (lambda m, msg: 0.0)
        self.down_delay = down_delay or (lambda m, msg: 0.0)
        step_time = step_time or [1.0] * cfg.learners
        self.step_time = step_time if callable(step_time) else (lambda m, step: step_time[m])
        self.learners: list[_Learner] = []
        for m in range(cfg.learners):
            proto = Learner(m, cfg, self.plan, TOKENS_PER_STEP, lambda: self.t)
            link = _SimLink(self, m)
            replica = NumpyReplica(m, self.update)
            outbox = Outbox(link, materialize, replica.to_host, inline=True)
            executor = stage_executor or ImmediateExecutor()
            stager = MergeStager(replica, executor, device_rebase=device_rebase) if stage else None
            self.learners.append(_Learner(proto, replica, link, outbox, 0.0, steps, stager=stager))
            snaps = [msg for _, msg in self.syncer.handle(proto.join(), self.t)]
            replica.init_from_host(proto.start([s for s in snaps if isinstance(s, Snapshot)]))
            self.learners[m].next_at = self.step_time(m, 0)

    # --- the network ------------------------------------------------------------------
    def _schedule(self, at: float, kind: str, m: int, msg) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, m, msg))

    def to_syncer(self, m: int, msg) -> None:
        self._schedule(self.t + self.up_delay(m, msg), "up", m, msg)

    def _deliver(self, out) -> None:
        for m, msg in out:
            self._schedule(self.t + self.down_delay(m, msg), "down", m, msg)

    def _process_until(self, t: float) -> None:
        """Delivers every message due by t, running the syncer on those that reach it."""
        while True:
            deadline = self.syncer.next_deadline()
            nxt = self._events[0][0] if self._events else math.inf
            if deadline is not None and deadline <= t and deadline < nxt:
                self.t = max(self.t, deadline)
                self._deliver(self.syncer.tick(self.t))
                continue
            if nxt > t:
                break
            at, _, kind, m, msg = heapq.heappop(self._events)
            self.t = max(self.t, at)
            if kind == "up":
                self._deliver(self.syncer.handle(msg, self.t))
            else:
                self.learners[m].link.inbox.append(msg)
        self.t = max(self.t, t)

    # --- learners ---------------------------------------------------------------------
    def _advance(self, lr: _Learner) -> None:
        """One inner step and step boundary of a learner, or its resumption after a wait."""
        proto, rep, out = lr.proto, lr.replica, lr.outbox
        if not lr.blocked:
            rep.step()
            proto.stepped()
            offer_and_receive(proto, rep, out, lr.link.receive, lr.stager)
        else:
            handle(proto, rep, lr.link.receive(), lr.stager)
        if self.cfg.wait_seconds > 0 and proto.unresolved():
            lr.blocked = True  # wait for the reply (retried at the next event)
            return
        lr.blocked = False
        apply_and_beat(proto, rep, out, lr.stager)
        lr.steps_left -= 1
        lr.next_at = self.t + self.step_time(proto.id, proto.step)
        if lr.steps_left == 0:  # done: final offers and a Leave, as boundary.finish
            apply_updates(rep, proto.apply_due(final=True))  # a merge deferred at the last step
            final_offers(proto, rep, out)
            out.send(proto.leave(True))

    def _finishing(self) -> None:
        """Learners past their budget resolve their offers in flight, offering what the
        resolved ones did not hold (boundary.finish)."""
        for lr in self.learners:
            if lr.steps_left == 0 and lr.link.inbox:
                lives = lr.proto.resyncs
                apply_updates(lr.replica, lr.proto.handle(lr.link.receive()))
                if lr.proto.resyncs != lives:  # a restored syncer's snapshot: as finish()
                    beat(lr.proto, lr.outbox)  # does, admit this life, then leave again
                    lr.outbox.send(lr.proto.leave(True))
                apply_updates(lr.replica, lr.proto.apply_due(final=True))
                final_offers(lr.proto, lr.replica, lr.outbox)

    def run(self, on_step=None) -> None:
        """Runs every learner to its step budget, then the final sync and the syncer's flush.
        `on_step(sim)` is called after every learner step."""
        while any(lr.steps_left > 0 for lr in self.learners):
            active = [lr for lr in self.learners if lr.steps_left > 0]
            for lr in active:
                if lr.blocked and lr.link.inbox:  # a reply reached a waiting learner
                    self._advance(lr)
            self._finishing()
            ready = [lr for lr in active if not lr.blocked]
            t_next = min((lr.next_at for lr in ready), default=math.inf)
            if any(lr.blocked for lr in active):  # a waiting learner wakes at the next event
                t_event = self._events[0][0] if self._events else math.inf
                deadline = self.syncer.next_deadline()
                t_event = min(t_event, deadline if deadline is not None else math.inf)
                if t_event < t_next:
                    self._process_until(t_event)
                    for lr in active:
                        if lr.blocked:
                            self._advance(lr)
                    continue
            if t_next == math.inf:
                raise RuntimeError("every learner waits and no message is on its way")
            self._process_until(t_next)
            lr = min(ready, key=lambda x: (x.next_at, x.proto.id))
            self._advance(lr)
            if on_step is not None:
                on_step(self)
        self.finish()

    def finish(self) -> None:
        """Lets the finished learners resolve their last offers; the syncer flushes what
        no round took, until nothing is in flight."""
        for _ in range(1000):
            while self._events or any(lr.link.inbox for lr in self.learners):
                self._process_until(self._events[0][0] if self._events else self.t)
                self._finishing()
            if not any(self.syncer.pending.values()):
                break
            self._deliver(self.syncer.flush(self.t))

    # --- what the tests read ----------------------------------------------------------
    def merged_steps(self) -> dict:
        """(learner, fragment) -> steps merged into Θ, from the syncer's merge records."""
        out: dict = {}
        for r in self.records:
            if r.get("event") == "merge":
                for m, c in zip(r["learners"], r["c_steps"], strict=True):
                    out[(m, r["fragment"])] = out.get((m, r["fragment"]), 0) + c
        return out

    def merges(self) -> list[dict]:
        return [r for r in self.records if r.get("event") == "merge"]

    def offers(self) -> list[Offer]:
        return [msg for *_, msg in self._events if isinstance(msg, Offer)]
