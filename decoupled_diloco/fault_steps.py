"""Fault schedules in training steps (`FaultSpec.unit = "steps"`): when each entry fires.

A schedule in wall seconds lands at different training points on a fast and on a slow
host; one in steps does not. Two clocks, both counted in completed steps:

* a learner's crash `(learner, s)` fires when that learner has completed s steps (at the
  step boundary after step s, before step s + 1). Its own clock: a slow learner crashes
  at the same point of its training as a fast one. It fires once: a learner that redoes
  steps after a restore (data-parallel restarts from its last checkpoint) does not crash
  again, and a resumed run does not replay it: the earlier attempts record how far each
  learner checked its schedule (`progress`, kept in attempts.jsonl), so an entry fires on
  a resume only if no attempt checked its step, even at the very step a Ctrl-C stopped
  the learner at (it stops before checking it); the steps below the first one an attempt
  checks count as checked (the local runtime checks every step it takes; Ray's driver,
  the steps its polls see); without a record (an older workdir), a learner resumed at or
  past s takes it as fired;
* the syncer's crashes and the membership windows `(learner, join, leave)` follow the
  run's lead step: the highest step any learner has completed so far. It never goes back
  (a restore rolls one learner back, not the run), it advances while some learners are
  down, and it exists before a scavenged learner's first step (which it must trigger). A
  resumed run does not replay the syncer crashes the earlier attempts' lead passed (or,
  without their record, those at or before the first step reported to it); its membership
  windows are replayed, as the state they set.

A fired entry becomes a wall-clock event at the time it fired (`FaultSchedule.
learner_reached` / `run_reached`): the crash's restart comes `restart_delay_s` seconds
later (delays stay in seconds: a repair takes wall time whatever the host's speed). The
local runtime's learner loops report their steps as they complete them; under Ray the
driver reports the steps it polls (a crash then lands within one `ray.poll_seconds` of its
step), and the restarted process comes back as soon as Ray restarts it.

`in_seconds` turns a step schedule into a seconds one at a fixed step time: what the
simulator, which has a step time but no steps, predicts for it.
"""

import dataclasses
import math
import threading


def _integral(x) -> bool:
    return not isinstance(x, bool) and float(x) == int(x)


def validate(spec, max_step: int | None = None, num_learners: int | None = None) -> None:
    """Checks a `unit = "steps"` FaultSpec's explicit schedule (raises ValueError naming the
    field): whole steps, crashes at step >= 1 (a learner that has trained) and, given the
    run's `max_step`, before it (a fault that can never happen is a mistaken schedule);
    given `num_learners`, that the membership leaves no step without a member before its
    last join (the lead step, which makes joins happen, only moves while someone trains)."""

    def fail(field: str, msg: str):
        raise ValueError(f'faults.{field} with faults.unit="steps" {msg}')

    last = f"< train.steps ({max_step})" if max_step is not None else ""
    for entry in spec.crashes:
        if not _integral(entry[1]) or entry[1] < 1:
            fail("crashes", f"needs whole steps >= 1 (the crash follows that step), got {entry!r}")
        if max_step is not None and entry[1] >= max_step:
            fail("crashes", f"needs steps {last}: {entry!r} would never happen")
    for entry in spec.membership:
        if not (_integral(entry[1]) and math.isfinite(entry[2]) and _integral(entry[2])):
            fail("membership", f"needs whole steps (one that stays: a leave past train.steps), "
                 f"got {entry!r}")  # fmt: skip
        if max_step is not None and entry[1] >= max_step:
            fail("membership", f"needs joins {last}: {entry!r} would never join")
    if num_learners is not None and spec.membership:
        _check_someone_trains(spec, num_learners, max_step, fail)
    gone = {}  # learner -> the step its last membership window ends
    for i, _, leave in spec.membership:
        gone[int(i)] = max(gone.get(int(i), 0), leave)
    for entry in spec.crashes:  # a learner's own step never passes the run's lead step,
        # and at its window's last step the leave comes first (the window is [join, leave))
        if int(entry[0]) in gone and entry[1] >= gone[int(entry[0])]:
            fail("crashes", f"has {entry!r} at or after the end of learner {int(entry[0])}'s "
                 f"last membership window (step {gone[int(entry[0])]:g}): it would never "
                 "happen")  # fmt: skip
    for s in spec.syncer_crashes:
        if not _integral(s) or s < 1:
            fail("syncer_crashes", f"needs whole steps >= 1, got {spec.syncer_crashes}")
        if max_step is not None and s >= max_step:
            fail("syncer_crashes", f"needs steps {last}: {s} would never happen")


