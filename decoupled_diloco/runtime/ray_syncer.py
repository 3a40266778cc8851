"""A syncer shard as a Ray actor: host memory and CPU only, its own fault domain.

The constructor builds the shard and restores its latest orbax checkpoint if there is one
(a resumed run, or a process Ray restarted after it died), then serves on its own thread.
A restarted shard first waits out a scheduled outage, then sends every learner in its
restored registry a Snapshot, exactly as the local runtime's syncer thread does; learners
that joined after that checkpoint are re-registered by their next heartbeat. Learners hold
what they could not deliver meanwhile (`ray_links.SyncerPoster`).

Merge and event records are buffered and collected by the driver's `poll`: the driver
alone writes merges.jsonl and events.jsonl (records since the last poll die with the
process).
"""

import os
import queue
import sys
import threading
import time
import traceback

from decoupled_diloco.config import RunConfig


def initial_params(run: RunConfig) -> dict:
    """The run's starting parameters Θ_0 as flat float32 numpy arrays, on this host's CPU.

    The same values as a learner's sharded init from the same seed (the threefry PRNG is
    partitionable), so every runtime starts from the same model.
    """
    import jax
    import numpy as np

    from decoupled_diloco import models
    from decoupled_diloco.diloco.fragments import flatten_params

    params = jax.jit(lambda r: models.init_params(run.model, r))(jax.random.key(run.train.seed))
    return {k: np.asarray(v, np.float32) for k, v in flatten_params(params).items()}


class SyncerActor:
    """Syncer shard `shard`; wrap with `ray.remote(...)` to use."""

    def __init__(self, shard: int, run: RunConfig, ckpt_dir: str, run_id: str, t0: float):
        from decoupled_diloco import faults
        from decoupled_diloco.checkpoint import Checkpointer
        from decoupled_diloco.runtime import ray_links, syncer_host
        from decoupled_diloco.runtime.links import LocalSyncerLink
        from decoupled_diloco.runtime.local import SCHEDULE_HORIZON_S
        from decoupled_diloco.runtime.ray_learner import configure_jax, was_restarted

        configure_jax()
        self.shard, self.run, self.t0 = shard, run, t0
        self.restarted = was_restarted()
        self.lock = threading.Lock()  # around the Syncer object: its thread vs. actor calls
        self._records: list[dict] = []
        self._records_lock = threading.Lock()
        self.schedule = faults.FaultSchedule(run.faults, run.num_learners, SCHEDULE_HORIZON_S)
        self.plan = syncer_host.fragment_plan(run)
        self.syncer = syncer_host.new_syncer(
            run.syncer, self.plan, initial_params(run), run.num_learners, shard, self._record
        )
        self.ckpt = Checkpointer(os.path.join(ckpt_dir, f"syncer_{shard}"))
        if syncer_host.restore_syncer(self.syncer, self.ckpt, self.now()):
            self._record(
                {
                    "event": "syncer_restore",
                    "shard": shard,
                    "versions": dict(self.syncer.version),
                    "epoch": self.syncer.epoch,
                    # records of this shard after this many were rolled back (as in process)
                    "log_position": self.syncer.log_position,
                    "time": self.now(),
                }
            )
        self._record(
            {
                "event": "syncer_start",
                "shard": shard,
                "pid": os.getpid(),
                "process_restart": self.restarted,
                "time": self.now(),
            }
        )
        self.inbox: queue.Queue = queue.Queue()
        names = {m: ray_links.actor_name(run_id, "learner", m) for m in range(run.num_learners)}
        self.link = LocalSyncerLink(
            self.inbox,
            ray_links.LearnerMailboxes(names).boxes,
            reply_seconds=lambda m, n: self.schedule.transfer_seconds(m, n),
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"syncer{shard}", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.time() - self.t0

    def _record(self, rec: dict) -> None:
        with self._records_lock:
            self._records.append(rec)

    # --- actor methods (other threads) -------------------------------------------------
    def pid(self) -> int:
        return os.getpid()

    def post(self, msg) -> None:
        self.inbox.put(msg)

    def poll(self) -> dict:
        import ray

        with self._records_lock:
            records, self._records = self._records, []
        return {
            "records": records,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
        }

    def global_params(self) -> dict:
        """A copy of this shard's Θ (flat name -> float32 numpy)."""
        with self.lock:
            return {k: v.copy() for k, v in self.syncer.global_params().items()}

    def finish(self) -> dict:
        """End of run: merges what is pending (quorum or not), saves, stops serving."""
        self._stop.set()
        self._thread.join()
        with self._records_lock:
            records, self._records = self._records, []
        return {"stats": dict(self.syncer.stats), "records": records}

    # --- the serving thread ------------------------------------------------------------
    def _main(self) -> None:
        from decoupled_diloco.runtime import syncer_host

        try:
            while self.restarted and not self.schedule.syncer_up(self.now()):
                time.sleep(0.02)  # a scheduled outage: learners hold their messages
            if self.restarted:
                for m, info in list(self.syncer.learners.items()):
                    if info.joined:
                        self.link.send(m, self.syncer.snapshot(self.now()))
            period = self.run.syncer.checkpoint_seconds
            last_ckpt = self.now()
            while not self._stop.is_set():
                syncer_host.serve_turn(self.syncer, self.link, self.now, self.lock)
                if self.now() - last_ckpt >= period:
                    syncer_host.save_syncer(self.syncer, self.ckpt, self.plan, self.lock)
                    last_ckpt = self.now()
            with self.lock:
                for msg in self.link.receive(0.0):
                    self.syncer.handle(msg, self.now())
                self.syncer.flush(self.now())
            syncer_host.save_syncer(self.syncer, self.ckpt, self.plan, self.lock, wait=True)
            self.ckpt.close()
        except BaseException:
            err = traceback.format_exc()
            print(f"syncer shard {self.shard} failed:\n{err}", file=sys.stderr, flush=True)
            self._record(
                {
                    "event": "syncer_error",
                    "shard": self.shard,
                    "error": err.strip().splitlines()[-1],
                    "time": self.now(),
                }
            )
            time.sleep(2 * self.run.ray.poll_seconds + 1.0)
            os._exit(1)  # die like a killed process: Ray restarts it from its checkpoint
