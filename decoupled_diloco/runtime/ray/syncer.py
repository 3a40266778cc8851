"""A syncer shard as a Ray actor: host memory and CPU only, its own fault domain.

The actor hosts a `SyncerLoop` (runtime/syncer_loop.py) on its own thread. The loop
restores the shard's latest orbax checkpoint if there is one (a resumed run, or a process
Ray restarted after it died); a restarted shard first waits out a scheduled outage, then
sends every learner in its restored registry a snapshot. Learners hold what they could not
deliver meanwhile (`links.SyncerPoster`).

Merge and event records are buffered and collected by the driver's `poll`: the driver
alone writes merges.jsonl and events.jsonl. Records since the last poll die with the
process, but no checkpoint holds their merges: one commits once the driver has taken the
records made before it (`_delivered`), so a restored Θ holds no merge merges.jsonl lacks.
A fragment plan the shard cannot build is an error no restart fixes
(`preflight.FatalRunError`): the shard stays up without serving and `poll` reports it, so
the driver stops the run with the message.
"""

import os
import queue
import sys
import threading
import time
import traceback

from decoupled_diloco.config import RunConfig
from decoupled_diloco.preflight import FatalRunError, fatal_errors
from decoupled_diloco.runtime import gil

# Seconds a checkpoint waits for the driver to take the records of the merges it holds
# (a poll every `ray.poll_seconds`; longer while the driver evaluates Θ).
DELIVERY_WAIT_S = 120.0


def initial_params(run: RunConfig) -> dict:
    """The run's starting parameters Θ_0 as flat float32 numpy arrays, on this host's CPU.

    The same values as a learner's sharded init from the same seed (the threefry PRNG is
    partitionable), so every runtime starts from the same model.
    """
    import jax
    import numpy as np

    from decoupled_diloco import models, seeds

    params = jax.jit(lambda r: models.init_params(run.model, r))(seeds.key(run.train.seed))
    return {k: np.asarray(v, np.float32) for k, v in models.flatten_params(params).items()}


class SyncerActor:
    """Syncer shard `shard`; wrap with `ray.remote(...)` to use."""

    def __init__(
        self,
        shard: int,
        run: RunConfig,
        ckpt_dir: str,
        run_id: str,
        t0: float,
        fault_offset_s: float = 0.0,
    ):
        from decoupled_diloco import compile_cache, faults
        from decoupled_diloco.diloco.fragments import model_plan
        from decoupled_diloco.fragment_checkpoint import FragmentCheckpointer
        from decoupled_diloco.runtime.links import LocalSyncerLink
        from decoupled_diloco.runtime.ray import links
        from decoupled_diloco.runtime.ray.learner import was_restarted
        from decoupled_diloco.runtime.syncer_loop import SyncerLoop

        compile_cache.enable()
        gil.set_switch_interval(run.gil_switch_ms)  # the actor's process is its own
        self.shard, self.run, self.t0 = shard, run, t0
        restarted = was_restarted()
        self._records: list[dict] = []
        self._records_lock = threading.Lock()
        self._made = self._taken = 0  # records made, and taken by the driver's polls
        self.fatal = None
        try:
            with fatal_errors(f"syncer shard {shard}"):
                plan = model_plan(run.model, run.diloco)
        except FatalRunError as e:  # a restart would fail the same way: stay up, report it
            print(f"syncer shard {shard}: fatal error: {e}", file=sys.stderr, flush=True)
            self.fatal = str(e)
            return
        schedule = faults.FaultSchedule(
            run.faults, run.num_learners, faults.HORIZON_S, fault_offset_s
        )
        self.inbox: queue.Queue = queue.Queue()
        names = {m: links.actor_name(run_id, "learner", m) for m in range(run.num_learners)}
        link = LocalSyncerLink(
            self.inbox,
            links.LearnerMailboxes(names).boxes,
            reply_seconds=lambda m, n: schedule.transfer_seconds(m, n),
        )
        ckpt = FragmentCheckpointer(os.path.join(ckpt_dir, f"syncer_{shard}"))
        self.loop = SyncerLoop(
            shard, run, plan, initial_params(run), link, ckpt,
            schedule, self.now, self._record, emulate_outages=False, restarted=restarted,
            before_commit=self._delivered,
        )  # fmt: skip
        self._record(
            {
                "event": "syncer_start",
                "shard": shard,
                "pid": os.getpid(),
                "process_restart": restarted,
                "time": self.now(),
            }
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"syncer{shard}", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.time() - self.t0

    def _record(self, rec: dict) -> None:
        with self._records_lock:
            self._records.append(rec)
            self._made += 1

    def _delivered(self) -> bool:
        """Before a checkpoint commits: waits until the driver's polls have taken every record
        made so far. Records not yet taken die with the process, and a checkpoint holding
        their merges would restore a Θ that merges.jsonl and the work accounting do not
        know of. Not at the end (`finish` hands the last records over itself), nor past
        DELIVERY_WAIT_S without a poll (logged). True: the checkpoint commits."""
        with self._records_lock:
            made = self._made
        deadline = time.monotonic() + DELIVERY_WAIT_S
        while not self._stop.is_set():
            with self._records_lock:
                if self._taken >= made:
                    return True
            if time.monotonic() > deadline:
                print(f"syncer shard {self.shard}: the driver took no records for "
                      f"{DELIVERY_WAIT_S:g} s; checkpointing merges it has not recorded",
                      file=sys.stderr, flush=True)  # fmt: skip
                return True
            time.sleep(0.01)
        return True

    # --- actor methods (other threads) -------------------------------------------------
    def pid(self) -> int:
        return os.getpid()

    def post(self, msg) -> None:
        self.inbox.put(msg)

    def queued(self) -> int:
        """Messages posted and not yet taken by the serving loop (it handles what it takes
        as one batch: `Syncer.handle_batch`)."""
        return self.inbox.qsize()

    def poll(self) -> dict:
        import ray

        with self._records_lock:
            records, self._records = self._records, []
            self._taken += len(records)
        # Read after the records: the traffic then holds every merge they record.
        traffic = {} if self.fatal else self.loop.traffic()
        return {
            "records": records,
            "traffic": traffic,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "fatal": self.fatal,
        }

    def global_params(self) -> dict:
        """A copy of this shard's Θ (flat name -> float32 numpy)."""
        return self.loop.global_params()

    def finish(self) -> dict:
        """End of run: merges what is pending (quorum or not), saves, stops serving."""
        self._stop.set()
        self._thread.join()
        with self._records_lock:
            records, self._records = self._records, []
        import ray

        node = ray.get_runtime_context().get_node_id()
        return {"stats": self.loop.stats(), "traffic": self.loop.traffic(), "records": records,
                "pid": os.getpid(), "node": node}  # fmt: skip

    # --- the serving thread ------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.loop.run(self._stop)
            self.loop.close()
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
