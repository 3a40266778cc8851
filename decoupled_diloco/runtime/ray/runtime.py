"""The Ray runtime: learners and syncer shards as separate processes (Ray actors).

    python -m decoupled_diloco.main --config=configs/tiny_decoupled.py --workdir=/tmp/dd \
        --config.runtime=ray                                    # a local Ray cluster
        --config.ray.address=HEAD_IP:6379                       # or an existing one

Each learner is an actor in its own process owning its own devices (`learner.py`), each
syncer shard an actor on the host CPU (`syncer.py`); both host the same loops as the local
runtime (runtime/learner_loop.py, runtime/syncer_loop.py) and talk through the same narrow
transport, over Ray (`links.py`). The driver (this file) only launches, watches and reports:
- launch: connects to (or starts) the cluster, creates the syncer shards, then M learners;
- watch: every `ray.poll_seconds` it collects learner rows and events, the syncer's merge
  records and every process's pid; it applies the fault schedule's crashes by killing the
  real processes (SIGKILL by pid on this node, `ray.kill` elsewhere); at `train.eval_every`
  it has Θ evaluated where `ray.evaluate` says: on its own devices (fetched from the syncer
  shards as numpy), on a learner's devices (TPU), or not at all (eval.py);
- report: the driver is the only writer of metrics.jsonl, merges.jsonl, events.jsonl and
  summary.json (same keys as the local runtime), so actors need no shared filesystem for
  them. Checkpoints are written by the actors themselves under `ray.checkpoint_dir`, which
  must be reachable from every node of a multi-node cluster.

A learner whose process dies more than `ray.max_restarts` times is lost (`learner_lost`), one
that raises the same error `ray.max_same_failures` times in a row is stopped
(`learner_stopped`, failures.py): the run goes on without it, and fails only when no learner
is left. A syncer shard whose restarts are exhausted, or that raises the same error
`ray.max_same_failures` times in a row with no merge in between, fails the run at once, with
its last error (its fragments could never merge again). An error no restart can fix
(`preflight.FatalRunError`) is reported by the actor's poll and stops the run at once.

Differences from the local runtime, from real process boundaries: rows and records buffered
in a process when it dies are lost; a scheduled crash lasts at least as long as Ray needs
to restart the process. A step schedule (`faults.unit = "steps"`) fires within one
`ray.poll_seconds` of its step; its crashes last as long as Ray's restart (a new process
cannot know when its predecessor died: no `restart_delay_s`); step membership is refused.
"""

import contextlib
import math
import os
import signal
import sys
import threading
import time
import uuid

import jax
import ray

from decoupled_diloco import cli, faults, paths, run_files, sharding
from decoupled_diloco.config import RunConfig
from decoupled_diloco.diloco.messages import Leave
from decoupled_diloco.metrics import Progress, write_json
from decoupled_diloco.preflight import FatalRunError
from decoupled_diloco.runtime import accounting
from decoupled_diloco.runtime.learner_loop import (
    TAIL_NOTICE,
    RunInterruptedError,
    interrupt_notice,
)
from decoupled_diloco.runtime.ray import cluster as ray_cluster
from decoupled_diloco.runtime.ray import eval as ray_eval
from decoupled_diloco.runtime.ray import failures
from decoupled_diloco.runtime.ray import links as ray_links
from decoupled_diloco.runtime.ray.learner import LearnerActor
from decoupled_diloco.runtime.ray.syncer import SyncerActor
from decoupled_diloco.runtime.records import RunLog
from decoupled_diloco.runtime.summary import run_summary
from decoupled_diloco.train.evaluate import Evaluator