def _check_someone_trains(spec, num_learners: int, max_step: int | None, fail) -> None:
    """Every join must come while some learner is a member: a step no member trains past is
    never reached; so is a step after the last member left (the run would end there)."""
    if len({int(i) for i, _, _ in spec.membership}) < num_learners:
        return  # a learner without windows is a member throughout
    covered = merge_windows((a, b) for _, a, b in spec.membership)
    if max_step is not None and covered[-1][1] < max_step:
        fail("membership", f"has every learner gone after step {covered[-1][1]}: the run "
             f"would end there, short of train.steps ({max_step}) (let some learner's "
             "window reach it)")  # fmt: skip
    first = covered[0][0]
    if first > 0:
        fail("membership", f"has no learner at step 0 (the first joins at step {first}): "
             "the run's lead step, which joins wait for, would never move")  # fmt: skip
    if len(covered) > 1:
        (_, gap), (after, _) = covered[0], covered[1]
        fail("membership", f"leaves steps {gap}..{after} without a member: the lead step "
             f"stops at {gap}, so the join at step {after} would never come (let some "
             "learner's window reach it)")  # fmt: skip


def in_seconds(spec, step_s: float, speeds=None):
    """The same FaultSpec with its step schedule at `step_s` seconds per step (unit seconds),
    the step time of the fastest learner, which sets the lead step (syncer crashes,
    membership). `speeds`: each learner's step-time multiplier (`fault_spec.
    speed_factors_of`; None: all 1): a learner's crash at its own step s comes at
    s·step_s·speed/min(speeds), plus `restart_delay_s` for each of its crashes before it (it
    reached step s that much later; the steps it redoes after a restore are not added). A
    learner's crashes at one step are one crash, as `StepTriggers` fires them: placed at s
    alone, a crash a few steps after another fell inside that one's outage and was lost."""
    if spec.unit != "steps":
        return spec
    if not step_s > 0:
        raise ValueError(f"step_s must be > 0 to place a step schedule in time, got {step_s}")
    own = [float(x) for x in speeds] if speeds is not None and len(speeds) else []
    if any(not x > 0 for x in own):
        raise ValueError(f"speeds must be > 0, got {own}")
    lead_s, fastest = step_s, min(own, default=1.0)

    def at(learner) -> float:
        return step_s * (own[int(learner)] if int(learner) < len(own) else fastest) / fastest

    crashes, earlier = [], {}  # learner -> its crashes placed so far
    for i, s in sorted({(int(i), int(s)) for i, s in spec.crashes}):
        k = earlier.get(i, 0)
        crashes.append((i, s * at(i) + k * spec.restart_delay_s))
        earlier[i] = k + 1
    return dataclasses.replace(
        spec,
        unit="seconds",
        crashes=tuple(crashes),
        membership=tuple((i, a * lead_s, b * lead_s) for i, a, b in spec.membership),
        syncer_crashes=tuple(s * lead_s for s in spec.syncer_crashes),
    )


def merge_progress(records) -> dict | None:
    """The earlier attempts' `StepTriggers.progress()` records as one (the highest step per
    learner and lead); None if none holds one."""
    records = [r for r in records if isinstance(r, dict)]
    if not records:
        return None
    width = max(len(r.get("learners", [])) for r in records)
    learners = [max((int(r["learners"][m]) for r in records if m < len(r.get("learners", []))),
                    default=-1) for m in range(width)]  # fmt: skip
    return {"learners": learners, "lead": max(int(r.get("lead", -1)) for r in records)}


