"""A learner as a Ray actor: its own process, its own JAX devices, its own fault domain.

The actor hosts a `LearnerLoop` (runtime/learner_loop.py) on its own thread; the
constructor starts it and returns at once, so a process Ray restarts after a crash resumes
by itself: it takes its step count and data position from its last checkpoint, its
parameters from the syncer (Join -> Snapshot, a new incarnation) and goes on. A learner
that raises exits its process the same way, so Ray restarts it too (up to
`ray.max_restarts`). Actor methods run on other threads of the actor (`max_concurrency`):
`deliver` (the syncer's replies), `poll` (the driver collects rows, events and status) and
`evaluate` (Θ to evaluate between two steps, `ray.evaluate = "learner"`: eval.py).

An error no restart can fix (a bad corpus, fragment plan or device count: a
`preflight.FatalRunError`) does not exit the process: the actor reports it in its status and
the driver stops the run with the message, instead of Ray restarting the learner forever.

Crashes from the fault schedule are real: the driver kills this process at the scheduled
time; the restarted process waits for the scheduled restart time before it rejoins.
"""

import os
import queue
import sys
import threading
import time
import traceback

from decoupled_diloco import jax_world
from decoupled_diloco.config import RunConfig
from decoupled_diloco.preflight import FatalRunError, fatal_errors
from decoupled_diloco.runtime import gil
from decoupled_diloco.runtime.ray.eval import LearnerEvals

COORDINATOR_WAIT_S = 300  # how long a slice's hosts wait for worker 0 (to join Ray, to serve)


def was_restarted() -> bool:
    """Whether Ray restarted this actor after its process died."""
    import warnings

    import ray

    with warnings.catch_warnings():  # Ray's own property trips its deprecation warning
        warnings.simplefilter("ignore")
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def _empty_out() -> dict:
    return {"rows": [], "events": [], "steps": [], "evals": []}


class _Sink:
    """A learner loop's outputs, buffered until the driver's next poll."""

    def __init__(self, actor: "LearnerActor"):
        self.actor = actor

    def event(self, rec: dict) -> None:
        self.actor._emit("events", rec)

    def row(self, rec: dict) -> None:
        self.actor._emit("rows", rec)

    def step(self, m: int, seconds: float, t: float) -> None:
        self.actor._emit("steps", (seconds, t))
        self.actor._set_status()

    def idle(self, m: int, seconds: float) -> None:
        pass  # evaluation by a Ray learner is Θ's (eval.py), not its own

    def finished(self, m: int, t: float) -> None:
        self.actor._finished_at = t


