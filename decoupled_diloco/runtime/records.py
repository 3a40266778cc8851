"""A run's records on the driver: metrics.jsonl (and its TensorBoard event files),
merges.jsonl, events.jsonl and the goodput ledger, fed the same way by every runtime
(events have one vocabulary, below).

Learner events (runtime/learner_loop.py): learner_start (its first start), rejoin (after a
crash, a NaN restart or a restarted process), member_join (back after leaving the
membership), learner_down (a crash: emitted where the crash happens, by the learner loop
when crashes are emulated, by the Ray driver when it kills the process), learner_leave,
learner_gone (down after a crash or NaN restart when its membership ended: it never rejoins;
under Ray the driver emits it, for a process that died and whose restart finished without
rejoining, and for a learner lost or stopped for good),
nan_restart, nan_at_end (its last steps diverged: it left without offering them),
learner_done, learner_error, learner_lost (Ray: restarts exhausted), learner_stopped (Ray:
the same error `ray.max_same_failures` times in a row).
Syncer records (diloco/syncer.py, runtime/syncer_loop.py): merge, join, leave, reject,
drop_offer, drop_message (diloco/refusals.py), syncer_crash, syncer_restore, syncer_start.
"""

from absl import logging

from decoupled_diloco import paths
from decoupled_diloco.metrics import JsonlWriter
from decoupled_diloco.runtime import accounting
from decoupled_diloco.tensorboard_events import RunWriter

# Events that change the counters an attempt's record keeps (workdir.ACCUMULATED).
_COUNTED = frozenset({"learner_down", "nan_restart", "rejoin", "syncer_crash", "syncer_restore",
                      "resume_cut", "nan_at_end", "learner_gone"})  # fmt: skip


