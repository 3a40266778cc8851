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
from decoupled_diloco.checkpoint import Checkpointer, abstract_like
from decoupled_diloco.config import RunConfig
from decoupled_diloco.data import make_iterator
from decoupled_diloco.diloco.fragments import flatten_params, make_fragment_plan
from decoupled_diloco.diloco.learner import Learner
from decoupled_diloco.diloco.syncer import Syncer
from decoupled_diloco.metrics import JsonlWriter, Progress, write_json
from decoupled_diloco.runtime import accounting
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
        self._last_log: dict[int, tuple[float, int]] = {}
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
        owned = [p for p in range(self.plan.num_fragments) if p % run.syncer.shards == shard]
        return Syncer(
            run.syncer, self.plan, init_params, run.num_learners, owned, record=self._record
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
                deadline = syncer.next_deadline()
                timeout = 0.02 if deadline is None else min(max(deadline - self.now(), 0.0), 0.02)
                msgs = link.receive(timeout)
                with self.syncer_lock:
                    out = []
                    for msg in msgs:
                        out += syncer.handle(msg, self.now())
                    out += syncer.tick(self.now())
                for m, msg in out:
                    link.send(m, msg)
                if self.now() - last_ckpt >= self.syncer_checkpoint_seconds:
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
        with self.syncer_lock:
            state = jax.tree.map(np.copy, syncer.state_dict())
            meta = {
                "plan": self.plan.to_json(),
                "learners": {str(m): [i.incarnation, i.joined] for m, i in syncer.learners.items()},
                "stats": syncer.stats,
            }
            step = sum(syncer.version.values())
        if ckpt.latest_step() != step:
            ckpt.save(step, state, meta, wait=wait)

    def _restore_syncer(self, shard: int, ckpt: Checkpointer) -> Syncer:
        syncer = self._new_syncer(shard, self.init_params)
        if ckpt.latest_step() is not None:
            state, meta = ckpt.restore(jax.tree.map(np.asarray, syncer.state_dict()))
            syncer.load_state_dict(state)
            for m, (inc, joined) in meta["learners"].items():
                syncer.register(int(m), inc, joined, self.now())
            self.events.write(
                {
                    "event": "syncer_restore",
                    "shard": shard,
                    "versions": syncer.version,
                    "time": self.now(),
                }
            )
        return syncer

    # --- learners -------------------------------------------------------------------
    def _learner_loop(self, m: int) -> None:
        run, learner = self.run_cfg, self.learners[m]
        steps = run.train.steps
        try:
            while learner.step < steps and not self.stop.is_set():
                t = self.now()
                if not self.schedule.is_up(m, t):
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
                factor = self.schedule.step_time_factor(m, learner.step, self.now())
                # Injected straggling / slower hardware; the first step of an incarnation
                # is compilation, which a slower chip would not stretch by the same factor.
                if factor > 1.0 and learner.step_seconds > 0:
                    time.sleep((factor - 1.0) * compute)
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
        if learner.step % run.train.log_every and learner.step != run.train.steps:
            return
        rec = {
            "learner": m,
            "step": learner.step,
            "tokens": learner.step * learner.tokens_per_batch,
            "loss": metrics["loss"],
            "learning_rate": metrics["learning_rate"],
            "grad_norm": metrics["grad_norm"],
            "tokens_per_second": self._rate(m, learner),
            "time": self.now(),
        }
        for k in ("moe_aux_loss", "load_balance_loss", "router_z_loss", "dropped_fraction"):
            if k in metrics:
                rec[k] = metrics[k]
        if "expert_load" in metrics:
            # float64 first: rounding float32 leaves 0.26249998807907104-style noise in the JSON.
            rec["expert_load"] = np.asarray(metrics["expert_load"], np.float64).round(4).tolist()
        if (
            not run.uses_syncer
            and run.train.eval_every
            and (learner.step % run.train.eval_every == 0)
        ):
            rec["eval_loss"] = self.evaluator(learner.state.params)
        self.metrics.write(rec)
        if m == 0 and self.verbose:
            extra = f" eval {rec['eval_loss']:.3f}" if "eval_loss" in rec else ""
            self.progress.update(
                learner.step,
                f"loss {rec['loss']:.3f}{extra} tok/s {rec['tokens_per_second']:.0f}"
                + (f" merges {self.ledger.merges}" if run.uses_syncer else ""),
            )

    def _rate(self, m: int, learner: Learner) -> float:
        """Tokens per second since this learner's previous log line."""
        now, last = self.now(), self._last_log.get(m)
        self._last_log[m] = (now, learner.step)
        if last is None or now <= last[0] or learner.step <= last[1]:
            return learner.tokens_per_batch / max(learner.step_seconds, 1e-9)
        return (learner.step - last[1]) * learner.tokens_per_batch / (now - last[0])

    def _save_learner(self, m: int, wait: bool = False) -> None:
        learner = self.learners[m]
        if learner.state is None:
            return
        meta = {
            "step": learner.step,
            "data": learner.data.get_state(),
            "incarnation": learner.incarnation,
        }
        self.learner_ckpts[m].save(learner.step, learner.state, meta, wait=wait)

    def _restore_one(self, m: int):
        """Learner m's last checkpoint (state; step, data position set), or None."""
        learner, ckpt = self.learners[m], self.learner_ckpts[m]
        ckpt.manager.wait_until_finished()
        if ckpt.latest_step() is None:
            learner.step = 0
            learner.data.set_state(self._initial_data_state[m])
            return None
        learner.init_from_rng(jax.random.key(0))  # shapes + shardings to restore onto
        state, meta = ckpt.restore(abstract_like(learner.state))
        learner.step = int(meta["step"])
        learner.incarnation = max(learner.incarnation, int(meta["incarnation"]) + 1)
        learner.data.set_state(meta["data"])
        learner.state = None
        return state

    def _restore_learners(self) -> list:
        self._initial_data_state = [lr.data.get_state() for lr in self.learners]
        return [self._restore_one(m) for m in range(len(self.learners))]

    # --- the run ----------------------------------------------------------------------
    def run(self) -> dict:
        run = self.run_cfg
        self._build()
        self.syncer_checkpoint_seconds = 5.0
        self.learner_ckpts = [
            Checkpointer(os.path.join(self.ckpt_dir, f"learner_{m}"))
            for m in range(run.num_learners)
        ]
        restored = self._restore_learners()
        resumed = any(r is not None for r in restored)
        if resumed and self.verbose:
            steps = [lr.step for lr in self.learners]
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
                next_eval += run.train.eval_every
                loss = self.evaluator(self.global_params())
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

    def global_params(self) -> dict:
        if not self.run_cfg.uses_syncer:
            return self.learners[0].host_params()
        out = {}
        with self.syncer_lock:
            for s in self.syncers:
                if s is not None:
                    out.update({k: v.copy() for k, v in s.global_params().items()})
        return out

    def total_tokens(self) -> int:
        return sum(lr.step * lr.tokens_per_batch for lr in self.learners)

    def _finish(self) -> dict:
        run = self.run_cfg
        wall = self.now()
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
        summary = {
            "name": run.name,
            "final_eval_loss": final,
            "steps": max(lr.step for lr in self.learners),
            "tokens": self.total_tokens(),
            "wall_seconds": wall,
            "learners": run.num_learners,
        }
        summary.update(self.ledger.summary(wall, run.uses_syncer, self.learners))
        if run.uses_syncer:
            stats = [s.stats for s in self.syncers if s is not None]
            summary["bytes_communicated"] = int(sum(s["bytes_in"] + s["bytes_out"] for s in stats))
            summary["bytes_per_token"] = summary["bytes_communicated"] / max(summary["tokens"], 1)
        else:
            summary["bytes_communicated"] = 0
            summary["bytes_per_token"] = 0.0
        write_json(os.path.join(self.workdir, "summary.json"), summary)
        for w in (self.metrics, self.merges, self.events):
            w.close()
        return summary
