"""The local runtime (the embedded default): learners and syncer shards in one process.

This file only decides where the roles run and how messages travel: every learner's
`LearnerLoop` on its own thread over its own disjoint device subset (XLA releases the GIL,
so learners really run concurrently), every syncer shard's `SyncerLoop` on a host thread or
in a process of its own (`local_syncer`; `syncer_process.py`), in-process queues between
them (`links.py`). Faults are emulated in the loops. The main thread evaluates the global
model while they train and writes the summary.
"""

import logging
import queue
import sys
import threading
import time

import jax

from decoupled_diloco import cli, faults, paths, run_files, seeds, sharding
from decoupled_diloco.checkpoint import Checkpointer
from decoupled_diloco.config import RunConfig
from decoupled_diloco.data import make_iterator
from decoupled_diloco.diloco.fragment_members import join_members
from decoupled_diloco.diloco.fragments import model_plan
from decoupled_diloco.fragment_checkpoint import FragmentCheckpointer
from decoupled_diloco.metrics import Progress, write_json
from decoupled_diloco.runtime import accounting, gil
from decoupled_diloco.runtime.learner_loop import (
    TAIL_NOTICE,
    LearnerLoop,
    RunAbortedError,
    RunInterruptedError,
    interrupt_notice,
)
from decoupled_diloco.runtime.links import LocalLearnerLink, LocalSyncerLink
from decoupled_diloco.runtime.records import RunLog
from decoupled_diloco.runtime.summary import run_summary
from decoupled_diloco.runtime.syncer_loop import SyncerLoop
from decoupled_diloco.runtime.syncer_process import SyncerProcess
from decoupled_diloco.train.evaluate import Evaluator
from decoupled_diloco.train.replica import Replica


def _wait_done(threads) -> None:
    """Waits for `threads` (each sets its `done` itself: not Thread.is_alive, which a join a
    KeyboardInterrupt cut short can leave marked as stopped, CPython's tstate lock)."""
    for t in threads:
        while not t.done.wait(timeout=0.2):
            pass


class _HaltError(Exception):
    """Stops a learner thread abruptly (`halt_after`)."""


class _Sink:
    """Where a learner loop's outputs go in this process: the run log, the progress line."""

    def __init__(self, rt: "LocalRuntime"):
        self.rt = rt

    def event(self, rec: dict) -> None:
        self.rt.log.event(rec)

    def row(self, rec: dict) -> None:
        self.rt.log.row(rec)
        if self.rt.verbose:
            text = self.rt.log.progress_text(rec, self.rt.run_cfg.uses_syncer)
            self.rt.progress.learner_row(rec["learner"], rec["step"], text)

    def step(self, m: int, seconds: float, t: float) -> None:
        self.rt.log.step(m, seconds, t)
        if not self.rt.run_cfg.uses_syncer:  # a data-parallel step advances the model
            self.rt.log.ledger.advance(t)

    def idle(self, m: int, seconds: float) -> None:
        self.rt.log.ledger.idle(m, seconds)

    def finished(self, m: int, t: float) -> None:
        self.rt.log.ledger.finish(m, t)