class RayRuntime:
    def __init__(self, run: RunConfig, workdir: str, verbose: bool = True,
                 fault_offset_s: float = 0.0, fault_steps: dict | None = None,
                 attempt: int | None = None):  # fmt: skip
        """`fault_offset_s`: where this attempt starts on the fault timeline
        (`workdir.Attempt.fault_offset`; every actor draws the timeline from it);
        `fault_steps`: how far earlier attempts checked a schedule in steps, which the
        driver applies (`workdir.Attempt.fault_steps`); `attempt`: its number, on every
        record (`RunLog`)."""
        self.run_cfg, self.workdir, self.verbose = run, workdir, verbose
        paths.resolve(workdir).mkdir(parents=True, exist_ok=True)
        self.log = RunLog(workdir, accounting.Ledger.of_run(run), run.train.tensorboard, attempt)
        self.ledger = self.log.ledger
        self.schedule = faults.FaultSchedule(
            run.faults, run.num_learners, faults.HORIZON_S, fault_offset_s, fault_steps
        )
        # Actors resolve paths from their own working directory: give them an absolute one.
        self.ckpt_dir = str(paths.resolve(run.ray.checkpoint_dir or f"{workdir}/checkpoints"))
        self.evals = ray_eval.DriverEvals()
        self.progress = None  # the console line, from _build_evaluator on
        self.t0 = time.time()
        M = run.num_learners
        self.learners: dict[tuple[int, int], object] = {}  # (m, host) -> actor handle
        self.syncers: list = []
        self.status = [{"step": 0, "done": False} for _ in range(M)]
        rc = run.ray
        self.fates = failures.LearnerFates(M, rc.max_same_failures, rc.max_restarts, self.log)
        self.lost = self.fates.out  # learners out of the run for good: lost or stopped
        self.pids: dict[tuple, tuple[int, str]] = {}  # (role, index, host) -> (pid, node)
        # Learner processes this driver took down itself (a scheduled crash, or the rest of
        # a slice one of whose hosts restarted): their next pid is expected, not a failure.
        self._restarting: set[tuple] = set()
        self._pending: dict[tuple, object] = {}  # in-flight poll per actor
        # (shard, pid, node) -> that process's syncer traffic at its last poll: a process
        # Ray restarted counts from 0, and its predecessor's bytes stay the run's.
        self._traffic: dict[tuple[int, int, str], dict] = {}
        self._traffic_lock = threading.Lock()  # (the attempt's heartbeat reads it)
        self._syncer_errors: dict[int, str] = {}  # shard -> its last `syncer_error`
        # The learners' stopping rule, for shards: with unlimited restarts (the TPU configs)
        # a shard raising the same error in every life would restart forever and never
        # merge. Its "step" is the count of its merges recorded here: one breaks a streak.
        self._syncer_repeats = failures.RepeatedFailures(rc.max_same_failures)
        self._syncer_merges: dict[int, int] = {}  # shard -> its merge records so far
        self._started: dict[int, int] = {}  # learner -> the step this attempt started from
        self._died_at: dict[int, int] = {}  # learner -> the last step its dead process reported
        # learner -> the step its current life began (its start, rejoin or member_join; a
        # leave ends it): what Θ lacks of that life is lost if no rejoin ever cuts it.
        self._life_at: dict[int, int] = {}
        self._earlier_rows = self.log.metrics.count()  # metrics rows of earlier attempts
        self._fault_t = 0.0
        self.run_id: str | None = None  # set when the actors launch (and the clock starts)

    def now(self) -> float:
        return time.time() - self.t0

    def bytes_communicated(self) -> int:
        """Bytes the syncer shards received and sent so far in this attempt, every process
        of theirs included; a killed one's up to its last poll (`ray.poll_seconds`)."""
        with self._traffic_lock:
            return sum(t.get("bytes_in", 0) + t.get("bytes_out", 0)
                       for t in self._traffic.values())  # fmt: skip

    def _note_traffic(self, shard: int, out: dict, traffic: dict) -> None:
        """Shard `shard`'s process that answered `out` (a poll's or `finish`'s) has sent and
        received `traffic` so far."""
        with self._traffic_lock:
            self._traffic[shard, out["pid"], out["node"]] = traffic

    def _shard_traffic(self, shard: int) -> dict:
        """Shard `shard`'s `bytes_in` / `bytes_out` summed over its processes."""
        with self._traffic_lock:
            lives = [t for (s, *_), t in self._traffic.items() if s == shard]
        return {k: sum(t.get(k, 0) for t in lives) for k in ("bytes_in", "bytes_out")}

    def fault_clock(self) -> float:
        """Where the run stands on its fault timeline: the earlier attempts' seconds plus
        this one's since its actors launched, until a Ctrl-C stopped its training."""
        return self.schedule.run_time(self.now()) if self.run_id else self.schedule.offset

    # --- launch -----------------------------------------------------------------------
    def run(self) -> dict:
        started = ray_cluster.connect(self.run_cfg.ray, self.verbose)
        try:
            # A cluster without the slices the run needs fails here, before the workdir
            # records a run (its config would bind the next start in it).
            layouts = self._layouts()
            run_files.write(self.workdir, self.run_cfg)
            self._launch(layouts)
            try:
                self._build_evaluator()
                self._watch()
            except KeyboardInterrupt:
                cli.interrupt_handled()
                self._interrupt()
            return self._finish()
        finally:
            for h in [*self.learners.values(), *self.syncers]:
                ray.kill(h, no_restart=True)
            if started:
                ray.shutdown()
            self.log.close()

    def _layouts(self) -> list[dict | None]:
        """Each learner's TPU slice and host layout (None: not on TPU slices)."""
        run = self.run_cfg
        if run.ray.accelerator != "tpu":
            return [None] * run.num_learners
        slices = ray_cluster.tpu_slices(ray.nodes())
        return ray_cluster.learner_hosts(slices, run.num_learners, run.devices_per_learner)

    def _launch(self, layouts: list[dict | None]) -> None:
        # Actors read the tokenizer the driver trained (if any), never train their own.
        run = run_files.with_shared_tokenizer(self.run_cfg, self.ckpt_dir)
        rc = run.ray
        self.run_id = uuid.uuid4().hex[:8]
        self.t0 = time.time()
        self.log.event(
            {"event": "run_start", "run_id": self.run_id, "wall_t0": self.t0, "time": 0.0}
        )
        shards = run.diloco.syncer_shards
        opts = ray_cluster.syncer_options(ray.cluster_resources(), shards, rc.max_restarts)
        for s in range(shards):
            name = ray_links.actor_name(self.run_id, "syncer", s)
            actor = ray.remote(SyncerActor).options(name=name, **opts)
            self.syncers.append(
                actor.remote(s, run, self.ckpt_dir, self.run_id, self.t0, self.schedule.offset)
            )
        self.hosts = [1 if h is None else h["hosts"] for h in layouts]
        for m, layout in enumerate(layouts):
            for host in range(self.hosts[m]):
                o = ray_cluster.learner_options(
                    rc.accelerator, run.devices_per_learner, rc.max_restarts, layout, host
                )
                name = ray_links.actor_name(self.run_id, "learner", m, host)
                actor = ray.remote(LearnerActor).options(name=name, **o)
                slice_id = "" if layout is None else layout["slice"]
                self.learners[(m, host)] = actor.remote(
                    m, run, self.ckpt_dir, self.run_id, self.t0, host, self.hosts[m], slice_id,
                    self.schedule.offset,
                )  # fmt: skip

    def _build_evaluator(self) -> None:
        """With `ray.evaluate = "driver"`, evaluates Θ on the driver's devices: learner 0's
        device group when the driver has that many (the local runtime's choice), else one."""
        run = self.run_cfg
        self.progress = Progress(run.train.steps, learners=run.num_learners)
        self.evaluator = None
        if run.ray.evaluate != "driver":
            return
        if jax.device_count() >= run.devices_per_learner:
            devices = sharding.learner_devices(jax.devices(), run.devices_per_learner, 0)
            mesh = sharding.make_mesh(devices, run.mesh)
        else:
            mesh = sharding.make_mesh(jax.devices()[:1], sharding.MeshConfig())
        self.evaluator = Evaluator(
            run.model, run.data, mesh, run.train.batch_size, run.train.eval_batches
        )

    # --- watch ------------------------------------------------------------------------
    def _watch(self) -> None:
        run = self.run_cfg
        next_eval = None  # once every learner said where it starts (`_started`)
        while not all(s["done"] or m in self.lost for m, s in enumerate(self.status)):
            time.sleep(run.ray.poll_seconds)
            cli.raise_pending_interrupt()  # one a callback swallowed (cli.py)
            self._collect()
            self._apply_faults()
            lead = max(s["step"] for s in self.status)
            if next_eval is None and self._all_started():
                next_eval = self._evaluations_start()
            if next_eval and lead >= next_eval and lead < run.train.steps:
                next_eval = accounting.next_eval_step(lead, run.train.eval_every)
                row = {
                    "learner": "global",
                    "step": lead,
                    "tokens": self._tokens(),
                    "merges": self.ledger.merges,
                    "time": self.now(),
                }
                if run.ray.evaluate == "driver":
                    self.log.row({**row, "eval_loss": self.evaluator(self._global_params())})
                elif run.ray.evaluate == "learner" and (m := self._eval_learner()) is not None:
                    self.evals.request(self._processes(m), self.syncers, row)
        if len(self.lost) == run.num_learners:
            raise RuntimeError(
                f"every learner is out for good (ray.max_restarts={run.ray.max_restarts}, "
                f"ray.max_same_failures={run.ray.max_same_failures}); last errors: "
                f"{self.fates.errors}"
            )

    def _interrupt(self) -> None:
        """Ctrl-C: every learner stops at its next step boundary, offers what Θ lacks of its
        work, leaves and saves; the syncer shards merge it and save. Then RunInterruptedError
        (no summary): the same command resumes. A second Ctrl-C stops at once, losing what
        the last checkpoints do not hold."""
        print(interrupt_notice(self.run_cfg.uses_syncer), file=sys.stderr, flush=True)
        self.schedule.freeze(self.now())  # the driver applies no fault while the run drains
        asked: dict[int, tuple] = {}  # m -> (the call, the process it was made to)
        while not all(s["done"] or m in self.lost for m, s in enumerate(self.status)):
            for m in range(self.run_cfg.num_learners):
                if self.status[m]["done"] or m in self.lost:
                    continue
                pid = self.pids.get(("learner", m, 0))
                if m not in asked or _failed(asked[m][0]) or asked[m][1] != pid:
                    # again when the call failed or Ray restarted the process since
                    asked[m] = (self.learners[(m, 0)].interrupt.remote(), pid)
            self._collect(wait=self.run_cfg.ray.poll_seconds)
        self._finish_syncers()
        raise self._stopped(self.now())

    def _finish_syncers(self) -> list[dict]:
        """Ends every syncer shard (its pending merges, its last save) and records its last
        records: first those of a poll still in flight, which took them from the shard's
        buffer (left unread, a merge Θ holds went missing from merges.jsonl), then the
        shard's own. Returns the shards' stats, their traffic that of all their processes."""
        stats = []
        for s, actor in enumerate(self.syncers):
            ref = self._pending.pop(("syncer", s, 0), None)
            if ref is not None:
                # (its process died: its records with it)
                with contextlib.suppress(ray.exceptions.RayActorError,
                                         ray.exceptions.GetTimeoutError):  # fmt: skip
                    self._syncer_report(s, ray.get(ref, timeout=60.0))
            out = _call(actor.finish)
            self._syncer_report(s, out)
            # The traffic of every process the shard ran in, not the last one's alone.
            stats.append({**out["stats"], **self._shard_traffic(s)})
        return stats

    def _syncer_report(self, shard: int, out: dict) -> None:
        """A syncer shard's poll or `finish`: its records since the last, its traffic."""
        repeated = None  # the message when the shard failed the same way too often
        for rec in out["records"]:
            self.log.record(rec)
            merges = self._syncer_merges.get(shard, 0)
            if rec.get("event") == "merge":
                self._syncer_merges[shard] = merges + 1
                self._syncer_repeats.progressed(shard, merges + 1)
            elif rec.get("event") == "syncer_error":
                self._syncer_errors[shard] = rec["error"]
                if self._syncer_repeats.failed(shard, rec["error"], merges):
                    n = self._syncer_repeats.streaks[shard].count
                    repeated = (
                        f"syncer shard {shard} failed {n} times in a row with the same error, "
                        f"merging nothing in between (ray.max_same_failures="
                        f"{self._syncer_repeats.limit}); Ray would restart it again and again: "
                        f"last error: {rec['error']}"
                    )
        self._note_traffic(shard, out, out["traffic"])
        if repeated:  # (its records all written first)
            raise RuntimeError(repeated)

    def _stopped(self, wall: float) -> RunInterruptedError:
        """The end of a run a Ctrl-C stopped (learners and syncer shards saved), with this
        attempt's accounting up to `wall`."""
        if self.progress is not None:
            self.progress.close()
        steps = [s["step"] for s in self.status]
        accounting = self.ledger.accounting(wall, True, steps)
        return RunInterruptedError(f"interrupted at learner steps {steps}", accounting)

    def _collect(self, wait: float | None = None) -> None:
        """Issues a poll to every actor without one in flight, handles those that answer
        within `wait` seconds (default: a poll period, at most 1 s)."""
        actors = {("learner", m, h): a for (m, h), a in self.learners.items() if m not in self.lost}
        actors.update({("syncer", s, 0): a for s, a in enumerate(self.syncers)})
        for key, actor in actors.items():
            if key not in self._pending:
                self._pending[key] = actor.poll.remote()
        refs = list(self._pending.values())
        if wait is None:
            wait = min(1.0, self.run_cfg.ray.poll_seconds)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait)
        ready = set(ready)
        for key, ref in list(self._pending.items()):
            if ref not in ready:
                continue
            del self._pending[key]
            try:
                out = ray.get(ref)
            except ray.exceptions.ActorDiedError as e:  # restarts exhausted: gone for good
                if key[0] == "syncer":
                    raise self._syncer_lost(key[1], e) from e
                if key[1] not in self.lost:
                    m = key[1]
                    self._leave(m)
                    self._remove(m, False, str(e))
                continue
            except ray.exceptions.RayActorError:
                continue  # down or restarting; the next poll tells
            self._seen_pid(key, out["pid"], out["node"])
            if key[0] == "syncer":
                self._syncer_report(key[1], out)
            elif key[2] == 0:
                self._learner_report(key[1], out)
            if out.get("fatal"):  # learners log their own fatal_error event
                if key[0] == "syncer":
                    self.log.event({"event": "fatal_error", "shard": key[1],
                                    "error": out["fatal"], "time": self.now()})  # fmt: skip
                raise FatalRunError(out["fatal"])

    def _syncer_lost(self, shard: int, e: ray.exceptions.ActorDiedError) -> RuntimeError:
        """Syncer shard `shard` is gone for good (Ray's restarts exhausted, or its constructor
        raised: a checkpoint it cannot restore, say). Unlike a lost
        learner, no one can stand in for it: its fragments would never merge again while
        the learners trained on apart to the end and then waited out their final syncs, so
        the run stops now, with the shard's own last error rather than Ray's."""
        lines = str(e).strip().splitlines() or [type(e).__name__]
        if e.actor_init_failed:  # Ray's message ends with the constructor's exception
            return RuntimeError(
                f"syncer shard {shard} failed to start ({lines[-1]}); Ray does not restart an "
                "actor whose constructor raised, and the run cannot merge without it"
            )
        why = self._syncer_errors.get(shard) or lines[0]
        return RuntimeError(
            f"syncer shard {shard} is lost for good (ray.max_restarts="
            f"{self.run_cfg.ray.max_restarts} exhausted): its fragments can no longer merge; "
            f"last error: {why}. Its last checkpoint is under {self.ckpt_dir}/syncer_{shard}"
        )

    def _learner_started(self, m: int, step: int) -> None:
        """The first of learner m's processes in this attempt to report starts from `step`
        (its checkpoint's; a restart's too when its predecessor never reported): the rows an
        earlier attempt logged past it are redone (and logged again) now. (The local runtime
        drops them before its learners start.)"""
        self._started[m] = step
        # A step schedule is checked from the step the learner starts at, as the local
        # runtime's learner checks it before each step: the first poll that sees the learner
        # may find it many steps on, and its crashes scheduled in between then fire there
        # (late, as every polled step's), where they were taken as passed and never fired.
        self.schedule.learner_reached(m, step, self.now())
        if self._earlier_rows:
            self.log.metrics.retain(lambda r: r["learner"] != m or r.get("step", 0) <= step)

    def _evaluations_start(self) -> int:
        """Every learner has started (`_all_started`): the earlier attempts' global rows past
        the lead go, and Θ is next evaluated at the first `train.eval_every` past it."""
        lead = max(self._started.values(), default=0)
        if self._earlier_rows:
            self.log.metrics.retain(lambda r: r["learner"] != "global" or r.get("step", 0) <= lead)
        return accounting.next_eval_step(lead, self.run_cfg.train.eval_every)

    def _all_started(self) -> bool:
        """Every learner's first process of this attempt has said where it starts (or the
        learner is out of the run)."""
        return all(m in self._started or m in self.lost for m in range(len(self.status)))

    def _learner_report(self, m: int, out: dict) -> None:
        if "start_step" in out and m not in self._started:
            self._learner_started(m, out["start_step"])
        for seconds, t in out["steps"]:
            self.ledger.step(m, seconds, t)
        for ev in out["events"]:
            self._learner_event(m, ev)
        for result in out["evals"]:
            if "error" in result:
                self.log.event({"event": "eval_error", "learner": m, **result})
            row = self.evals.result(result)
            if row is not None:
                self.log.row(row)
        for row in out["rows"]:
            self.log.row(row)
            if self.verbose:
                text = self.log.progress_text(row, self.run_cfg.uses_syncer)
                self.progress.learner_row(m, row["step"], text)
        self.status[m] = {k: out[k] for k in ("step", "done", "incarnation")}
        self.fates.repeats.progressed(m, out["step"])
        if out["done"]:
            if m in self._died_at:  # restarted, and done without a rejoin: out of membership
                self._gone(m, self._died_at.pop(m))
            self.ledger.finish(m, out["finished_at"])

    def _learner_event(self, m: int, ev: dict) -> None:
        if ev["event"] == "rejoin" and ev.get("process_restart"):
            ev = self._with_unseen_loss(m, ev)
        self.log.event(ev)
        if ev["event"] in ("learner_start", "rejoin", "member_join"):
            self._life_at[m] = ev["step"]
        elif ev["event"] == "learner_leave":  # (its final sync offered its work)
            self._life_at.pop(m, None)
        if ev["event"] == "learner_error":
            step = self.status[m]["step"] if ev.get("step") is None else ev["step"]
            if self.fates.error(m, ev["error"], step):
                self._stop(m)

    def _with_unseen_loss(self, m: int, ev: dict) -> dict:
        """The `rejoin` of learner m's restarted process, whose loss (`lost_steps`, its cut's)
        ends at the step it goes on from: the steps its dead predecessor took past that one
        are lost too, in every fragment (none holds a step past the cut), as far as this
        driver saw them (the dead process's last report; those after it are in no count,
        trained or lost)."""
        died_at, start = self._died_at.pop(m, None), ev["step"]
        if died_at is None or died_at <= start:
            return ev
        from decoupled_diloco.diloco.fragments import model_plan

        fragments = model_plan(self.run_cfg.model, self.run_cfg.diloco).num_fragments
        cut = ev.get("lost_spans") or {}
        spans = {str(p): [*cut.get(str(p), []), [start, died_at]] for p in range(fragments)}
        lost = max(accounting.span_steps(s) for s in spans.values())
        return {**ev, "lost_steps": lost, "lost_spans": spans, "unseen_lost_steps": died_at - start}

    def _gone(self, m: int, step: int) -> None:
        """Learner m's process died at `step` and no process of it will rejoin (its
        membership ended while it was down, or it is out of the run): no rejoin's cut counts
        what the death lost, so `learner_gone` has the ledger count what Θ lacks of the
        life that died (the local runtime's learner loop emits it itself)."""
        start = self._life_at.pop(m, None)
        if start is None:
            return  # (it never started, or left gracefully: nothing unmerged was lost)
        self.log.event({"event": "learner_gone", "learner": m, "step": step,
                        "life_start": start, "time": self.now()})  # fmt: skip

    def _stop(self, m: int) -> None:
        """Learner m failed the same way too often (failures.py): its processes go without
        a restart, and it leaves the syncer shards' membership."""
        for h in range(self.hosts[m]):
            ray.kill(self.learners[(m, h)], no_restart=True)
        self._leave(m)
        self._remove(m, stopped=True)

    def _remove(self, m: int, stopped: bool, error: str = "") -> None:
        """Learner m is out of the run for good (failures.py); the life it was in is lost."""
        if m in self.lost:
            return
        step = self._died_at.pop(m, self.status[m]["step"])
        self.fates.remove(m, self.status[m]["step"], self.now(), stopped, error)
        if not self.status[m]["done"]:  # (a finished learner's work is all offered)
            self._gone(m, step)

    def _leave(self, m: int) -> None:
        """Learner m's process is gone (killed here, or out for good): every syncer shard
        hears that it left, in its last known life, so that no round waits for it and it
        leaves the roster now, not after `diloco.heartbeat_timeout` of silence (its
        pending offers stay valid; a restarted process joins as a new life)."""
        if "incarnation" in self.status[m]:  # it has joined the syncer (else: nothing to do)
            leave = Leave(m, self.status[m]["incarnation"], self.now())
            for actor in self.syncers:
                actor.post.remote(leave)

    def _seen_pid(self, key: tuple, pid: int, node: str) -> None:
        """Tracks processes; a restarted host of a multi-host slice takes its siblings down
        too (a slice's processes run one program together and must restart together)."""
        old = self.pids.get(key)
        self.pids[key] = (pid, node)
        role, m, host = key
        if role != "learner" or old is None or old[0] == pid:
            return
        if host == 0 and not self.status[m]["done"]:  # (a finished one lost nothing)
            # Its new process's rejoin counts what the dead one trained past it.
            self._died_at[m] = self.status[m]["step"]  # the dead process's last report
        if key in self._restarting:
            # Restarted because this driver took it down (with its slice): restarting its
            # siblings again would take this one down once more, and so on without end.
            self._restarting.discard(key)
            return
        for h in range(self.hosts[m]):
            if h != host:
                self._restarting.add(("learner", m, h))
                ray.kill(self.learners[(m, h)], no_restart=False)

    def _eval_learner(self) -> int | None:
        """The learner that evaluates Θ with `ray.evaluate = "learner"`: the lowest-numbered
        one still in the run (None: none is)."""
        return next((m for m in range(self.run_cfg.num_learners) if m not in self.lost), None)

    def _processes(self, m: int) -> list:
        return [self.learners[(m, h)] for h in range(self.hosts[m])]

    # --- faults -----------------------------------------------------------------------
    def _apply_faults(self) -> None:
        now = self.now()
        # A step schedule's faults land at the steps polled (fault_steps.py).
        for m, s in enumerate(self.status):
            if "incarnation" in s and not s["done"]:  # it has reported its step
                self.schedule.learner_reached(m, s["step"], now)
        self.schedule.run_reached(max(s["step"] for s in self.status), now)
        end = math.nextafter(now, math.inf)  # the events placed at `now` included
        for ev in self.schedule.events_between(self._fault_t, end):
            if ev.kind == "crash" and not self.status[ev.learner]["done"]:
                m = ev.learner
                for h in range(self.hosts[m]):
                    self._kill(("learner", m, h), self.learners[(m, h)])
                self._leave(m)  # until its restarted process joins as a new life
                self.log.event(
                    {
                        "event": "learner_down",
                        "learner": m,
                        "step": self.status[m]["step"],
                        "pid": self.pids.get(("learner", m, 0), (None,))[0],  # None: not up yet
                        "time": ev.time,
                    }
                )
            elif ev.kind == "syncer_crash":
                for s, actor in enumerate(self.syncers):
                    self._kill(("syncer", s, 0), actor)
                    self.log.event({"event": "syncer_crash", "shard": s, "time": ev.time})
        self._fault_t = end

    def _kill(self, key: tuple, actor) -> None:
        """SIGKILL the actor's process: by pid on this node, through Ray elsewhere."""
        if key[0] == "learner":
            self._restarting.add(key)
        pid, node = self.pids.get(key, (None, None))
        if pid is not None and node == ray.get_runtime_context().get_node_id():
            try:
                os.kill(pid, signal.SIGKILL)
                return
            except ProcessLookupError:
                pass
        ray.kill(actor, no_restart=False)

    # --- report -----------------------------------------------------------------------
    def _global_params(self) -> dict:
        from decoupled_diloco.diloco.fragment_members import join_members

        out = {}
        for actor in self.syncers:
            out.update(_call(actor.global_params))
        return join_members(out)  # whole leaves from fragment members

    def _tokens(self) -> int:
        tokens_per_batch = self.run_cfg.train.batch_size * self.run_cfg.data.seq_len
        return sum(s["step"] for s in self.status) * tokens_per_batch

    def _finish(self) -> dict:
        run = self.run_cfg
        wall = self.now()
        # A Ctrl-C from here on would cut short the syncer shards' last merges and saves:
        # it waits for them, then ends the run as interrupted (the same command summarises).
        with cli.interrupts_deferred(TAIL_NOTICE) as press:
            self._collect(wait=30.0)  # the last rows and records
            stats = self._finish_syncers()
        if press.pressed:
            raise self._stopped(wall)
        final = self._final_eval()
        steps = max(s["step"] for s in self.status)
        self.log.row(
            {
                "learner": "global",
                "step": steps,
                "tokens": self._tokens(),
                "eval_loss": final,
                "time": wall,
            }
        )
        summary = run_summary(
            run,
            final,
            steps,
            self._tokens(),
            wall,
            self.ledger.summary(wall, True, [s["step"] for s in self.status]),
            stats,
            merge_records=self.log.merges.count(),
        )
        write_json(paths.resolve(self.workdir) / "summary.json", summary)
        self.progress.close()
        return summary

    def _final_eval(self) -> float:
        """Θ's final eval loss, evaluated where `ray.evaluate` says (NaN: "off" or failed)."""
        mode = self.run_cfg.ray.evaluate
        if mode == "driver":
            return self.evaluator(self._global_params())
        m = self._eval_learner()
        if mode == "off" or m is None:
            return math.nan
        tag = self.evals.request(self._processes(m), self.syncers, None)
        deadline = time.monotonic() + ray_eval.FINAL_EVAL_TIMEOUT_S
        while tag not in self.evals.results and m not in self.lost:
            self.evals.reap()
            if tag in self.evals.failed or time.monotonic() > deadline:
                break
            self._collect()
        return self.evals.results.get(tag, math.nan)


def _failed(ref) -> bool:
    """Whether an actor call has ended in an error (the actor died or was restarting)."""
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return False
    try:
        ray.get(ref)
    except ray.exceptions.RayError:
        return True
    return False


def _call(method, *args, timeout: float = 600.0):
    """Calls an actor method, retrying while the actor restarts (not once it is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(method.remote(*args))
        except ray.exceptions.ActorDiedError:
            raise
        except ray.exceptions.RayActorError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
