"""A learner as a Ray actor: its own process, its own JAX devices, its own fault domain.

The constructor starts the learner's thread and returns at once, so a process Ray restarts
after a crash resumes by itself: it takes its step count and data position from its last
checkpoint, its parameters from the syncer (Join -> Snapshot, a new incarnation) and goes
on. A learner that raises exits its process the same way, so Ray restarts it too (up to
`ray.max_restarts`). Actor methods run on other threads of the actor (`max_concurrency`):
`deliver` (the syncer's replies), `poll` (the driver collects rows, events and status) and
`evaluate` (Θ to evaluate between two steps, `ray.evaluate = "learner"`: runtime/ray_eval.py).

Crashes from the fault schedule are real: the driver kills this process at the scheduled
time; the restarted process waits for the scheduled restart time before it rejoins.
"""

import os
import queue
import sys
import tempfile
import threading
import time
import traceback

from decoupled_diloco.config import RunConfig
from decoupled_diloco.runtime.ray_eval import LearnerEvals


def configure_jax() -> None:
    """This process's JAX: the shared persistent compilation cache (as in the driver)."""
    import jax

    default = os.path.expanduser("~/.cache/decoupled_diloco_jax")
    jax.config.update("jax_compilation_cache_dir", os.environ.get("DD_COMPILATION_CACHE", default))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def was_restarted() -> bool:
    """Whether Ray restarted this actor after its process died."""
    import warnings

    import ray

    with warnings.catch_warnings():  # Ray's own property trips its deprecation warning
        warnings.simplefilter("ignore")
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def _count_life(run_id: str, m: int, host: int) -> int:
    """How many processes of this learner this node has started (0 for the first one).

    A node-local counter: Ray restarts an actor on a node with its resources, which for a
    TPU learner is its own slice. Combined with the checkpoint's incarnation it gives every
    life a fresh incarnation number.
    """
    path = os.path.join(tempfile.gettempdir(), "dd_lives", run_id, f"learner_{m}_{host}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path, encoding="utf-8") as f:
            n = int(f.read()) + 1
    except (FileNotFoundError, ValueError):
        n = 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(str(n))
    return n


def _empty_out() -> dict:
    return {"rows": [], "events": [], "steps": [], "evals": []}


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
    ):
        self.m, self.run, self.ckpt_dir, self.run_id, self.t0 = m, run, ckpt_dir, run_id, t0
        self.host, self.hosts = host, hosts
        self.restarted = was_restarted()
        self.inbox: queue.Queue = queue.Queue()  # the link's inbox, exists before the link
        self._lock = threading.Lock()
        self._out = _empty_out()
        self.evals = LearnerEvals(
            host, hosts, self._make_evaluator, lambda r: self._emit("evals", r)
        )
        self._status = {"step": 0, "incarnation": 0, "done": False, "error": None}
        self._thread = threading.Thread(target=self._main, name=f"learner{m}", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.time() - self.t0

    # --- actor methods (other threads) -------------------------------------------------
    def pid(self) -> int:
        return os.getpid()

    def deliver(self, msg) -> None:
        self.inbox.put(msg)

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

    def _event(self, event: str, **fields) -> None:
        self._emit("events", {"event": event, "learner": self.m, **fields, "time": self.now()})

    def _main(self) -> None:
        try:
            self._setup()
            self._train()
        except BaseException:
            err = traceback.format_exc()
            print(f"learner {self.m} failed:\n{err}", file=sys.stderr, flush=True)
            with self._lock:
                self._status["error"] = err
            self._event("learner_error", error=err.strip().splitlines()[-1])
            # Give the driver a poll to collect the error, then die like a killed process.
            time.sleep(2 * self.run.ray.poll_seconds + 1.0)
            os._exit(1)

    def _setup(self) -> None:
        configure_jax()
        import jax

        if self.hosts > 1:
            jax.distributed.initialize()  # within this slice only (TPU metadata)
            if jax.process_index() != self.host:  # ray_cluster pins host h to TPU worker h
                raise RuntimeError(
                    f"learner {self.m}: host {self.host} runs as JAX process "
                    f"{jax.process_index()}; host 0 owns the link and must be process 0"
                )

        from decoupled_diloco import faults
        from decoupled_diloco.checkpoint import Checkpointer
        from decoupled_diloco.data import make_iterator
        from decoupled_diloco.diloco.learner import Learner
        from decoupled_diloco.runtime import learner_host, ray_links, syncer_host
        from decoupled_diloco.runtime.local import SCHEDULE_HORIZON_S
        from decoupled_diloco.sharding import make_mesh

        run, m, M = self.run, self.m, self.run.num_learners
        devices = jax.devices()
        if len(devices) < run.devices_per_learner:
            raise ValueError(
                f"learner {m} sees {len(devices)} devices, devices_per_learner is "
                f"{run.devices_per_learner}"
            )
        self.mesh = mesh = make_mesh(devices[: run.devices_per_learner], run.mesh)
        self.schedule = faults.FaultSchedule(run.faults, M, SCHEDULE_HORIZON_S)
        plan = syncer_host.fragment_plan(run)
        data = make_iterator(run.data, "train", run.train.batch_size, m, M)
        initial_data_state = data.get_state()
        link = None
        if self.host == 0:
            shards = [
                ray_links.actor_name(self.run_id, "syncer", s) for s in range(run.syncer.shards)
            ]
            link = ray_links.RayLearnerLink(
                m,
                shards,
                run.learner.compression,
                link_seconds=lambda n: self.schedule.transfer_seconds(m, n),
            )
            link.inbox = self.inbox
        if self.hosts > 1:
            link = ray_links.SliceLink(link, run.learner.compression)
        self.link = link
        self.learner = Learner(
            m, run.learner, run.model, run.train, mesh, data, plan, link, clock=self.now
        )
        self.ckpt = Checkpointer(os.path.join(self.ckpt_dir, f"learner_{m}"))
        lives = _count_life(self.run_id, m, self.host)
        if self.restarted:  # parameters come from the syncer's Θ, position from the checkpoint
            learner_host.restore_position(self.learner, self.ckpt)
            self.restored = None
        else:  # a fresh run, or one resumed from the workdir's checkpoints
            self.restored = learner_host.restore_learner(
                self.learner, self.ckpt, initial_data_state
            )
        self.learner.incarnation = max(self.learner.incarnation, lives)
        self._set_status()

    def _set_status(self, **extra) -> None:
        with self._lock:
            self._status.update(
                step=self.learner.step, incarnation=self.learner.incarnation, **extra
            )

    def _train(self) -> None:
        import jax
        import numpy as np

        from decoupled_diloco.runtime import learner_host

        run, m, learner = self.run, self.m, self.learner
        rate = learner_host.RateMeter()
        # Why the learner is about to (re)start: its first start in this process (a fresh
        # one, or one Ray restarted after it died), a NaN restart, or joining the membership.
        self.away = "process_restart" if self.restarted else "start"
        if self.restarted and learner.step >= run.train.steps:
            # Killed after its last step but before the driver saw it finish (a scheduled
            # crash races the status poll): back with nothing left to train. Still a
            # restart, so the driver's ledger pairs it with the failure it counted.
            self._announce_start()
        while learner.step < run.train.steps:
            t = self.now()
            if not self.schedule.is_up(m, t):
                if not self._down(t):
                    break  # left the membership for good (scavenging)
                continue
            if learner.state is None:
                learner.start(jax.random.key(run.train.seed), restored=self.restored)
                self.restored = None
                self._announce_start()
                self.away = None
            t_step, waited = time.perf_counter(), learner.wait_seconds
            metrics = learner.run_step()
            blocked = learner.wait_seconds - waited  # waiting for a merge is not compute
            compute = time.perf_counter() - t_step - blocked
            learner_host.straggle(self.schedule, m, learner, compute, self.now())
            self._emit("steps", (time.perf_counter() - t_step - blocked, self.now()))
            if not np.isfinite(metrics["loss"]):  # a diverged learner restarts from Θ
                self._event("nan_restart", step=learner.step)
                learner.crash()
                self.away = "nan"
                continue
            if self.host == 0 and (
                learner.step % run.train.log_every == 0 or learner.step == run.train.steps
            ):
                row = learner_host.step_record(
                    m, learner, metrics, rate(m, learner, self.now()), self.now()
                )
                self._emit("rows", row)
            every = run.train.checkpoint_every
            if every and learner.step % every == 0:
                learner_host.save_learner(learner, self.ckpt)
            self._set_status()
            if run.ray.evaluate == "learner":
                self.evals.serve()
        finished_at = self.now()  # training ends; final offers and checkpoint are the tail
        if learner.state is not None:
            learner.finish()
            if self.link is not None:
                self.link.flush()
            learner_host.save_learner(learner, self.ckpt, wait=True)
        self.ckpt.close()
        self._set_status(done=True, finished_at=finished_at)
        self._event("learner_done", step=learner.step)
        while run.ray.evaluate == "learner":  # devices free now: evaluate when asked
            self.evals.serve()
            time.sleep(0.05)

    def _announce_start(self) -> None:
        """The event of (re)entering training, named by why the learner was away."""
        event = {"start": "learner_start", "leave": "member_join"}.get(self.away, "rejoin")
        self._event(
            event,
            step=self.learner.step,
            incarnation=self.learner.incarnation,
            pid=os.getpid(),
            process_restart=self.away == "process_restart",
        )

    def _make_evaluator(self):
        from decoupled_diloco.train.evaluate import Evaluator

        run = self.run
        return Evaluator(
            run.model, run.data, self.mesh, run.train.batch_size, run.train.eval_batches
        )

    def _down(self, t: float) -> bool:
        """Not up at t. A scheduled crash: the driver kills this process; wait for that (or,
        restarted, for the scheduled restart). Leaving the membership: final offers and a
        Leave first. False once this learner will never be a member again."""
        learner = self.learner
        member = self.schedule.is_member(self.m, t)
        if learner.state is not None and not member:
            learner.finish()
            if self.link is not None:
                self.link.flush()
            self._event("learner_leave", step=learner.step)
            learner.crash()
            self.away = "leave"
        if not member and all(end <= t for _, end in self.schedule.member_windows[self.m]):
            return False
        time.sleep(0.02)
        return True