class LocalRuntime:
    def __init__(
        self,
        run: RunConfig,
        workdir: str,
        verbose: bool = True,
        halt_after: int | None = None,
        ckpt_dir: str | None = None,
        replica=Replica,
        fault_offset_s: float = 0.0,
        fault_steps: dict | None = None,
        attempt: int | None = None,
    ):
        """`halt_after`: stop every learner abruptly after that many steps, with no final
        checkpoint or summary (tests use it to emulate a killed job). `ckpt_dir`: default
        <workdir>/checkpoints; every process of a multi-host world passes the same one.
        `replica`: what builds a learner's replica from (model, train, mesh) configs
        (benchmarks pass one that emulates an accelerator's step time). `fault_offset_s`:
        where this attempt starts on the fault timeline (`workdir.Attempt.fault_offset`),
        `fault_steps` how far earlier attempts checked a schedule in steps (`.fault_steps`)."""
        self.run_cfg, self.workdir, self.verbose = run, workdir, verbose
        self._replica = replica
        self.halt_after = halt_after
        paths.resolve(workdir).mkdir(parents=True, exist_ok=True)
        self.log = RunLog(workdir, accounting.Ledger.of_run(run), run.train.tensorboard, attempt)
        self.schedule = faults.FaultSchedule(
            run.faults, run.num_learners, faults.HORIZON_S, fault_offset_s, fault_steps
        )
        self.stop = threading.Event()  # learners stop (a budget, a test, a failure)
        self.failed = threading.Event()  # a thread failed: learners wait for no reply
        self._syncers_stop = threading.Event()  # set once every learner has finished
        self.errors: list[BaseException] = []
        self.interrupted = False  # Ctrl-C: learners saved their work, no summary
        self.t0 = 0.0
        self.syncer_links: list[LocalSyncerLink] = []
        self.syncers: list = []  # the shards' SyncerLoops (SyncerProcesses), built by `run`
        self.threads: list[threading.Thread] = []  # the run's learner and syncer threads
        self.ckpt_dir = paths.resolve(ckpt_dir or f"{workdir}/checkpoints")

    def now(self) -> float:
        return time.monotonic() - self.t0

    def fault_clock(self) -> float:
        """Where the run stands on its fault timeline: the earlier attempts' seconds plus
        this one's since it started training, until it stopped (its start-up and its
        drain after a Ctrl-C or a failure are not on the timeline)."""
        return self.schedule.run_time(self.now()) if self.t0 else self.schedule.offset

    # --- construction ---------------------------------------------------------------
    def _build(self) -> None:
        run = self.run_cfg
        M = run.num_learners
        devices = jax.devices()
        self.meshes = [
            sharding.make_mesh(
                sharding.learner_devices(devices, run.devices_per_learner, m), run.mesh
            )
            for m in range(M)
        ]
        self.plan = model_plan(run.model, run.diloco) if run.uses_syncer else None
        shards = run.diloco.syncer_shards
        self.syncer_inboxes = [queue.Queue() for _ in range(shards)]
        self.learner_inboxes: dict[int, queue.Queue] = {}
        sink = _Sink(self)
        self.loops: list[LearnerLoop] = []
        process = (jax.process_index(), jax.process_count())
        for m in range(M):
            link = None
            if run.uses_syncer:
                link = LocalLearnerLink(
                    m,
                    self.syncer_inboxes,
                    lambda p: p % shards,
                    link_seconds=lambda n, m=m: self.schedule.transfer_seconds(m, n),
                )
                self.learner_inboxes[m] = link.inbox
            try:
                loop = LearnerLoop(
                    m,
                    run,
                    self._replica(run.model, run.train, self.meshes[m]),
                    # One learner over every process of a `distributed.*` world (the
                    # data-parallel baseline): each process reads its own rows of the batch.
                    make_iterator(run.data, "train", run.train.batch_size, m, M, *process),
                    self.plan,
                    link,
                    self.schedule,
                    self.now,
                    sink,
                    Checkpointer(self.ckpt_dir / f"learner_{m}"),
                    emulate_crashes=True,
                    between_steps=lambda m=m: self._maybe_halt(m),
                    abort=self.failed,
                    lives=str(self.ckpt_dir),
                    notice_down=self._notice_down,
                )
            except BaseException:
                if link is not None:  # its sender thread is running: no loop will close it
                    link.close()
                raise
            self.loops.append(loop)
        self.evaluator = Evaluator(
            run.model, run.data, self.meshes[0], run.train.batch_size, run.train.eval_batches
        )
        if not run.uses_syncer:  # the learner is the model: it evaluates itself
            self.loops[0].evaluate = self.evaluator
        # Syncer processes start now: their imports overlap the learners' compilation.
        self.syncer_processes = (
            [
                SyncerProcess(
                    s,
                    run,
                    self.plan,
                    self._syncer_link(s),
                    self.ckpt_dir / f"syncer_{s}",
                    self.log.record,
                    self.schedule,
                )  # fmt: skip
                for s in range(shards)
            ]
            if run.uses_syncer and run.local_syncer == "process"
            else []
        )

    def _syncer_link(self, shard: int) -> LocalSyncerLink:
        link = LocalSyncerLink(
            self.syncer_inboxes[shard],
            self.learner_inboxes,
            reply_seconds=lambda m, n: self.schedule.transfer_seconds(m, n),
        )
        self.syncer_links.append(link)  # closed when the run ends
        return link

    def _notice_down(self, leave) -> None:
        """An emulated crash ended a learner's life: every syncer shard hears it at once
        (what Ray's driver posts for a learner process it killed)."""
        for inbox in self.syncer_inboxes:
            inbox.put(leave)

    def _maybe_halt(self, m: int) -> None:
        if self.halt_after is not None and self.loops[m].step >= self.halt_after:
            raise _HaltError

    def _syncer_loops(self) -> list[SyncerLoop]:
        run = self.run_cfg
        # Θ_0: learner 0's sharded init from the run's seed (every runtime starts there).
        seed = self.loops[0].replica
        seed.init_from_rng(seeds.key(run.train.seed))
        init = seed.host_params()
        seed.drop()
        self.init_params = init  # Θ_0
        if self.syncer_processes:
            for proc in self.syncer_processes:
                proc.start(init, self.t0)
            return list(self.syncer_processes)
        loops = []
        for s in range(run.diloco.syncer_shards):
            ckpt = FragmentCheckpointer(self.ckpt_dir / f"syncer_{s}")
            loops.append(
                SyncerLoop(
                    s,
                    run,
                    self.plan,
                    init,
                    self._syncer_link(s),
                    ckpt,
                    self.schedule,
                    self.now,
                    self.log.record,
                    emulate_outages=True,
                )
            )
        return loops

    # --- the run ----------------------------------------------------------------------
    def run(self) -> dict | None:
        # Its threads share this interpreter: a short switch interval (runtime/gil.py).
        with gil.switch_interval(self.run_cfg.gil_switch_ms):
            try:
                return self._run()
            finally:  # however the run ended: no syncer process outlives it, nor a thread
                for proc in getattr(self, "syncer_processes", []):
                    proc.close()
                self._close_idle()

    def _close_idle(self) -> None:
        """Ends the threads of every learner and syncer link no thread of the run uses
        any more (a learner closes its own as its loop ends; these are the ones a failed
        start left, or the syncer's reply links). Left running, they would hold the run's
        device state for the life of the process."""
        running = {t.name for t in self.threads if not t.done.is_set()}
        if not any(name.startswith("learner") for name in running):
            for loop in getattr(self, "loops", []):
                loop.close(deliver=False)
        if not any(name.startswith("syncer") for name in running):
            for link in self.syncer_links:
                link.close()

    def _run(self) -> dict | None:
        run = self.run_cfg
        run_files.write(self.workdir, run)
        self._build()
        self.t0 = time.monotonic()  # (before the restores: their refusals are events too)
        resumed = [loop.restore(params_too=True) for loop in self.loops]
        # Where this attempt's training begins: its steps before are not its own to count.
        self.start_steps = [loop.step for loop in self.loops]
        for loop in self.loops:  # a process that runs the run takes new lives (next_life)
            loop.take_life(loop.incarnation)
        earlier = self.log.metrics.count()  # rows of earlier attempts
        if any(resumed) or earlier:
            steps = [loop.step for loop in self.loops]
            # Rows of steps after the checkpoints are redone (and logged again) now.
            dropped = self.log.metrics.retain(
                lambda r: (
                    r.get("step", 0)
                    <= (max(steps) if r["learner"] == "global" else steps[r["learner"]])
                )
            )
            if not any(resumed):  # checkpoints removed, or none written before the end
                logging.warning(
                    "%s holds %d metrics rows of earlier attempts but no learner checkpoint "
                    "to resume from: the run starts over at step 0 (%d rows past it dropped)",
                    self.workdir, earlier, dropped,
                )  # fmt: skip
            elif self.verbose:
                print(f"resuming from checkpoints at learner steps {steps}", flush=True)
        self.progress = Progress(run.train.steps, learners=run.num_learners)
        self.syncers = self._syncer_loops() if run.uses_syncer else []
        # How long the run's threads wait to run Python again (summary.json's lock_wait_ms).
        self.lock_probe = gil.LockProbe().start()
        syncer_threads = [
            self._thread(f"syncer{s}", loop.run, self._syncers_stop)
            for s, loop in enumerate(self.syncers)
        ]
        learner_threads = [
            self._thread(f"learner{m}", loop.run, self.stop) for m, loop in enumerate(self.loops)
        ]
        try:
            self._watch(learner_threads)
        except KeyboardInterrupt:
            cli.interrupt_handled()
            self._interrupt(learner_threads)
        except BaseException:
            # The main thread failed (an evaluation of Θ): the run stops as at a learner's
            # failure, and its threads end before the error is raised (else they would
            # train on, and hold their state, for the life of the process).
            self.schedule.freeze(self.now())
            self.failed.set()
            self.stop.set()
            self._syncers_stop.set()
            for t in self.threads:
                t.done.wait()
            self.lock_probe.stop()
            self.progress.close()
            raise
        self._syncers_stop.set()  # learners are done: let the syncer flush and stop
        # A Ctrl-C from here on would cut short the syncer's last merges and checkpoint, or a
        # learner checkpoint's commit: it waits for them, then ends the run as interrupted.
        with cli.interrupts_deferred(TAIL_NOTICE, pressed=self.interrupted) as press:
            _wait_done(syncer_threads)
            self.lock_probe.stop()
            self.progress.close()
            for loop in self.syncers:
                loop.close()
            if self.errors:
                raise RuntimeError("a learner or syncer thread failed") from self.errors[0]
            if not self.interrupted and self.halt_after is None and not self.run_cfg.uses_syncer:
                self.loops[0].revive_if_down()  # from its checkpoints, while they are open
            for loop in self.loops:
                loop.ckpt.close()
        self.interrupted = press.pressed
        if self.interrupted:
            steps = [loop.step for loop in self.loops]
            raise RunInterruptedError(
                f"interrupted at learner steps {steps}",
                self.log.ledger.accounting(
                    self.now(), self.run_cfg.uses_syncer, steps, self.start_steps
                ),
            )
        if self.halt_after is not None:
            return None
        return self._finish()

    def _interrupt(self, learner_threads) -> None:
        """Ctrl-C: learners stop at their next step, offer what Θ lacks of their work and
        save; the syncer merges it and saves (a second Ctrl-C stops at once, losing what
        the last checkpoints do not hold)."""
        print(interrupt_notice(self.run_cfg.uses_syncer), file=sys.stderr, flush=True)
        self.schedule.freeze(self.now())  # no fault begins while the run drains
        self.interrupted = True
        for loop in self.loops:
            loop.interrupted = True
        self.stop.set()
        _wait_done(learner_threads)

    def _thread(self, name: str, target, stop) -> threading.Thread:
        done = threading.Event()  # set when `target` has returned or failed

        def go():
            try:
                target(stop)
            except _HaltError:
                return
            except RunAbortedError:  # another thread's failure stopped this one
                return
            except BaseException as e:  # surface the failure to the main thread
                # Logged here (every failure, in the order they happen); `run` raises the
                # first. Not re-raised: the thread's exception hook would print it twice.
                # Out of memory is one line: the entry point says what to change.
                oom = cli.out_of_memory(e)
                if oom is not None:
                    logging.error("thread %s ran out of memory: %s", name, oom)
                else:
                    logging.error("thread %s failed", name, exc_info=e)
                self.schedule.freeze(self.now())
                self.errors.append(e)
                self.failed.set()
                self.stop.set()
                self._syncers_stop.set()
            finally:
                done.set()

        t = threading.Thread(target=go, name=name, daemon=True)
        t.done = done
        t.start()
        self.threads.append(t)
        return t

    def _watch(self, learner_threads) -> None:
        """Main thread: periodic evaluation of the global model while learners train."""
        run = self.run_cfg
        start = max(loop.step for loop in self.loops)  # (a resumed run's, its checkpoints')
        next_eval = accounting.next_eval_step(start, run.train.eval_every)
        while any(t.is_alive() for t in learner_threads):
            for t in learner_threads:
                t.join(timeout=0.2)
            cli.raise_pending_interrupt()  # one a callback swallowed (cli.py)
            if not run.uses_syncer or not next_eval:
                continue
            lead = max(loop.step for loop in self.loops)
            if lead >= next_eval and lead < run.train.steps:
                params = self.global_params()
                if params is None:  # a syncer shard is down: evaluate Θ once it is back
                    continue
                next_eval = accounting.next_eval_step(lead, run.train.eval_every)
                self.log.row(
                    {
                        "learner": "global",
                        "step": lead,
                        "tokens": self.total_tokens(),
                        "eval_loss": self.evaluator(params),
                        "merges": self.log.ledger.merges,
                        "time": self.now(),
                    }
                )

    def global_params(self) -> dict | None:
        """A copy of Θ (all fragments); None while a syncer shard is down (Θ is partial)."""
        if not self.run_cfg.uses_syncer:
            return self.loops[0].replica.host_params()
        out = {}
        for loop in self.syncers:
            part = loop.global_params()
            if part is None:
                return None
            out.update(part)
        return join_members(out)  # whole leaves from fragment members

    def bytes_communicated(self) -> int:
        """Bytes the syncer shards received and sent so far in this attempt."""
        return sum(loop.bytes_communicated() for loop in self.syncers)

    def total_tokens(self) -> int:
        return sum(loop.step * loop.tokens_per_step for loop in self.loops)

    def _finish(self) -> dict:
        run = self.run_cfg
        wall = self.now()
        lead = self.loops[0]
        if run.uses_syncer:
            final = self.evaluator(self.global_params())
        else:
            final = self.evaluator(lead.replica.state.params)
        steps = max(loop.step for loop in self.loops)
        if steps < run.train.steps and not self.stop.is_set():
            logging.warning(
                "the run ended at step %d, short of train.steps (%d): every learner left the "
                "membership for good (faults.membership) before it got there", steps,
                run.train.steps,
            )  # fmt: skip
        self.log.row(
            {
                "learner": "global",
                "step": steps,
                "tokens": self.total_tokens(),
                "eval_loss": final,
                "time": wall,
            }
        )
        stats = [loop.stats() for loop in self.syncers]
        summary = run_summary(
            run,
            final,
            steps,
            self.total_tokens(),
            wall,
            self.log.ledger.summary(
                wall, run.uses_syncer, [loop.step for loop in self.loops], self.start_steps
            ),
            stats,
            self.lock_probe.summary(),
            self.log.merges.count(),
        )
        write_json(paths.resolve(self.workdir) / "summary.json", summary)
        self.log.close()
        return summary
