"""One learner's life, for every runtime: (re)start, steps and step boundaries, injected
faults, NaN restarts, metrics rows, checkpoints, final offers.

The local runtime runs a `LearnerLoop` on a thread per learner; the Ray runtime runs one in
each learner actor's process. They differ only in what they pass in: where outputs go
(`sink`), and whether crashes are emulated here (the local runtime: the loop drops its
device state and unsent messages itself) or real (Ray: the driver kills the process, Ray
restarts it, and the new process's loop rejoins).

A step boundary (`_boundary`): offers due now leave as device copies through the outbox,
arrived messages are handled, the learner waits for late merges up to `diloco.max_wait`,
due merges are applied on the replica, a heartbeat goes out. A step's metrics are fetched
`train.metrics_lag` steps later, so the host never stalls the device queue to read them.
"""

import collections
import os
import threading
import time

import jax
import numpy as np
from absl import logging

from decoupled_diloco import checkpoint, fault_steps, faults, mfu, profiling, seeds
from decoupled_diloco.data.prefetch import Prefetch
from decoupled_diloco.diloco.learner import Learner, materialize
from decoupled_diloco.diloco.messages import Leave, Snapshot
from decoupled_diloco.runtime.accounting import span_steps, spans_minus
from decoupled_diloco.runtime.boundary import MergeStager, apply_updates, finish, step_boundary
from decoupled_diloco.runtime.lives import next_life
from decoupled_diloco.runtime.outbox import Outbox
from decoupled_diloco.runtime.save_schedule import SaveSchedule
from decoupled_diloco.runtime.step_times import StepTimes

_MOE_KEYS = ("moe_aux_loss", "load_balance_loss", "router_z_loss", "dropped_fraction")
POLL_S = 0.02  # seconds between checks while a learner is down


# A step's metrics that must be finite for its update to be: its cross-entropy, the loss it
# took the gradient of (MoE: with the router's auxiliary loss), and the gradient's norm (a
# backward pass that overflowed with a finite forward makes NaN parameters all the same).
FINITE_METRICS = ("loss", "total_loss", "grad_norm")


def metrics_diverged(metrics: dict) -> bool:
    """A step whose metrics (host values) show a non-finite loss or gradient."""
    return any(k in metrics and not np.all(np.isfinite(metrics[k])) for k in FINITE_METRICS)


class RunAbortedError(Exception):
    """A learner stops waiting for the syncer: its runtime saw the run fail elsewhere."""


class RunInterruptedError(KeyboardInterrupt):
    """The user interrupted the run (Ctrl-C): every learner offered its unmerged work and
    saved, the syncer merged it and saved; no summary is written, the same command resumes.
    `accounting`: the attempt's goodput, uptime and downtime (`Ledger.accounting`), which a
    resume with nothing left to train reports (workdir.Attempt.finish)."""

    def __init__(self, message: str, accounting: dict | None = None):
        super().__init__(message)
        self.accounting = accounting or {}


def interrupt_notice(uses_syncer: bool) -> str:
    """What a run prints on its first Ctrl-C (both runtimes)."""
    what = ("the learners offer their unmerged work and save, then the syncer"
            if uses_syncer else "the learner saves")  # fmt: skip
    return f"\ninterrupted: {what} (Ctrl-C again stops at once); the same command resumes"


# What a Ctrl-C prints once the learners are done (both runtimes): the syncer's last merges
# and checkpoint, and the learners' checkpoint commits, are not cut short.
TAIL_NOTICE = (
    "\ninterrupted: training is over; the syncer merges and saves the last offers and the "
    "checkpoints are committed first (Ctrl-C again stops at once); the same command then "
    "writes the summary"
)


class StopRequest:
    """The runtime's request that a learner stop as if interrupted (Ctrl-C), delivered
    through its inbox with the syncer's replies: the hosts of a multi-host learner receive
    their messages together at a step boundary (host 0's, broadcast), so all of them stop
    after the same step."""