class LearnerActor:
    """Learner m (host `host` of its slice's `hosts`); wrap with `ray.remote(...)` to use."""

    def __init__(
        self,
        m: int,
        run: RunConfig,
        ckpt_dir: str,
        run_id: str,
        t0: float,
        host: int = 0,
        hosts: int = 1,
        slice_id: str = "",
        fault_offset_s: float = 0.0,
    ):
        self.m, self.run, self.ckpt_dir, self.run_id, self.t0 = m, run, ckpt_dir, run_id, t0
        self.fault_offset_s = fault_offset_s
        gil.set_switch_interval(run.gil_switch_ms)  # the actor's process is its own
        self.host, self.hosts, self.slice_id = host, hosts, slice_id
        self.restarted = was_restarted()
        self.inbox: queue.Queue = queue.Queue()  # the link's inbox, exists before the link
        self._lock = threading.Lock()
        self._out = _empty_out()
        self.evals = LearnerEvals(
            host, hosts, self._make_evaluator, lambda r: self._emit("evals", r)
        )
        self._status = {"step": 0, "incarnation": 0, "done": False, "error": None, "fatal": None}
        self._finished_at = None
        self.loop = None
        self._thread = threading.Thread(target=self._main, name=f"learner{m}", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.time() - self.t0

    # --- actor methods (other threads) -------------------------------------------------
    def pid(self) -> int:
        return os.getpid()

    def deliver(self, msg) -> None:
        self.inbox.put(msg)

    def interrupt(self) -> None:
        """The user interrupted the run: stop at the next step boundary, offer what Θ
        lacks, leave and save (called on host 0 of a slice: its hosts stop together)."""
        from decoupled_diloco.runtime.learner_loop import StopRequest

        self.inbox.put(StopRequest())

    def evaluate(self, tag: int, *theta_shards: dict) -> None:
        """Queues Θ (the syncer shards' flat numpy dicts) for evaluation on this learner."""
        self.evals.put(tag, theta_shards)

    def poll(self) -> dict:
        """What happened since the last poll, and the current status."""
        import ray

        with self._lock:
            out, self._out = self._out, _empty_out()
            return {
                **out,
                **self._status,
                "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id(),
            }

    # --- the learner's thread ----------------------------------------------------------
    def _emit(self, kind: str, item) -> None:
        with self._lock:
            self._out[kind].append(item)

    def _set_status(self, **extra) -> None:
        if self.loop is None:
            return
        with self._lock:
            self._status.update(step=self.loop.step, incarnation=self.loop.incarnation, **extra)

    def _main(self) -> None:
        try:
            if self.restarted and self.host == 0:
                self._announce_death()
            self._setup()
            self._train()
        except FatalRunError as e:  # a restart would fail the same way: stay up, report it
            print(f"learner {self.m}: fatal error: {e}", file=sys.stderr, flush=True)
            self._emit(  # before the status: a poll that sees the error also gets its event
                "events",
                {"event": "fatal_error", "learner": self.m, "error": str(e), "time": self.now()},
            )
            with self._lock:
                self._status["fatal"] = str(e)
        except BaseException:
            err = traceback.format_exc()
            print(f"learner {self.m} failed:\n{err}", file=sys.stderr, flush=True)
            with self._lock:
                self._status["error"] = err
            self._emit(
                "events",
                {
                    "event": "learner_error",
                    "learner": self.m,
                    "error": err.strip().splitlines()[-1],
                    "step": None if self.loop is None else self.loop.step,
                    "time": self.now(),
                },
            )
            # Give the driver a poll to collect the error, then die like a killed process.
            time.sleep(2 * self.run.ray.poll_seconds + 1.0)
            os._exit(1)

    def _announce_death(self) -> None:
        """Ray restarted this process: the life its predecessor held ended with it. Every
        syncer shard hears so now, before this process spends its start-up (jax, restore,
        compilation: minutes on a TPU slice) until its Join, so that no round or grace
        window waits for a dead life meanwhile. The driver cannot: a failed call to an
        actor that is restarting looks like one to an actor that is briefly unreachable. A
        life the driver announced already (a scheduled crash), or one that never joined,
        is announced all the same: the registry takes a repeat as a no-op, and a later
        life's Leave as the end of the registered one."""
        from decoupled_diloco.diloco.messages import Leave
        from decoupled_diloco.runtime.lives import last_life
        from decoupled_diloco.runtime.ray import links

        life = last_life(self.ckpt_dir, self.m, 0)
        if life is None:  # it died before it took a life: none to end
            return
        leave = Leave(self.m, life, self.now())
        for s in range(self.run.diloco.syncer_shards):
            try:
                shard = links.actor_handle(links.actor_name(self.run_id, "syncer", s))
            except ValueError:  # not found in time: its heartbeat timeout will tell it
                print(f"learner {self.m}: syncer shard {s} not found; it hears of life "
                      f"{life}'s end by its silence", file=sys.stderr, flush=True)  # fmt: skip
                continue
            shard.post.remote(leave)

    def _setup(self) -> None:
        from decoupled_diloco import compile_cache

        compile_cache.enable()
        import jax

        if self.run.ray.accelerator == "tpu":  # this slice's hosts alone (jax_world.py)
            jax_world.initialize(self._slice_world(), timeout_s=COORDINATOR_WAIT_S)

        from decoupled_diloco import faults, sharding, transfer
        from decoupled_diloco.checkpoint import Checkpointer
        from decoupled_diloco.data import make_iterator
        from decoupled_diloco.diloco.fragments import model_plan
        from decoupled_diloco.runtime.learner_loop import LearnerLoop
        from decoupled_diloco.runtime.ray import links
        from decoupled_diloco.train.replica import Replica

        run, m, M = self.run, self.m, self.run.num_learners
        with fatal_errors(f"learner {m}"):  # the same in every restarted process
            devices = jax.devices()
            if len(devices) < run.devices_per_learner:
                raise ValueError(
                    f"learner {m} sees {len(devices)} devices, devices_per_learner is "
                    f"{run.devices_per_learner}"
                )
            self.mesh = sharding.make_mesh(devices[: run.devices_per_learner], run.mesh)
            if self.hosts > 1:  # (else its first batch, in the prefetch thread: a restart)
                transfer.check_batch_split(sharding.batch_sharding(self.mesh), run.train.batch_size)
            data = make_iterator(  # this host's rows only (transfer.batch_to_device)
                run.data, "train", run.train.batch_size, m, M, self.host, self.hosts
            )
            plan = model_plan(run.model, run.diloco)
        schedule = faults.FaultSchedule(run.faults, M, faults.HORIZON_S, self.fault_offset_s)
        link = None
        if self.host == 0:
            shards = [
                links.actor_name(self.run_id, "syncer", s) for s in range(run.diloco.syncer_shards)
            ]
            link = links.RayLearnerLink(
                m, shards, link_seconds=lambda n: schedule.transfer_seconds(m, n)
            )
            link.inbox = self.inbox
        if self.hosts > 1:
            link = links.SliceLink(link)
        self.loop = LearnerLoop(
            m,
            run,
            Replica(run.model, run.train, self.mesh),
            data,
            plan,
            link,
            schedule,
            self.now,
            _Sink(self),
            Checkpointer(os.path.join(self.ckpt_dir, f"learner_{m}")),
            emulate_crashes=False,
            between_steps=self._between_steps,
            inline_offers=self.hosts > 1,
            host=self.host,
            lives=self.ckpt_dir,
        )
        # A restarted process takes its parameters from Θ, its position from the checkpoint;
        # a fresh run, or one resumed from the workdir's checkpoints, its whole state.
        self.loop.restore(params_too=not self.restarted)
        self.loop.take_life(self.loop.incarnation)
        self.loop.away = "process_restart" if self.restarted else "start"
        # The step this process starts from (its checkpoint's): the driver drops the metrics
        # rows an earlier attempt logged past it (the first process of a learner that reports
        # it), which are logged again.
        self._set_status(start_step=self.loop.step)

    def _slice_world(self) -> jax_world.World:
        """Process `host` of a world of this slice's hosts, coordinated by its TPU worker 0
        (process 0: cluster.py pins host h to worker h), whatever slice it belongs to."""
        if self.hosts == 1:
            return jax_world.SINGLE
        import ray

        from decoupled_diloco.runtime.ray.cluster import slice_coordinator

        deadline = time.monotonic() + COORDINATOR_WAIT_S
        while (address := slice_coordinator(ray.nodes(), self.slice_id)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"learner {self.m}: TPU worker 0 of slice {self.slice_id!r} has not joined "
                    f"the Ray cluster within {COORDINATOR_WAIT_S} s (it coordinates the slice)"
                )
            time.sleep(2.0)
        return jax_world.slice_world(address, self.hosts, self.host)

    def _between_steps(self) -> None:
        self._set_status()
        if self.run.ray.evaluate == "learner":
            self.evals.serve()

    def _train(self) -> None:
        loop, run = self.loop, self.run
        if self.restarted and loop.step >= run.train.steps:
            # Killed after its last step but before the driver saw it finish (a scheduled
            # crash races the status poll): back with nothing left to train. Still a
            # restart, so the driver's ledger pairs it with the failure it counted.
            self._emit(
                "events",
                {
                    "event": "rejoin",
                    "learner": self.m,
                    "step": loop.step,
                    "incarnation": loop.incarnation,
                    "process_restart": True,
                    "time": self.now(),
                },
            )
        loop.run(threading.Event())
        loop.ckpt.close()
        self._set_status(done=True, finished_at=self._finished_at or self.now())
        while run.ray.evaluate == "learner":  # devices free now: evaluate when asked
            self.evals.serve()
            time.sleep(0.05)

    def _make_evaluator(self):
        from decoupled_diloco.train.evaluate import Evaluator

        run = self.run
        return Evaluator(
            run.model, run.data, self.mesh, run.train.batch_size, run.train.eval_batches
        )