class RunLog:
    def __init__(
        self,
        workdir: str,
        ledger: accounting.Ledger,
        tensorboard: bool = False,
        attempt: int | None = None,
    ):
        """`tensorboard`: metrics rows also go to TensorBoard event files (per learner and
        global) under <workdir>/tensorboard/. `attempt`: which attempt of the run this is
        (attempts.jsonl's line, from 0), written on every record as `attempt` (each attempt
        keeps a clock of its own: report.py puts them on one)."""
        root = paths.resolve(workdir)
        self.attempt = attempt
        self.metrics = JsonlWriter(root / "metrics.jsonl")
        self.merges = JsonlWriter(root / "merges.jsonl")
        self.events = JsonlWriter(root / "events.jsonl")
        self.ledger = ledger
        self.tensorboard = RunWriter(root) if tensorboard else None
        # Called after an event that changes the failure and lost-step counters (the
        # attempt's record is written then, not only on its heartbeat: a kill right after
        # a crash keeps its count).
        self.on_counted = None

    def _stamped(self, rec: dict) -> dict:
        return rec if self.attempt is None else {**rec, "attempt": self.attempt}

    def row(self, rec: dict) -> None:
        rec = self._stamped(rec)
        self.metrics.write(rec)
        self.ledger.row(rec)
        if self.tensorboard is not None:
            self.tensorboard.row(rec)

    def progress_text(self, rec: dict, uses_syncer: bool) -> str:
        """What the console line says of a learner's row: its loss, rate, the run's merges,
        and the learners down (a run waiting for one to restart says so)."""
        extra = f" eval {rec['eval_loss']:.3f}" if "eval_loss" in rec else ""
        text = f"loss {rec['loss']:.3f}{extra} tok/s {rec['tokens_per_second']:.0f}"
        text += f" merges {self.ledger.merges}" if uses_syncer else ""
        down = self.ledger.learners_down()
        if down:
            text += f" down: learner{'s' * (len(down) > 1)} {', '.join(map(str, down))}"
        return text

    def record(self, rec: dict) -> None:
        """A syncer record: merges to merges.jsonl (and the ledger), the rest are events."""
        if rec.get("event") == "merge":
            rec = self._stamped(rec)
            self.merges.write(rec)
            self.ledger.merge(rec)
        else:
            self.event(rec)

    def event(self, rec: dict) -> None:
        kind, t = rec["event"], rec.get("time", 0.0)
        ledger = self.ledger
        if kind in ("rejoin", "resume_cut", "nan_at_end"):
            rec = self._not_counted_twice(rec)
        rec = self._stamped(rec)
        self.events.write(rec)
        counted = not rec.get("earlier_attempt")  # an outage an earlier attempt counted
        if kind in ("learner_down", "nan_restart"):
            ledger.failure(rec["learner"], t, counted)
        elif kind == "rejoin":
            if not ledger.is_down(rec["learner"]):  # a process that died by itself
                ledger.failure(rec["learner"], t)
            ledger.restart(rec["learner"], t)
            ledger.counted_crash_lost += rec.get("lost_steps", 0)
        elif kind == "nan_at_end":  # (its last steps diverged: not offered, lost)
            ledger.counted_crash_lost += rec.get("lost_steps", 0)
        elif kind == "learner_leave":  # (scavenged capacity given back: not allocated)
            ledger.leave(rec["learner"], t)
        elif kind == "member_join":
            # Allocated again from when its window opened (its start-up is in it), not from
            # this event, written once it has joined; never before it left.
            opened = rec.get("window_opened")
            ledger.join(rec["learner"], t if opened is None else min(opened, t))
        elif kind == "learner_gone":  # (down for good: what Θ lacks of its life is lost)
            ledger.left_down(rec["learner"], rec["life_start"], rec["step"])
        elif kind == "syncer_crash":
            ledger.failure(("syncer", rec["shard"]), t, counted)
        elif kind == "syncer_restore":
            merges, steps = ledger.rolled_back_merges, ledger.syncer_lost_steps
            ledger.rollback(rec["versions"])  # (a resumed run's ledger holds none past them)
            lost = ledger.rolled_back_merges - merges
            if lost:
                logging.warning(
                    "syncer shard %s restored its last checkpoint: %d merges made since are "
                    "rolled back, and the work they held is lost (%d learner steps, less what "
                    "learners that had not applied them yet offer again; "
                    "checkpoints are taken every diloco.syncer_checkpoint_seconds, at most "
                    "diloco.syncer_checkpoint_duty of the time: a slow save spaces them "
                    "further)", rec.get("shard"), lost, ledger.syncer_lost_steps - steps,
                )  # fmt: skip
            if rec.get("after_failure"):
                if not ledger.is_down(("syncer", rec["shard"])):
                    ledger.failure(("syncer", rec["shard"]), t)
                ledger.restart(("syncer", rec["shard"]), t)
        elif kind == "reject":
            ledger.rejected_offers += 1
        elif kind == "drop_offer":
            ledger.dropped_offers += 1
        elif kind == "resume_cut":
            ledger.resume_lost_steps += rec.get("lost_steps", 0)
        if kind in _COUNTED and self.on_counted is not None:
            self.on_counted()

    def _not_counted_twice(self, rec: dict) -> dict:
        """A learner's crash or cut counts the steps of its own it found Θ lacking
        (`lost_spans`); those a syncer restore rolled back, which it may not have seen
        merged, are `syncer_lost_steps` already: they stay out of its `lost_steps`."""
        m, spans = rec.get("learner"), rec.get("lost_spans")
        if not isinstance(m, int):
            return rec
        lost = own = rec.get("lost_steps") or 0
        if spans:  # (before the rewind: a dead process's spans may lie past its new step)
            own = self.ledger.not_rolled_back(m, {int(p): s for p, s in spans.items()})
        self.ledger.rewound(m, int(rec.get("step", 0)))
        if own >= lost:
            return rec
        return {**rec, "lost_steps": own, "rolled_back_steps": lost - own}

    def step(self, m: int, seconds: float, t: float) -> None:
        self.ledger.step(m, seconds, t)

    def close(self) -> None:
        for w in (self.metrics, self.merges, self.events, self.tensorboard):
            if w is not None:
                w.close()