class LearnerLoop:
    """Learner m. `run(stop)` trains it to `train.steps`; `sink` takes its outputs:
    event(dict), row(dict), step(m, seconds, t), idle(m, seconds), finished(m, t).
    `between_steps` (optional) runs after every step (Ray: evaluation requests).
    `notice_down` (optional; emulated crashes) takes the Leave the runtime posts for the
    life an emulated crash ended, as Ray's driver does for a process it killed."""

    def __init__(
        self,
        m,
        run,
        replica,
        data,
        plan,
        link,
        schedule: faults.FaultSchedule,
        clock,
        sink,
        ckpt,
        *,
        emulate_crashes: bool,
        evaluate=None,
        between_steps=None,
        inline_offers: bool = False,
        host: int = 0,
        abort: threading.Event | None = None,
        lives: str | None = None,
        notice_down=None,
    ):
        self.m, self.run_cfg, self.replica, self.data, self.plan = m, run, replica, data, plan
        self.link, self.schedule, self.clock = link, schedule, clock
        self.sink, self.ckpt, self.notice_down = sink, ckpt, notice_down
        self.emulate_crashes, self.evaluate, self.host = emulate_crashes, evaluate, host
        self.between_steps = between_steps
        self.abort = abort  # set: the run failed elsewhere; waiting for replies raises
        # Where each life this learner takes is recorded (the run's checkpoint directory,
        # `next_life`), so a process that comes back after a kill never reuses one.
        self.lives = lives
        self.tokens_per_step = run.train.batch_size * run.data.seq_len
        self.step, self.incarnation = 0, 0
        self.proto: Learner | None = None
        self.outbox = self.stager = None
        if plan is not None:
            self.outbox = Outbox(link, materialize, replica.to_host, inline_offers)
            if run.diloco.stage_merges:
                self.stager = MergeStager(
                    replica, clock=clock, device_rebase=run.diloco.device_rebase
                )
        if run.train.prefetch:
            self.data = Prefetch(data, run.train.prefetch, replica.put_batch)
        self.restored = None  # a checkpointed TrainState to resume from (first start)
        # Set with the runtime's `stop` when the user interrupts the run (or by a
        # StopRequest): the learner offers its unmerged work and saves, leaving (not
        # finishing) so a resume rejoins.
        self.interrupted = False
        self._stop_requested = False  # a StopRequest arrived: stop before the next step
        self._stop = None  # the runtime's stop event, while `run` trains
        # (steps of work the last emulated crash lost, their spans per fragment) (`_cut`)
        self._crash_lost: tuple | None = None
        self._life_start: int | None = None  # the step this life (with a syncer) began at
        # Per fragment, the spans (lo, hi] of our steps counted lost already, by a crash or
        # a cut (`lost_steps`) or by a syncer restore rolling back versions we saw holding
        # them (`syncer_lost_steps`): a later cut does not count them again. Kept beside
        # the checkpoints (`checkpoint.save_counted`), for a resume.
        self._counted: dict[int, list[tuple[int, int]]] = {}
        self.away = "start"  # why the learner is about to (re)start
        # Where its steps' time goes (rows' host_share).
        self.times = StepTimes(getattr(replica, "compile_waited", None))
        self.saves = SaveSchedule(run.train.checkpoint_every, run.train.checkpoint_duty)
        self.steps_since_start = 0
        self.slowdown = faults.SlowdownDebt()  # the emulated step-time noise's balance
        self._rate = (None, 0)  # (time, step) of the previous row
        self._delays = (0, 0)  # the protocol's (delay_steps, delays) at the previous row
        self._initial_data = data.get_state()

    def restore(self, params_too: bool) -> bool:
        """Takes step, data position and incarnation from the last checkpoint, and with
        `params_too` its TrainState (a resumed run); a restarted process takes Θ instead.
        False without a checkpoint."""
        try:
            out = checkpoint.restore_learner(self.ckpt, self.replica.abstract_state(), params_too)
        finally:
            for step, reason, moved in self.ckpt.refused:
                self.sink.event(self._event("checkpoint_refused", checkpoint_step=step,
                                            reason=reason, moved_to=moved))  # fmt: skip
            self.ckpt.refused.clear()
        if out is None:
            return False
        self.step, data_state, incarnation, self.restored = out
        self.incarnation = max(self.incarnation, incarnation)
        # The steps counted lost before, up to this step (a crash after this checkpoint
        # counted steps it holds too; those after it are trained again, and the file
        # forgets them, so that a later resume past them does not take them as counted).
        saved = checkpoint.load_counted(self.ckpt)
        self._counted = {
            p: [(a, min(b, self.step)) for a, b in spans if a < self.step]
            for p, spans in saved.items()
        }
        if self._counted != saved and self.host == 0:
            checkpoint.save_counted(self.ckpt, self._counted)
        self.data.set_state(data_state)
        return True

    def save(self) -> None:
        checkpoint.save_learner(
            self.ckpt, self.replica.state, self.data.get_state(), self.step, self.incarnation
        )

    def _absorb(self) -> None:
        """Notes as counted the spans the protocol saw a syncer restore roll back."""
        if self.proto is not None and self.proto.rolled_back:
            self._count({p: [(lo, hi)] for p, lo, hi in self.proto.rolled_back})
            self.proto.rolled_back.clear()

    def _count_lacking(self, lacking: dict) -> tuple[int, dict]:
        """Counts {fragment: [(lo, hi], ...]} of steps Θ lacks (not counted before) as lost
        now: (the most any fragment lacks, the spans as an event's `lost_spans`)."""
        self._count(lacking)
        spans = {str(p): [list(s) for s in ss] for p, ss in lacking.items() if ss}
        return max(map(span_steps, lacking.values()), default=0), spans

    def _count(self, spans: dict) -> None:
        """Adds {fragment: [(lo, hi], ...]} to the steps counted lost, and keeps them beside
        the checkpoints (where a resume finds them)."""
        if not any(spans.values()):
            return
        for p, ss in spans.items():
            self._counted[p] = fault_steps.merge_windows([*self._counted.get(p, []), *ss])
        if self.host == 0 and self.ckpt is not None:
            checkpoint.save_counted(self.ckpt, self._counted)

    # --- the loop ---------------------------------------------------------------------
    def run(self, stop) -> None:
        trained = False
        try:
            self._train(stop)
            trained = True
        finally:
            self.close(deliver=trained)

    def close(self, deliver: bool = True) -> None:
        """Ends the learner's threads (idempotent): its data reader (one left placing
        batches on the device aborts the process at its exit), its outbox and link, its
        stager. Their loops hold this learner, so threads left running would keep it and its
        device state alive as long as the process. `deliver` False (the loop failed or was
        halted): what is still queued is dropped, as a dead process's would be."""
        if isinstance(self.data, Prefetch):
            self.data.close()
        if self.outbox is not None:
            if not deliver:
                self.outbox.drop()
            self.outbox.close()
        if self.stager is not None:
            self.stager.close()

    def _train(self, stop) -> None:
        run, m = self.run_cfg, self.m
        self._stop = stop
        # Faults up to `seen` have been applied; a fresh start has applied none (a crash at
        # time 0 that ended while the learner was starting up is still seen, as missed).
        seen = 0.0 if self.away == "start" else self.clock()
        # Dispatched steps whose metrics (loss, NaN check) the host has not read yet: it reads
        # a step's only `train.metrics_lag` steps later, so the device always has that many
        # steps queued while the host works (its boundary, the next batch, rows).
        unread: collections.deque = collections.deque()
        lag, diverged = run.train.metrics_lag, False
        while self.step < run.train.steps and not stop.is_set() and not self._stop_requested:
            t = self.clock()
            fired = False  # a step-scheduled crash of this step (its outage may be empty)
            if self.emulate_crashes:  # step-scheduled faults land here (Ray: in the driver)
                self.schedule.run_reached(self.step, t)
                fired = self.schedule.learner_reached(m, self.step, t)
            missed = self.emulate_crashes and any(  # a whole outage inside one slow step
                e.kind == "crash" and e.learner == m for e in self.schedule.events_between(seen, t)
            )
            seen = t
            down = fired or missed or not self.schedule.is_up(m, t)
            if self.link is not None and self.schedule.changes(m):
                down = self.link.agree(down)  # a multi-host learner's hosts: host 0's clock
            if down:
                diverged = self._read(unread, keep=0)
                if not self._down(t, diverged, crash=fired or missed):
                    if self.away in ("crash", "nan") and self._life_start is not None:
                        # Down when its membership ended: no rejoin's cut will count what
                        # the crash lost; the run's ledger does (the merges are not all in).
                        self.sink.event(self._event("learner_gone", life_start=self._life_start))
                    self.sink.finished(m, t)  # left for good (scavenging): no longer allocated
                    return
                if self.link is not None and not self.outbox.inline:
                    # Down or out of the membership: what arrives is for the life that ended
                    # (dropped), but a StopRequest must not wait for the next life. (A
                    # multi-host learner's hosts read their link together, between steps.)
                    self._receive(0.0)
                continue
            if self.replica.state is None:
                self._start()
                # A life's first row's rate: since its first step (its compile included,
                # not the outage before it).
                self._rate = (self.clock(), self.step)
                if self.step >= run.train.steps:
                    break  # resumed in its final sync, and Θ holds every step: none to take
            self.times.begin()
            profiling.step(m, self.step, self.replica.ready)  # --profile's window
            metrics = self.replica.step(self.times.reading_data(self.data))
            self.step += 1
            unread.append((self.step, metrics))
            if self.proto is not None:
                self.proto.stepped()
                try:
                    self._boundary()
                except RunAbortedError:
                    break  # the run failed elsewhere: its work is saved below, as at a stop
                # Its row's protocol counters, as of this step's boundary: the row is
                # written train.metrics_lag steps later, when they have moved on.
                unread[-1] = (*unread[-1], self._protocol_counters())
            # A save, an evaluation and the last step read this step's own metrics (NaN
            # check, row) now: the device's wait for it is this step's compute, read inside
            # its time (after the loop it would be allocation and no step's time); the
            # evaluation itself is idle, not training (a DP learner evaluates in _report).
            # The last step of a learner with a syncer is saved by _finish, once its final
            # offers and leave are out: through a save of seconds (minutes for a large
            # model), a learner that has not left holds up the rounds that would take the
            # offers of learners behind it (catch-up rounds wait for every live learner).
            last = self.step == run.train.steps
            save = (last and self.proto is None) or (not last and self.saves.due(self.step))
            flush = last or save or bool(self.evaluate and self._every("eval_every"))
            diverged = self._read(unread, keep=0 if flush else lag)
            device_wait = self.times.end()
            self._straggle(unread, self.times.compute_seconds())
            if self.stager is not None and not flush:  # a flush empties the device queue
                # A merge placed within this costs the device nothing.
                self.stager.slack = 0.8 * self.stager.slack + 0.2 * device_wait
            self.steps_since_start += 1
            self.sink.step(m, self.times.compute_seconds(), self.clock())
            if save and not diverged:
                if self.step == run.train.steps:  # the last save is the tail, as below
                    self.sink.finished(m, self.clock())
                t0 = time.perf_counter()
                self.save()
                self.saves.saved(self.step, t0, time.perf_counter())
            if diverged and self.step >= run.train.steps:
                break  # no steps left to restart for: it leaves without offering (below)
            if diverged:  # a diverged learner must not poison merges: restart it from Θ
                self.sink.event(self._event("nan_restart"))
                life, joined = self.incarnation, self.proto is not None
                self._crash("nan")
                if joined:
                    # Its process lives on: it says its life ended, so that no round waits
                    # for it while it restarts (nor, if the run stops meanwhile, until its
                    # heartbeat timeout). Its unsent offers of that life are gone with it.
                    self.outbox.send(Leave(self.m, life, self.clock()))
                continue
            if self.between_steps is not None:
                self.between_steps()
        diverged = self._read(unread, keep=0) or diverged
        # A --profile window ending at train.steps ends with the last step, not with the
        # final sync, evaluation and saves after it.
        profiling.step(m, self.step, self.replica.ready)
        if isinstance(self.data, Prefetch):
            self.data.close()
        self.sink.finished(m, self.clock())  # training ends; the tail is not allocation
        if self.replica.state is None and self.restored is not None and self.plan is not None:
            # Resumed from its last step's checkpoint, which is saved during the final sync
            # (once its final offers are out): the process may have died before the sync
            # ended. Rejoin, and offer what Θ lacks of it.
            self._start()
        if self.replica.state is not None:
            try:
                # Finished: its step budget is done (not a stop short of it: Ctrl-C, a run
                # that failed elsewhere)
                done = self.step >= run.train.steps
                self._finish(finished=done, offer_work=not diverged)
            except RunAbortedError:  # the run failed elsewhere: keep this learner's work
                if not diverged:
                    self.save()
                raise
            if diverged:  # its last steps diverged: it left without offering them, unsaved
                self.sink.event(self._event("nan_at_end", **self._lost_at_end()))
            else:
                self.save()
        self.sink.event(self._event("learner_done"))

    def _lost_at_end(self) -> dict:
        """The steps a learner whose last steps diverged leaves unmerged ({} without a
        syncer): per fragment, those no offer resolved brought into Θ (its final sync waited
        for the offers in flight; one that its final_wait left unresolved is not counted)."""
        if self.proto is None:
            return {}
        lacking = {}
        for p, f in enumerate(self.proto.frags):
            after = f.in_flight.step if f.in_flight is not None else self.step - f.c_steps
            lacking[p] = spans_minus(after, self.step, self._counted.get(p, ()))
        lost, spans = self._count_lacking(lacking)
        return {"lost_steps": lost, "lost_spans": spans}

    def _every(self, key: str) -> bool:
        every = getattr(self.run_cfg.train, key)
        return bool(every) and self.step % every == 0

    # --- (re)start, boundary, finish --------------------------------------------------
    def _start(self) -> None:
        if self.plan is None:
            self._start_alone()
        else:
            self._join_syncer()
        self.restored = None
        self._life_start = self.step if self.plan is not None else None
        late = self.away == "start" and self.schedule.joins_late(self.m)
        if self.away == "start" and not late:
            event = "learner_start"
        else:
            event = "member_join" if late or self.away == "leave" else "rejoin"
        restarted = self.away == "process_restart"
        fields = dict(incarnation=self.incarnation, process_restart=restarted, pid=os.getpid())
        if self._crash_lost is not None and self._crash_lost[0]:
            fields["lost_steps"], fields["lost_spans"] = self._crash_lost
        self._crash_lost = None
        if event == "member_join":  # when its window opened (the join comes a little later)
            fields["window_opened"] = self.schedule.member_since(self.m, self.clock())
        self.sink.event(self._event(event, **fields))
        self.away = None

    def _start_alone(self) -> None:
        """Data-parallel (no syncer): the learner is the model. A crashed job restarts from
        its last checkpoint, or from scratch."""
        if self.away != "start" and not self.restore(params_too=True):
            self.step = 0
            self.data.set_state(self._initial_data)
        if self.restored is not None:
            self.replica.state = self.restored
        else:
            self.replica.init_from_rng(seeds.key(self.run_cfg.train.seed), self.step)

    def revive_if_down(self) -> None:
        """A data-parallel run stopped (a wall-clock budget) while its job was down: what
        survives is its last checkpoint, or the initial state if it saved none."""
        if self.replica.state is None:
            self._start_alone()

    def _join_syncer(self) -> None:
        """Join -> the syncer shards' snapshots -> parameters Θ, counters at zero (a resumed
        run keeps its checkpointed AdamW state and step, a restarted learner starts fresh)."""
        cfg = self.run_cfg.diloco
        self.proto = Learner(self.m, cfg, self.plan, self.tokens_per_step, self.clock,
                             self.incarnation, self.step)  # fmt: skip
        self._delays = (0, 0)
        self.outbox.send(self.proto.join())
        snapshots, early = [], []
        deadline = self.clock() + cfg.join_timeout
        while len(Learner.covered(snapshots)) < self.plan.num_fragments:
            if self.link.agree(self.clock() > deadline):
                raise TimeoutError(f"learner {self.m}: no snapshot from the syncer")
            for msg in self._receive(0.5):
                (snapshots if isinstance(msg, Snapshot) else early).append(msg)
        params = self.proto.start(snapshots)
        self._cut(snapshots)
        if self.restored is not None:
            self.replica.state = self.restored
            self.replica.set_params(params)
            self.replica.set_step(self.step)
        else:
            self.replica.init_from_host(params, self.step)
        # The copies and merge updates of every fragment compile beside the first step's
        # compilation instead of at the boundaries first needing them (the final sync's
        # own kinds compile there: off the steps, and only if it needs them).
        kinds = Learner.update_kinds(cfg, training=True)
        self.replica.precompile(self.plan.names, kinds, cfg.alpha)
        self._apply(self.proto.handle(early))

    def _cut(self, snapshots) -> None:
        """Meets the syncer at one consistent cut. Θ's vector clocks say up to which step of
        ours each fragment holds our work (any earlier life's): a learner restored from an
        older checkpoint than that (a resumed run, a restarted process) skips ahead to the
        newest such step, so no step's work reaches Θ twice; steps after the oldest one
        that some fragment lacks are lost with the state that held them (a fragment whose
        clock has no entry for us holds none of our steps). Both are recorded
        (`resume_cut`), and a loss is logged; a restarted process's loss is its crash's,
        carried by its `rejoin` event as `lost_steps`. So is the unmerged work an emulated
        crash or NaN restart loses with its device state, when the learner goes on from its
        own step (not from a checkpoint): the failure's expected cost, unlogged."""
        by_fragment = {}
        for snap in snapshots:
            for p, clock in snap.merged.items():
                entry = clock.get(self.m, clock.get(str(self.m)))
                by_fragment[int(p)] = 0 if entry is None else int(entry[1])
        held = list(by_fragment.values())
        if not held:
            return
        skipped = max(max(held) - self.step, 0)
        end = self.step + skipped
        # Per fragment, the steps Θ lacks that no earlier crash, cut or restore counted;
        # lost now: the most any fragment lacks. The driver checks them against the merges
        # a syncer restore rolled back, which this learner need not have seen.
        # (the rollbacks the life before saw were noted at its boundaries and its end)
        counted = self._counted
        lacking = {p: spans_minus(h, end, counted.get(p, ())) for p, h in by_fragment.items()}
        lost, spans = self._count_lacking(lacking)
        if skipped:
            if hasattr(self.data, "skip"):  # the data Θ already holds is not trained on
                self.data.skip(skipped)  # (nor placed on the devices) again
            else:
                for _ in range(skipped):
                    next(self.data)
            self.step = self.proto.step = self.step + skipped
        from_checkpoint = self.restored is not None or self.away in ("start", "process_restart")
        if not skipped and self.away in ("crash", "nan") and not from_checkpoint:
            self._crash_lost = (lost, spans)
            return
        restart = self.away == "process_restart"
        if restart:
            # A crash too: its loss goes with its rejoin (crash_lost_steps, as an emulated
            # crash's), to which Ray's driver adds the steps it saw the dead process take
            # past this cut (the new process cannot know them).
            self._crash_lost = (lost, spans)
        if skipped or (lost and not restart):
            cut_lost, cut_spans = (0, {}) if restart else (lost, spans)
            self.sink.event(self._event("resume_cut", skipped_steps=skipped,
                                        lost_steps=cut_lost, lost_spans=cut_spans))  # fmt: skip
        if lost:
            logging.warning(
                "learner %d: the syncer's Θ lacks up to %d of its steps (some fragment holds "
                "its work only up to step %d); they are lost, training goes on from step %d",
                self.m, lost, min(held), self.step,
            )  # fmt: skip

    def _boundary(self) -> None:
        # A multi-host learner (inline offers) applies every merge at the same boundary on
        # all of its hosts: it does not defer one its own stager has not placed yet.
        self.times.merge_wait += step_boundary(
            self.proto, self.replica, self.outbox, self._receive, self.clock, self.stager,
            defer=not self.outbox.inline, stopping=self._stopping, agree=self.link.agree,
        )  # fmt: skip
        if self.proto.rolled_back:  # a syncer restore took back merges of our steps: note
            self._absorb()  # them as counted at once (a resume must not count them again)

    def _stopping(self) -> bool:
        """The run is interrupted (Ctrl-C here, or a StopRequest that came with the
        syncer's replies): a learner waiting for a merge stops waiting."""
        return self._stop_requested or (self._stop is not None and self._stop.is_set())

    def _finish(self, finished: bool = True, offer_work: bool = True, bounded: bool = True) -> None:
        if self.proto is None:
            return
        # The end of its training (not a membership leave: it trains again later) is saved
        # once the final offers and the leave are out.
        last = offer_work and (finished or self.interrupted)
        delivered = finish(self.proto, self.replica, self.outbox, self._receive, self.clock,
                           finished, offer_work, on_left=self.save if last else None,
                           bounded=bounded, agree=self.link.agree)  # fmt: skip
        self._absorb()  # (a restore its final sync met)
        left, cfg = self.proto.unmerged_steps(), self.run_cfg.diloco
        if not delivered:
            # Its link had not delivered them when diloco.final_wait ran out (a link too slow
            # for its offers): they go on without the learner waiting for them.
            self.sink.event(self._event("final_messages_in_transit"))
            logging.warning(
                "learner %d: its last offers and leave were still on their way to the syncer "
                "when diloco.final_wait (%gs) ran out; the learner stops waiting for its link",
                self.m, cfg.final_wait,
            )  # fmt: skip
        if offer_work and cfg.final_sync and any(left):
            # Offers still unanswered (or refused) when diloco.final_wait ran out: Θ may yet
            # merge those in flight, but nobody waits to see it.
            self.sink.event(self._event("final_sync_unconfirmed", unmerged_steps=left))
            logging.warning(
                "learner %d: the final sync ended (diloco.final_wait=%gs) with steps of work "
                "per fragment %s not seen merged", self.m, cfg.final_wait, left,
            )  # fmt: skip

    def _receive(self, timeout: float) -> list:
        if self.abort is not None and self.abort.is_set():
            # No reply may come (the syncer failed): neither a synchronous boundary nor the
            # final sync waits out its timeout for one.
            raise RunAbortedError(f"learner {self.m}: the run failed elsewhere")
        msgs = self.link.receive(timeout) if self.link is not None else []
        if any(isinstance(msg, StopRequest) for msg in msgs):
            self.interrupted = self._stop_requested = True
            msgs = [msg for msg in msgs if not isinstance(msg, StopRequest)]
        return msgs

    def _apply(self, updates) -> None:
        apply_updates(self.replica, updates)

    # --- faults -----------------------------------------------------------------------
    def _down(self, t: float, diverged: bool = False, crash: bool = False) -> bool:
        """Not up at t. A crash loses the device state (emulated here, or the driver kills
        the process); leaving the membership is graceful: final offers and a Leave first
        (`diverged`: its last steps' loss was not finite; only the Leave). `crash`: a
        crash event of this step or inside it. False once this learner will never be a
        member again."""
        member = self.schedule.is_member(self.m, t)
        since = self._crashed_before_starting(t, member, crash)
        if since is not None:
            # A failure like any later one (it was only a late start), and its start, after
            # the restart delay, a rejoin. An outage an earlier attempt of the run began
            # (and counted) goes on: down, not a new failure.
            earlier = {"earlier_attempt": True} if since < 0 else {}
            self.sink.event({**self._event("learner_down"), "time": t, **earlier})
            self.away = "crash"
        if self.replica.state is not None and (self.emulate_crashes or not member):
            if member:  # down since t (the event carries when it happened, not when seen)
                self.sink.event({**self._event("learner_down"), "time": t})
                life, joined = self.incarnation, self.proto is not None
                self._crash("crash")
                if joined and self.notice_down is not None:
                    # Its runtime saw the slice fail: no round waits for the dead life (nor
                    # a final sync of the others), and it leaves the roster until it rejoins.
                    self.notice_down(Leave(self.m, life, self.clock()))
            else:  # left at t (stopped stepping); its final sync follows
                self.sink.event({**self._event("learner_leave"), "time": t})
                # Its outbox is dropped below: every message must be on the wire first.
                self._finish(finished=False, offer_work=not diverged, bounded=False)
                self._crash("leave")
        if not member and self.schedule.never_member_again(self.m, t, self.run_cfg.train.steps):
            return False
        time.sleep(POLL_S)
        return True

    def _crashed_before_starting(self, t: float, member: bool, crash: bool) -> float | None:
        """When the outage of this learner, a member since the attempt began that has not
        started yet, began (an emulated crash at time 0, or, negative, in an earlier attempt
        of the run); None: not crashed. (Ray's driver records the crashes of the processes
        it kills, not those of an earlier attempt.)"""
        if not (member and self.away == "start"):
            return None
        if self.replica.state is not None or self.schedule.joins_late(self.m):
            return None  # started, or a later joiner (its start is a member_join)
        since = t if crash else self.schedule.down_since(self.m, t)
        return since if self.emulate_crashes or (since is not None and since < 0) else None

    def _crash(self, why: str) -> None:
        """Everything the failed slice held is lost: device state, unsent messages and the
        protocol's bookkeeping; the learner rejoins as a new incarnation."""
        self.replica.drop()
        if self.outbox is not None:
            self.outbox.drop()
        if self.stager is not None:
            self.stager.clear()
        self._absorb()
        self.proto = None
        self.take_life(self.incarnation + 1)
        self.away, self.steps_since_start = why, 0

    def take_life(self, floor: int) -> None:
        """Becomes a new incarnation, at least `floor` and above every one recorded."""
        if self.lives is None:
            self.incarnation = floor
        else:
            self.incarnation = next_life(self.lives, self.m, self.host, floor)

    def _straggle(self, unread: collections.deque, seconds: float) -> None:
        """Sleeps to emulate a slower chip, a straggler episode or step-time noise: this
        step takes its factor times its compute (noise below one is repaid by later steps:
        `SlowdownDebt`). The device first finishes the steps still queued for it, which are
        part of that compute (a sleep while it computes would hide the slowness behind the
        pipeline). The first step of an incarnation is compilation, which a slower chip
        would not stretch alike."""
        steady, noise = self.schedule.step_time_parts(self.m, self.step, self.clock())
        if (steady > 1.0 or noise != 1.0) and self.steps_since_start > 0:
            t0 = time.perf_counter()
            if unread and (steady > 1.0 or noise > 1.0):  # else nothing is slept
                jax.block_until_ready(unread[-1][1])
            sleep = self.slowdown.owed(steady, noise, seconds + time.perf_counter() - t0)
            if sleep > 0:
                time.sleep(sleep)

    # --- outputs ----------------------------------------------------------------------
    def _event(self, name: str, **fields) -> dict:
        return {"event": name, "learner": self.m, "step": self.step, **fields, "time": self.clock()}

    def _read(self, unread: collections.deque, keep: int) -> bool:
        """Reads the oldest dispatched steps' metrics until `keep` are left unread. True if
        one diverged: the steps after it are dropped unread (the learner restarts)."""
        while len(unread) > keep:
            if self._report(unread.popleft()):
                unread.clear()
                return True
        return False

    def _report(self, finished) -> bool:
        """Fetches a finished step's metrics (`finished`: (step, device metrics) or None):
        its row, DP evaluation. True if its loss is not finite and the run has a syncer."""
        if finished is None:
            return False
        step, metrics, *counters = finished
        with self.times.reading_device():
            host = {k: np.asarray(v) for k, v in jax.device_get(metrics).items()}
        if metrics_diverged(host) and self.plan is not None:
            return True
        run = self.run_cfg
        every = run.train.eval_every
        evaluate = self.evaluate is not None and every and step % every == 0
        if self.host != 0 or (
            step % run.train.log_every and step != run.train.steps and not evaluate
        ):
            return False
        rec = self._row(step, host, counters[0] if counters else None)
        if evaluate:
            params = self.replica.state.params
            rec["eval_loss"], seconds = self.times.time_evaluation(lambda: self.evaluate(params))
            self.sink.idle(self.m, seconds)  # evaluation is not training
            self._rate = (self._rate[0] + seconds, step)  # nor in the next row's rate
        self.sink.row(rec)
        return False

    def _protocol_counters(self) -> dict:
        """The protocol's running counts a row reports (`_row`), as they are now."""
        stager = self.stager
        return {
            "merges_applied": self.proto.applied_merges,
            "merges_deferred": self.proto.deferrals,
            "stage_ms": round(1e3 * stager.job_seconds, 3)
            if stager and stager.job_seconds
            else None,
            "device_rebases": stager.rebases if stager and stager.device_rebase else None,
            "device_offers": stager.offers_on_device if stager and stager.device_rebase else None,
            "delays": (self.proto.delay_steps, self.proto.delays),
        }

    def _row(self, step: int, metrics: dict, counters: dict | None = None) -> dict:
        """Step's row; `counters`: the protocol's counts as of its boundary (None: now)."""
        now = self.clock()
        last_t, last_step = self._rate
        self._rate = (now, step)
        if last_t is None or now <= last_t or step <= last_step:
            seconds = self.proto.step_seconds if self.proto is not None else 0.0
            rate = self.tokens_per_step / max(seconds, 1e-9) if seconds else 0.0
        else:  # the steps since the last row (or this life's start) over their time
            rate = (step - last_step) * self.tokens_per_step / (now - last_t)
        rec = {
            "learner": self.m,
            "step": step,
            "tokens": step * self.tokens_per_step,
            "loss": float(metrics["loss"]),
            "learning_rate": float(metrics["learning_rate"]),
            "grad_norm": float(metrics["grad_norm"]),
            "tokens_per_second": rate,
            "time": now,
        }
        rec.update(mfu.row_fields(self.run_cfg, self.replica.mesh, rate))
        rec.update(self.times.shares())  # host_share, host_cpu_share, data_share
        waited = self.replica.compile_waited()
        if waited:
            # Seconds this learner's thread has waited for its protocol ops' background
            # compile (`Replica.precompile`): start-up, not the step's cost.
            rec["compile_wait_s"] = round(waited, 4)
        if self.proto is not None:
            # Merges applied, boundaries one waited for placement (merges_deferred), the
            # stager's moving mean of computing and placing one merge's update (stage_ms:
            # above a step, a learner that never waits defers merges to place them), and
            # the rebases and offers' outer gradients the devices computed since this
            # learner's loop started (diloco.device_rebase).
            counters = counters or self._protocol_counters()
            rec.update({k: v for k, v in counters.items() if k != "delays" and v is not None})
            # Mean steps from our offers to the merges holding them, since the previous row.
            total, n = counters["delays"]
            last_total, last_n = self._delays
            if n > last_n:
                rec["merge_delay_steps"] = round((total - last_total) / (n - last_n), 2)
                rec["merges_held"] = n - last_n  # the merges that mean is over
            self._delays = total, n
        for k in _MOE_KEYS:
            if k in metrics:
                rec[k] = float(metrics[k])
        if "expert_load" in metrics:
            # float64 first: rounding float32 leaves 0.26249998807907104-style noise in JSON.
            rec["expert_load"] = np.asarray(metrics["expert_load"], np.float64).round(4).tolist()
        return rec
