"""The local runtime (the embedded default): learners and syncer shards in one process.

Learners run on their own threads, each on its own disjoint device subset (XLA releases
the GIL, so they really run concurrently); each syncer shard runs on its own thread on the
host. The fault schedule is applied here: crashes drop a learner's device state and its
unsent messages, stragglers sleep, links delay offers, the syncer can die and restore.
"""

import os
import queue
import threading
import time

import jax
import numpy as np

from decoupled_diloco import faults, models
from decoupled_diloco.checkpoint import Checkpointer
from decoupled_diloco.config import RunConfig
from decoupled_diloco.data import make_iterator
from decoupled_diloco.diloco.fragments import flatten_params, make_fragment_plan
from decoupled_diloco.diloco.learner import Learner
from decoupled_diloco.diloco.syncer import Syncer
from decoupled_diloco.metrics import JsonlWriter, Progress, write_json
from decoupled_diloco.runtime import accounting, learner_host, report, syncer_host
from decoupled_diloco.runtime.links import LocalLearnerLink, LocalSyncerLink
from decoupled_diloco.sharding import make_mesh
from decoupled_diloco.train.evaluate import Evaluator

SCHEDULE_HORIZON_S = 7 * 24 * 3600.0  # fault timelines are drawn this far ahead


def learner_devices(run: RunConfig, m: int) -> list:
    """Disjoint device subsets; with more learners than subsets they share round-robin."""
    devices = jax.devices()
    per = run.devices_per_learner
    groups = max(len(devices) // per, 1)
    g = m % groups
    return devices[g * per : (g + 1) * per]


class LocalRuntime:
    def __init__(
        self, run: RunConfig, workdir: str, verbose: bool = True, halt_after: int | None = None
    ):
        """`halt_after`: stop every learner abruptly after that many steps, with no final
        checkpoint or summary (tests use it to emulate a killed job)."""
        self.run_cfg, self.workdir, self.verbose = run, workdir, verbose
        self.halt_after = halt_after
        os.makedirs(workdir, exist_ok=True)
        self.metrics = JsonlWriter(os.path.join(workdir, "metrics.jsonl"))
        self.merges = JsonlWriter(os.path.join(workdir, "merges.jsonl"))
        self.events = JsonlWriter(os.path.join(workdir, "events.jsonl"))
        self.schedule = faults.FaultSchedule(run.faults, run.num_learners, SCHEDULE_HORIZON_S)
        self.ledger = accounting.Ledger(run.num_learners, run.train.uptime_window)
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.t0 = 0.0
        self.syncer_lock = threading.Lock()
        self._rate = learner_host.RateMeter()  # tokens/s between log lines, per learner
        self._away: dict[int, str] = {}  # learner -> why it is down: "crash" | "leave"

    def now(self) -> float:
        return time.monotonic() - self.t0

    # --- construction ---------------------------------------------------------------
    def _build(self):
        run = self.run_cfg
        M = run.num_learners
        self.meshes = [make_mesh(learner_devices(run, m), run.mesh) for m in range(M)]
        abstract = jax.eval_shape(lambda: models.init_params(run.model, jax.random.key(0)))
        shapes = {k: tuple(v.shape) for k, v in flatten_params(abstract).items()}
        self.plan = None
        if run.uses_syncer:
            s = run.syncer
            self.plan = make_fragment_plan(
                shapes, s.num_fragments, s.fragment_strategy, run.learner.sync_every
            )
            self.syncer_inboxes = [queue.Queue() for _ in range(s.shards)]
        self.learner_inboxes = {}
        self.learners = []
        for m in range(M):
            data = make_iterator(run.data, "train", run.train.batch_size, m, M)
            link = None
            if run.uses_syncer:
                link = LocalLearnerLink(
                    m,
                    self.syncer_inboxes,
                    lambda p: p % run.syncer.shards,
                    run.learner.compression,
                    link_seconds=lambda n, m=m: self.schedule.transfer_seconds(m, n),
                )
                self.learner_inboxes[m] = link.inbox
            self.learners.append(
                Learner(
                    m,
                    run.learner,
                    run.model,
                    run.train,
                    self.meshes[m],
                    data,
                    self.plan,
                    link,
                    clock=self.now,
                )
            )
        self.evaluator = Evaluator(
            run.model, run.data, self.meshes[0], run.train.batch_size, run.train.eval_batches
        )
        self.ckpt_dir = os.path.join(self.workdir, "checkpoints")

    # --- syncer shards --------------------------------------------------------------
    def _new_syncer(self, shard: int, init_params) -> Syncer:
        run = self.run_cfg
        return syncer_host.new_syncer(
            run.syncer, self.plan, init_params, run.num_learners, shard, self._record
        )

    def _record(self, rec: dict) -> None:
        if rec.get("event") == "merge":
            self.merges.write(rec)
            self.ledger.merge(rec)
        else:
            self.events.write(rec)
            if rec.get("event") == "reject":
                self.ledger.rejected += 1

    def _syncer_loop(self, shard: int) -> None:
        link = LocalSyncerLink(
            self.syncer_inboxes[shard],
            self.learner_inboxes,
            reply_seconds=lambda m, n: self.schedule.transfer_seconds(m, n),
        )
        ckpt = Checkpointer(os.path.join(self.ckpt_dir, f"syncer_{shard}"))
        syncer = self.syncers[shard]
        last_ckpt = self.now()
        down = False
        try:
            while not self.stop.is_set():
                t = self.now()
                if not self.schedule.syncer_up(t):
                    if not down:  # the syncer process dies: its memory is gone
                        down = True
                        self.ledger.failure("syncer", t)
                        self.events.write({"event": "syncer_crash", "shard": shard, "time": t})
                        with self.syncer_lock:
                            self.syncers[shard] = None
                    time.sleep(0.02)  # learners keep training; their messages queue up
                    continue
                if down:
                    down = False
                    syncer = self._restore_syncer(shard, ckpt)
                    with self.syncer_lock:
                        self.syncers[shard] = syncer
                    self.ledger.restart("syncer", self.now())
                    for m, info in syncer.learners.items():
                        if info.joined:
                            link.send(m, syncer.snapshot(self.now()))
                syncer_host.serve_turn(syncer, link, self.now, self.syncer_lock)
                if self.now() - last_ckpt >= self.run_cfg.syncer.checkpoint_seconds:
                    self._save_syncer(syncer, ckpt)
                    last_ckpt = self.now()
            if down:  # the run ended during an outage: come back to finish cleanly
                syncer = self._restore_syncer(shard, ckpt)
                with self.syncer_lock:
                    self.syncers[shard] = syncer
            # End of run: merge what is still pending, quorum or not.
            for msg in link.receive(0.0):
                syncer.handle(msg, self.now())
            with self.syncer_lock:
                syncer.flush(self.now())
            self._save_syncer(syncer, ckpt, wait=True)
        except BaseException as e:  # surface the failure to the main thread
            self.errors.append(e)
            self.stop.set()
            raise
        finally:
            ckpt.close()

    def _save_syncer(self, syncer: Syncer, ckpt: Checkpointer, wait: bool = False) -> None:
        syncer_host.save_syncer(syncer, ckpt, self.plan, self.syncer_lock, wait=wait)

    def _restore_syncer(self, shard: int, ckpt: Checkpointer) -> Syncer:
        syncer = self._new_syncer(shard, self.init_params)
        if syncer_host.restore_syncer(syncer, ckpt, self.now()):
            self.events.write(
                {
                    "event": "syncer_restore",
                    "shard": shard,
                    "versions": syncer.version,
                    "epoch": syncer.epoch,
                    # merges.jsonl / events.jsonl records of this shard after this many
                    # were rolled back (merges the lost life made after its checkpoint)
                    "log_position": syncer.log_position,
                    "time": self.now(),
                }
            )
        return syncer

    # --- learners -------------------------------------------------------------------
    def _learner_loop(self, m: int) -> None:
        run, learner = self.run_cfg, self.learners[m]
        steps = run.train.steps
        try:
            seen = self.now()  # faults up to here have been applied
            while learner.step < steps and not self.stop.is_set():
                t = self.now()
                # A crash whose whole outage fell inside one (slow) step still kills the
                # learner: it loses its state and restarts at once.
                missed = any(
                    e.kind == "crash" and e.learner == m
                    for e in self.schedule.events_between(seen, t)
                )
                seen = t
                if missed or not self.schedule.is_up(m, t):
                    if not self._learner_down(m, t):
                        return  # left the membership for good (scavenging)
                    continue
                if learner.state is None:
                    restored = None if run.uses_syncer else self._restore_one(m)
                    learner.start(jax.random.key(run.train.seed), restored=restored)
                    crashed = self._away.pop(m, None) == "crash"
                    if crashed:
                        self.ledger.restart(m, self.now())
                    self.events.write(
                        {
                            "event": "rejoin" if crashed else "member_join",
                            "learner": m,
                            "step": learner.step,
                            "time": self.now(),
                        }
                    )
                t_step, waited = time.perf_counter(), learner.wait_seconds
                metrics = learner.run_step()
                blocked = learner.wait_seconds - waited  # waiting for a merge is not compute
                compute = time.perf_counter() - t_step - blocked
                learner_host.straggle(self.schedule, m, learner, compute, self.now())
                self.ledger.step(m, time.perf_counter() - t_step - blocked, self.now())
                if not run.uses_syncer:
                    self.ledger.advance(self.now())
                if not np.isfinite(metrics["loss"]) and run.uses_syncer:
                    # A diverged learner must not poison merges: restart it from Θ.
                    self.events.write(
                        {
                            "event": "nan_restart",
                            "learner": m,
                            "step": learner.step,
                            "time": self.now(),
                        }
                    )
                    learner.crash()
                    self._away[m] = "crash"
                    self.ledger.failure(m, self.now())
                    continue
                self._log_step(m, learner, metrics)
                if self.halt_after is not None and learner.step >= self.halt_after:
                    return  # emulated kill: nothing after the last periodic checkpoint
                every = run.train.checkpoint_every
                if every and learner.step % every == 0:
                    self._save_learner(m)
            if learner.state is None:
                return  # stopped while down: nothing of it survives to finish
            self.ledger.finish(m, self.now())  # training ends; the tail is not allocation
            learner.finish()
            if learner.link is not None:
                learner.link.flush()
            self._save_learner(m, wait=True)
        except BaseException as e:
            self.errors.append(e)
            self.stop.set()
            raise
        finally:
            self.ledger.finish(m, self.now())

    def _learner_down(self, m: int, t: float) -> bool:
        """Learner m is not up at t. A crash loses its state; leaving the membership
        (scavenging) is graceful: final offers and a Leave first. False once it will never
        be a member again."""
        learner = self.learners[m]
        member = self.schedule.is_member(m, t)
        if learner.state is not None:
            if member:
                self.ledger.failure(m, t)
            else:
                learner.finish()
                if learner.link is not None:
                    learner.link.flush()
            self._away[m] = "crash" if member else "leave"
            self.events.write(
                {
                    "event": "learner_down" if member else "learner_leave",
                    "learner": m,
                    "step": learner.step,
                    "time": t,
                }
            )
            learner.crash()
        if not member and all(end <= t for _, end in self.schedule.member_windows[m]):
            return False
        time.sleep(0.02)
        return True

    def _log_step(self, m: int, learner: Learner, metrics: dict) -> None:
        run = self.run_cfg
        every = run.train.eval_every
        # A learner without a syncer is the model: it is evaluated here (otherwise the main
        # thread evaluates Θ), on its own schedule, whatever log_every is.
        evaluate = not run.uses_syncer and every and learner.step % every == 0
        if learner.step % run.train.log_every and learner.step != run.train.steps and not evaluate:
            return
        now = self.now()
        rec = learner_host.step_record(m, learner, metrics, self._rate(m, learner, now), now)
        if evaluate:
            t0 = time.perf_counter()
            rec["eval_loss"] = self.evaluator(learner.state.params)
            # Evaluation is not training (Decoupled runs evaluate Θ off the learners).
            self.ledger.idle(m, time.perf_counter() - t0)
        self.metrics.write(rec)
        if m == 0 and self.verbose:
            extra = f" eval {rec['eval_loss']:.3f}" if "eval_loss" in rec else ""
            self.progress.update(
                learner.step,
                f"loss {rec['loss']:.3f}{extra} tok/s {rec['tokens_per_second']:.0f}"
                + (f" merges {self.ledger.merges}" if run.uses_syncer else ""),
            )

    def _save_learner(self, m: int, wait: bool = False) -> None:
        learner_host.save_learner(self.learners[m], self.learner_ckpts[m], wait=wait)

    def _restore_one(self, m: int):
        """Learner m's last checkpoint (state; step, data position set), or None."""
        return learner_host.restore_learner(
            self.learners[m], self.learner_ckpts[m], self._initial_data_state[m]
        )

    def _restore_learners(self) -> list:
        self._initial_data_state = [lr.data.get_state() for lr in self.learners]
        return [self._restore_one(m) for m in range(len(self.learners))]

    # --- the run ----------------------------------------------------------------------
    def run(self) -> dict:
        run = self.run_cfg
        self._build()
        self.learner_ckpts = [
            Checkpointer(os.path.join(self.ckpt_dir, f"learner_{m}"))
            for m in range(run.num_learners)
        ]
        restored = self._restore_learners()
        resumed = any(r is not None for r in restored)
        if resumed:
            steps = [lr.step for lr in self.learners]
            # Rows of steps after the checkpoints are redone (and logged again) now.
            self.metrics.retain(
                lambda r: (
                    r.get("step", 0)
                    <= (max(steps) if r["learner"] == "global" else steps[r["learner"]])
                )
            )
            if self.verbose:
                print(f"resuming from checkpoints at learner steps {steps}", flush=True)
        self.progress = Progress(run.train.steps)
        self.t0 = time.monotonic()
        threads = []
        if run.uses_syncer:
            seed_learner = self.learners[0]
            seed_learner.init_from_rng(jax.random.key(run.train.seed))
            self.init_params = seed_learner.host_params()
            seed_learner.state = None
            self.syncers = []
            for s in range(run.syncer.shards):
                ckpt = Checkpointer(os.path.join(self.ckpt_dir, f"syncer_{s}"))
                self.syncers.append(self._restore_syncer(s, ckpt))
                ckpt.close()
                threads.append(
                    threading.Thread(
                        target=self._syncer_loop, args=(s,), name=f"syncer{s}", daemon=True
                    )
                )
            for t in threads:
                t.start()
        learner_threads = []
        for m, learner in enumerate(self.learners):

            def go(m=m, learner=learner):
                try:
                    if self.schedule.is_up(m, self.now()):
                        learner.start(jax.random.key(run.train.seed), restored=restored[m])
                except BaseException as e:
                    self.errors.append(e)
                    self.stop.set()
                    raise
                self._learner_loop(m)

            learner_threads.append(threading.Thread(target=go, name=f"learner{m}", daemon=True))
        for t in learner_threads:
            t.start()
        self._watch(learner_threads)
        self.stop.set()  # learners are done: let the syncer flush and stop
        for t in threads:
            t.join()
        self.progress.close()
        if self.errors:
            raise RuntimeError("a learner or syncer thread failed") from self.errors[0]
        if self.halt_after is not None:
            for c in self.learner_ckpts:
                c.close()
            return None
        return self._finish()

    def _watch(self, learner_threads) -> None:
        """Main thread: periodic evaluation of the global model while learners train."""
        run = self.run_cfg
        next_eval = run.train.eval_every
        while any(t.is_alive() for t in learner_threads):
            for t in learner_threads:
                t.join(timeout=0.2)
            if not run.uses_syncer or not next_eval:
                continue
            lead = max(lr.step for lr in self.learners)
            if lead >= next_eval and lead < run.train.steps:
                params = self.global_params()
                if params is None:  # a syncer shard is down: evaluate Θ once it is back
                    continue
                next_eval += run.train.eval_every
                loss = self.evaluator(params)
                self.metrics.write(
                    {
                        "learner": "global",
                        "step": lead,
                        "tokens": self.total_tokens(),
                        "eval_loss": loss,
                        "merges": self.ledger.merges,
                        "time": self.now(),
                    }
                )

    def global_params(self) -> dict | None:
        """A copy of Θ (all fragments); None while a syncer shard is down (Θ is partial)."""
        if not self.run_cfg.uses_syncer:
            return self.learners[0].host_params()
        out = {}
        with self.syncer_lock:
            for s in self.syncers:
                if s is None:
                    return None
                out.update({k: v.copy() for k, v in s.global_params().items()})
        return out

    def total_tokens(self) -> int:
        return sum(lr.step * lr.tokens_per_batch for lr in self.learners)

    def _finish(self) -> dict:
        run = self.run_cfg
        wall = self.now()
        if not run.uses_syncer and self.learners[0].state is None:
            # Stopped while the job was down: what survives is its last checkpoint.
            self.learners[0].start(jax.random.key(run.train.seed), restored=self._restore_one(0))
        for c in self.learner_ckpts:
            c.close()
        if run.uses_syncer:
            params = self.global_params()
            final = self.evaluator(params)
        else:
            final = self.evaluator(self.learners[0].state.params)
        self.metrics.write(
            {
                "learner": "global",
                "step": max(lr.step for lr in self.learners),
                "tokens": self.total_tokens(),
                "eval_loss": final,
                "time": wall,
            }
        )
        stats = [s.stats for s in self.syncers if s is not None] if run.uses_syncer else []
        summary = report.run_summary(
            run,
            final,
            max(lr.step for lr in self.learners),
            self.total_tokens(),
            wall,
            self.ledger.summary(wall, run.uses_syncer, self.learners),
            stats,
        )
        write_json(os.path.join(self.workdir, "summary.json"), summary)
        for w in (self.metrics, self.merges, self.events):
            w.close()
        return summary