def merge_windows(pairs) -> list[tuple[int, int]]:
    """Sorted, disjoint (join, leave) step windows (overlapping or touching ones merged)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in pairs):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class StepTriggers:
    """The entries of a step schedule that have not fired yet. Thread-safe: the local
    runtime's learner threads report their steps concurrently.

    `checked`: the earlier attempts' `progress()` (merged: `merge_progress`), or None."""

    def __init__(self, spec, num_learners: int, checked: dict | None = None):
        self._lock = threading.Lock()
        self._crashes = [
            sorted(int(s) for i, s in spec.crashes if int(i) == m) for m in range(num_learners)
        ]
        self._first_seen: list[int | None] = [None] * num_learners
        self._syncer = sorted(int(s) for s in spec.syncer_crashes)
        self._resumed_lead: int | None = None  # the first step reported to `run_reached`
        # The highest step each learner checked its crashes at, and the run's lead, over
        # every attempt (-1: none); None without a record of the earlier attempts.
        self._recorded = checked is not None
        checked = checked or {}
        learners = [int(s) for s in checked.get("learners", [])][:num_learners]
        self._checked = learners + [-1] * (num_learners - len(learners))
        self._checked_lead = int(checked.get("lead", -1))
        self.windows = {}  # learner -> merged (join, leave) step windows
        for i, a, b in spec.membership:
            self.windows.setdefault(int(i), []).append((a, b))
        self.windows = {i: merge_windows(w) for i, w in self.windows.items()}
        # Membership changes still to come: (step, 0 = leave / 1 = join, learner). Those up
        # to the earlier attempts' lead step happened there: a resume starts in the state
        # they set (`opened_at_start`), and they do not fire again.
        self._member = sorted(
            (s, kind, i)
            for i, wins in self.windows.items()
            for a, b in wins
            for s, kind in ((a, 1), (b, 0))
            if s > max(self._checked_lead, 0)
        )
        self.lead = 0  # the run's lead step

    def opened_at_start(self, m: int) -> bool:
        """Whether learner m (with windows) is a member when this attempt starts: at step 0
        of a fresh run, at the earlier attempts' lead step of a resumed one."""
        lead = max(self._checked_lead, 0)
        return any(a <= lead < b for a, b in self.windows[m])

    def learner_reached(self, m: int, step: int) -> bool:
        """Learner m has completed `step` steps: whether one of its crashes fires now."""
        with self._lock:
            pending = self._crashes[m]
            if self._first_seen[m] is None:  # a resumed run does not replay passed crashes
                self._first_seen[m] = step  # (a fresh run's first step is 0: none dropped)
                # Every step below the first was checked by some attempt; the record says
                # whether this one was (and which ones a resume's skip-ahead jumps over).
                passed = max(self._checked[m], step - 1) if self._recorded else step
                while pending and pending[0] <= passed:
                    pending.pop(0)
            self._checked[m] = max(self._checked[m], step)
            fired = False
            while pending and pending[0] <= step:
                pending.pop(0)
                fired = True
            return fired

    def progress(self) -> dict:
        """How far the schedule was checked, over this attempt and the earlier ones it was
        given: {"learners": [step per learner], "lead": the run's lead step}."""
        with self._lock:
            return {"learners": list(self._checked), "lead": max(self.lead, self._checked_lead)}

    def run_reached(self, step: int) -> list[tuple[str, int]]:
        """Some learner has completed `step` steps: the (kind, learner) entries that fire now,
        in step order; kind is "syncer_crash" (learner -1), "leave" or "join"."""
        with self._lock:
            if self._resumed_lead is None:  # a resumed run does not replay passed crashes
                self._resumed_lead = int(step)
                passed = max(self._checked_lead, step - 1) if self._recorded else step
                while passed > 0 and self._syncer and self._syncer[0] <= passed:
                    self._syncer.pop(0)
            self.lead = max(self.lead, int(step))
            out = []
            while self._syncer and self._syncer[0] <= self.lead:
                out.append((self._syncer.pop(0), 0, "syncer_crash", -1))
            while self._member and self._member[0][0] <= self.lead:
                s, kind, i = self._member.pop(0)
                out.append((s, kind, "join" if kind else "leave", i))
            return [(kind, i) for *_, kind, i in sorted(out)]

    def joins_pending(self, m: int, last_step: int) -> bool:
        """Whether learner m has a join still to come at a step <= last_step."""
        with self._lock:
            return any(k == 1 and i == m and s <= last_step for s, k, i in self._member)
