"""Seeded fault schedule: one description of failures shared by real runs and the simulator.

A `FaultSpec` (part of the run config; `fault_spec.py`, with its validation) says *what*
can go wrong; `FaultSchedule` turns it into a deterministic timeline for M learners over a
horizon, reproducible from `spec.seed`. The runtime consumes the events (crash a learner,
restart it, slow it down, drop the syncer); the goodput simulator
(`decoupled_diloco.simulator`) consumes the same schedule, so a real CPU run's measured
goodput can be set beside the simulator's prediction for the very same timeline.

Random learner crashes: each of a learner's `chips_per_learner` chips fails after an
independent exponential time with mean `chip_mtbf_hours`. The superposition of n such
clocks is a Poisson process of rate n / MTBF whose every event lands on a uniformly random
chip, which is what is sampled (one draw per failure, never one clock per chip), so the
cost is independent of the chip count. A crash while the learner is already down, or while
it is not a member, is ignored (a dead chip cannot fail again; by memorylessness this
thinning is exact).

Independent random streams (crashes, stragglers) are derived from the seed, so enabling
stragglers does not move the crash times. Per-step speed noise is not drawn from a stream
at all: it is a hash of (seed, learner, step), so any process can recompute it.

Step schedules (`unit = "steps"`): the explicit `crashes`, `membership` and
`syncer_crashes` are then given in training steps, so that they hit the same training
point on a fast and on a slow host (`fault_steps.py` says when each one fires). They are not
on the timeline in advance: `learner_reached` and `run_reached` place each one on it, at
the wall time the run reaches its step, and from there on the runtime sees an ordinary
timed event. Every other time stays in seconds: restart delays (a repair takes wall time
whatever the host), straggler episodes and the chip-MTBF crash process.
"""

import bisect
import math
import threading
from typing import NamedTuple

import numpy as np

from decoupled_diloco import fault_random, fault_steps
from decoupled_diloco.fault_spec import (
    HORIZON_S,
    UNITS,
    FaultSpec,
    fault_spec_from_dict,
    speed_factors_of,
    timed_in_seconds,
    unread_fields,
    validate_fault_spec,
)

# The spec's names belong to this module's API too (`faults.FaultSpec`, ...).
__all__ = [
    "HORIZON_S",
    "UNITS",
    "FaultEvent",
    "FaultSchedule",
    "FaultSpec",
    "SlowdownDebt",
    "fault_spec_from_dict",
    "merge_intervals",
    "timed_in_seconds",
    "unread_fields",
    "validate_fault_spec",
]

# Ties at equal times resolve in this order, so a zero-delay crash precedes its restart.
_KIND_ORDER = (
    "leave",
    "crash",
    "syncer_crash",
    "straggle_end",
    "straggle_start",
    "restart",
    "syncer_restart",
    "join",
)
_STREAM_CRASH, _STREAM_STRAGGLE = 1, 2
_BEGINS = ("crash", "syncer_crash")  # events a `freeze` holds back


class FaultEvent(NamedTuple):
    """One timeline entry; `learner` is -1 for syncer events."""

    time: float
    kind: str  # one of _KIND_ORDER
    learner: int
    factor: float = 1.0  # step-time multiplier, for straggle_start


_ORDER = {k: i for i, k in enumerate(_KIND_ORDER)}


def _event_key(e: FaultEvent) -> tuple:
    return (e.time, _ORDER[e.kind], e.learner)


def merge_intervals(pairs) -> list[tuple[float, float]]:
    """(start, end) pairs as their union: sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(pairs):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _since(intervals: list[tuple[float, float]], t: float) -> float | None:
    """The start of the one of the sorted, disjoint [a, b) intervals holding t, or None."""
    i = bisect.bisect_right(intervals, (t, math.inf)) - 1
    return intervals[i][0] if i >= 0 and intervals[i][0] <= t < intervals[i][1] else None


def _inside(intervals: list[tuple[float, float]], t: float) -> bool:
    """Whether t lies in one of the sorted, disjoint [a, b) intervals."""
    return _since(intervals, t) is not None


class FaultSchedule:
    """The deterministic fault timeline of `num_learners` learners over [0, horizon_s).

    `events` is sorted by time (ties in a fixed kind order, then learner); every accepted
    crash is followed by its restart at crash + restart_delay_s (if inside the horizon).

    `offset_s`: where this attempt's clock starts on the run's timeline (the seconds that
    earlier attempts of a resumed run trained, `workdir.fault_clock`). The timeline is the
    run's, drawn from 0 whatever the offset; every method takes and returns the attempt's
    times (run time - offset_s), so a resumed attempt neither replays what happened before
    its start nor skips what is due after it. The attributes (`events`, `down`,
    `member_windows`, `syncer_down`, `straggles`) hold run times.

    `steps_checked`: how far the earlier attempts checked a schedule in steps
    (`workdir.Attempt.fault_steps`; fault_steps.py), whose entries do not fire again.

    `freeze(t)`: the attempt stopped training at t (Ctrl-C, a failure). No crash or outage
    begins after it, those under way run to their end, and `run_time` stays at t: the next
    attempt takes the timeline up from there, so what was due while this one drained (final
    offers, the last checkpoint) is neither lost nor applied twice.
    """

    def __init__(self, spec: FaultSpec, num_learners: int, horizon_s: float, offset_s: float = 0.0,
                 steps_checked: dict | None = None):  # fmt: skip
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        if not 0 <= offset_s < math.inf:
            raise ValueError(f"offset_s must be finite and >= 0, got {offset_s}")
        validate_fault_spec(spec, num_learners, horizon_s=horizon_s)
        self.spec, self.num_learners, self.horizon_s = spec, num_learners, float(horizon_s)
        self.offset = float(offset_s)
        m = num_learners
        self.speed = speed_factors_of(spec, m)
        # Step-scheduled events are added while the run goes, from every learner's thread.
        self._lock = threading.RLock()
        self._frozen = math.inf  # run time of `freeze`
        self.steps = (
            fault_steps.StepTriggers(spec, m, steps_checked) if spec.unit == "steps" else None
        )
        windows: dict[int, list] = {}
        for learner, join, leave in spec.membership if self.steps is None else ():
            windows.setdefault(int(learner), []).append((float(join), float(leave)))
        # A resumed step schedule's late joiners that joined in an earlier attempt: when is
        # not recorded, so their random crashes are placed from this attempt's start on.
        joined_before = set()
        if self.steps is not None:  # in steps: the windows open at the start (a resume's:
            # as the earlier attempts left them, before any learner of this one can start)
            for learner, wins in self.steps.windows.items():
                opened = self.steps.opened_at_start(learner)
                windows[learner] = [(0.0, math.inf)] if opened else []
                if opened and wins[0][0] > 0:
                    joined_before.add(learner)
        self.member_windows = [merge_intervals(windows.get(i, [(0.0, math.inf)])) for i in range(m)]

        events: list[FaultEvent] = []
        self.down = [[] for _ in range(m)]  # per learner: sorted [crash, restart) intervals
        # A step schedule's late joiners: their random crash times, placed when they join.
        self._unplaced: dict[int, list[float]] = {}
        for t, learner in self._crash_candidates():
            if self.steps is not None and not self.member_windows[learner]:
                self._unplaced.setdefault(learner, []).append(t)
                continue
            if learner in joined_before and t < self.offset:
                continue  # (perhaps before its join: no crash of a learner not yet there)
            events += self._crash_events(learner, t)
        self.straggles = self._sample_straggles()
        for learner, episodes in enumerate(self.straggles):
            for a, b in episodes:
                events.append(FaultEvent(a, "straggle_start", learner, spec.straggler_slowdown))
                if b < self.horizon_s:
                    events.append(FaultEvent(b, "straggle_end", learner))
        self.syncer_down: list[tuple[float, float]] = []
        timed_syncer_crashes = spec.syncer_crashes if self.steps is None else ()
        for t in sorted(float(x) for x in timed_syncer_crashes if x < self.horizon_s):
            if self.syncer_down and t < self.syncer_down[-1][1]:
                continue
            back = t + spec.syncer_restart_delay_s
            self.syncer_down.append((t, back))
            events.append(FaultEvent(t, "syncer_crash", -1))
            if back < self.horizon_s:
                events.append(FaultEvent(back, "syncer_restart", -1))
        for learner, wins in enumerate(self.member_windows):
            for join, leave in wins:
                if 0 < join < self.horizon_s:
                    events.append(FaultEvent(join, "join", learner))
                if leave < self.horizon_s:
                    events.append(FaultEvent(leave, "leave", learner))
        self.events = sorted(events, key=_event_key)
        self._keys = [_event_key(e) for e in self.events]

    def _crash_events(self, learner: int, t: float) -> list[FaultEvent]:
        """A random or timed crash of `learner` at t, in time order after its earlier ones:
        its down interval and events (none while it is down or not a member)."""
        down, member = self.down[learner], self.member_windows[learner]
        if (down and t < down[-1][1]) or not _inside(member, t):
            return []
        back = t + self.spec.restart_delay_s
        down.append((t, back))
        out = [FaultEvent(t, "crash", learner)]
        if back < self.horizon_s and _inside(member, back):
            out.append(FaultEvent(back, "restart", learner))
        return out

    def _crash_candidates(self) -> list[tuple[float, int]]:
        """Explicit crashes plus the Poisson superposition of every chip's failure clock."""
        spec, m, horizon = self.spec, self.num_learners, self.horizon_s
        out = [(float(t), int(i)) for i, t in spec.crashes if t < horizon and self.steps is None]
        if spec.chip_mtbf_hours > 0:
            rate = m * spec.chips_per_learner / (spec.chip_mtbf_hours * 3600.0)
            times, marks = fault_random.poisson_times(
                fault_random.rng(spec.seed, _STREAM_CRASH), rate, horizon
            )
            # A uniformly random chip; chips are split evenly, so its learner is uniform too.
            learners = np.minimum((marks * m).astype(np.int64), m - 1)
            out += zip(times.tolist(), learners.tolist(), strict=True)
        return sorted(out)

    def _sample_straggles(self) -> list[list[tuple[float, float]]]:
        spec = self.spec
        if spec.straggler_rate_per_hour <= 0:
            return [[] for _ in range(self.num_learners)]
        rate = spec.straggler_rate_per_hour / 3600.0
        out = []
        for learner in range(self.num_learners):
            rng = fault_random.rng(spec.seed, _STREAM_STRAGGLE, learner)
            starts = fault_random.poisson_times(rng, rate, self.horizon_s)[0].tolist()
            out.append(merge_intervals([(s, s + spec.straggler_duration_s) for s in starts]))
        return out

    def events_between(self, t0: float, t1: float) -> list[FaultEvent]:
        """Events with t0 <= time < t1, in timeline order (attempt times); after a
        `freeze`, no crash begins."""
        off = self.offset
        with self._lock:
            lo = bisect.bisect_left(self._keys, (t0 + off,))
            hi = bisect.bisect_left(self._keys, (t1 + off,))
            found = self.events[lo:hi]
            frozen = self._frozen
        if frozen < t1 + off:
            found = [e for e in found if e.time <= frozen or e.kind not in _BEGINS]
        return [e._replace(time=e.time - off) for e in found] if off else found

    def freeze(self, t: float) -> None:
        """This attempt stopped training at t (see the class doc); the first call wins."""
        with self._lock:
            self._frozen = min(self._frozen, t + self.offset)

    @property
    def frozen_at(self) -> float | None:
        """The attempt time of `freeze` (None: not frozen)."""
        return None if self._frozen == math.inf else self._frozen - self.offset

    def run_time(self, t: float) -> float:
        """Where this attempt's time t lies on the run's timeline (at most the freeze's)."""
        return min(t + self.offset, self._frozen)

    def _down_at(self, intervals: list[tuple[float, float]], t: float) -> float | None:
        """The run-time start of the outage among `intervals` holding run time t, unless it
        began after a `freeze` (None: up)."""
        since = _since(intervals, t)
        return since if since is not None and since <= self._frozen else None

    # --- step schedules (fault_steps.py): placed on the timeline as the run reaches them ----
    def steps_checked(self) -> dict | None:
        """How far a schedule in steps has been checked (`StepTriggers.progress`); None for
        one in seconds."""
        return self.steps.progress() if self.steps is not None else None

    def learner_reached(self, learner: int, step: int, t: float) -> bool:
        """Learner `learner` has completed `step` steps at time t. A crash scheduled for that
        step becomes a crash at t, back at t + restart_delay_s (ignored, as on the timeline,
        while the learner is down or not a member). True if one fired."""
        if self.steps is None or not self.steps.learner_reached(learner, step):
            return False
        if not self.is_up(learner, t):
            return False
        t += self.offset
        back = t + self.spec.restart_delay_s
        with self._lock:
            bisect.insort(self.down[learner], (t, back))
        self._add(FaultEvent(t, "crash", learner))
        if _inside(self.member_windows[learner], back):
            self._add(FaultEvent(back, "restart", learner))
        return True

    def run_reached(self, step: int, t: float) -> None:
        """Some learner has completed `step` steps at time t (the run's lead step follows):
        syncer crashes and membership changes scheduled up to it happen at t."""
        if self.steps is None:
            return
        t += self.offset
        with self._lock:  # learners report concurrently: one thread applies a batch whole
            for kind, learner in self.steps.run_reached(step):
                if kind == "syncer_crash":
                    if _inside(self.syncer_down, t):
                        continue
                    back = t + self.spec.syncer_restart_delay_s
                    bisect.insort(self.syncer_down, (t, back))
                    self._add(FaultEvent(back, "syncer_restart", -1))
                elif kind == "join":
                    self.member_windows[learner].append((t, math.inf))
                    # Its chips' failure clocks ran all along; from now on they hit it.
                    for when in self._unplaced.pop(learner, []):
                        if when >= t:
                            for event in self._crash_events(learner, when):
                                self._add(event)
                else:
                    join, _ = self.member_windows[learner][-1]
                    self.member_windows[learner][-1] = (join, t)
                self._add(FaultEvent(t, kind, learner))

    def never_member_again(self, learner: int, t: float, last_step: int) -> bool:
        """Whether the learner's membership has ended by t for good (a step schedule's joins
        up to `last_step`, the run's step budget, may still come)."""
        if any(end > t + self.offset for _, end in self.member_windows[learner]):
            return False
        return self.steps is None or not self.steps.joins_pending(learner, last_step)

    def _add(self, event: FaultEvent) -> None:
        with self._lock:
            i = bisect.bisect_right(self._keys, _event_key(event))
            self._keys.insert(i, _event_key(event))
            self.events.insert(i, event)

    def is_member(self, learner: int, t: float) -> bool:
        """Whether the learner exists at t (scavenging windows; unlisted = always)."""
        return _inside(self.member_windows[learner], t + self.offset)

    def joins_late(self, learner: int) -> bool:
        """Whether the learner is no member when this attempt starts (its membership begins
        later: its start is a join)."""
        return not self.is_member(learner, 0.0)

    def member_since(self, learner: int, t: float) -> float | None:
        """When the learner's membership window holding t opened (None: not a member;
        negative: before this attempt started)."""
        since = _since(self.member_windows[learner], t + self.offset)
        return None if since is None else since - self.offset

    def changes(self, learner: int) -> bool:
        """Whether `is_up` of the learner may change in time: it has a membership window
        other than the whole run, or a crash outage, scheduled or already placed."""
        with self._lock:
            always = self.member_windows[learner] == [(0.0, math.inf)]
            return not always or bool(self.down[learner])

    def is_up(self, learner: int, t: float) -> bool:
        """Alive (not between a crash and its restart) and a member at time t."""
        return self.is_member(learner, t) and self.down_since(learner, t) is None

    def down_since(self, learner: int, t: float) -> float | None:
        """When the learner's crash outage holding t began (None: not down; negative:
        before this attempt started, which then found it down)."""
        since = self._down_at(self.down[learner], t + self.offset)
        return None if since is None else since - self.offset

    def straggle_factor(self, learner: int, t: float) -> float:
        """The episode slowdown if a straggler episode is active at t, else 1."""
        active = _inside(self.straggles[learner], t + self.offset)
        return self.spec.straggler_slowdown if active else 1.0

    def step_time_factor(self, learner: int, step: int, t: float) -> float:
        """Step-time multiplier: constant speed * active straggle * hashed per-step noise."""
        steady, noise = self.step_time_parts(learner, step, t)
        return steady * noise

    def step_time_parts(self, learner: int, step: int, t: float) -> tuple[float, float]:
        """`step_time_factor` as (constant speed * active straggle, per-step noise): the
        first is at least 1, the second has mean one (`SlowdownDebt` emulates each)."""
        steady = float(self.speed[learner]) * self.straggle_factor(learner, t)
        noise = 1.0
        if self.spec.speed_noise > 0:
            noise = float(self.step_noise(np.asarray(learner), np.asarray(step)))
        return steady, noise

    def step_noise(self, learner, step) -> np.ndarray:
        """Mean-one log-normal noise exp(s*z - s^2/2), z hashed from (seed, learner, step)."""
        s = self.spec.speed_noise
        return np.exp(s * fault_random.hashed_normal(self.spec.seed, learner, step) - 0.5 * s * s)

    def step_time_factors(self, step, t) -> np.ndarray:
        """Vectorised `step_time_factor` for all learners: [learners, len(step)] (step, t: [n])."""
        step, t = np.asarray(step), np.asarray(t, dtype=np.float64) + self.offset
        out = np.empty((self.num_learners, t.size))
        for learner, episodes in enumerate(self.straggles):
            active = np.zeros(t.size, dtype=bool)
            for a, b in episodes:  # few episodes per learner; a loop is cheapest
                active |= (t >= a) & (t < b)
            slow = np.where(active, self.spec.straggler_slowdown, 1.0)
            out[learner] = self.speed[learner] * slow
        if self.spec.speed_noise > 0:
            out *= self.step_noise(np.arange(self.num_learners)[:, None], step[None, :])
        return out

    def link(self, learner: int) -> tuple[float, float]:
        """(one-way latency in s, bandwidth in bits/s; inf when unlimited)."""
        spec = self.spec
        latency = float(spec.link_latency_s[learner]) if spec.link_latency_s else 0.0
        bw = float(spec.link_bandwidth_bps[learner]) if spec.link_bandwidth_bps else 0.0
        return latency, (bw if bw > 0 else math.inf)

    def transfer_seconds(self, learner: int, num_bytes: int) -> float:
        """Seconds to move num_bytes to or from the syncer: latency + 8 * bytes / bandwidth."""
        latency, bw = self.link(learner)
        return latency + (0.0 if math.isinf(bw) else num_bytes * 8.0 / bw)

    def syncer_crashes_by(self, t: float) -> tuple[int, float | None]:
        """How many syncer outages have begun by t, and when the last one began (a restart
        delay of 0 makes an empty outage, which `syncer_up` never sees: a crash still)."""
        with self._lock:
            n = bisect.bisect_right(self.syncer_down, (t + self.offset, math.inf))
            return n, (self.syncer_down[n - 1][0] - self.offset if n else None)

    def syncer_up(self, t: float) -> bool:
        return self.syncer_down_since(t) is None

    def syncer_down_since(self, t: float) -> float | None:
        """When the syncer outage holding t began (None if the syncer is up at t; negative:
        before this attempt started)."""
        since = self._down_at(self.syncer_down, t + self.offset)
        return None if since is None else since - self.offset

    def to_json(self) -> list[dict]:
        """The timeline as JSON-ready dicts (for the run's event log), in run times."""
        return [e._asdict() for e in self.events]


class SlowdownDebt:
    """How long a learner sleeps after a step to run at `step_time_parts` of its speed.

    A real step cannot be made faster, so a noise draw below one cannot be emulated on the
    step that drew it: sleeping `max(0, factor - 1)` of each step would make mean-one noise
    a slowdown (about 4% at the paper's std 0.10). Instead the noise's share is a running
    balance: a fast draw earns credit that later slow draws spend before anything is slept,
    so over many steps the emulated time tends to the noise's mean (the sleep exceeds it by
    the balance's running maximum, which grows like the square root of the steps, not like
    their number). The steady part (a slower chip, a straggler episode) is at least one and
    is slept in full, never paid from the noise's credit: an episode is as slow as its
    factor says however lucky the steps before it were.
    """

    def __init__(self):
        self.balance = 0.0  # seconds of noise slowdown owed (> 0) or earned (< 0)

    def owed(self, steady: float, noise: float, seconds: float) -> float:
        """Seconds to sleep after a step of `seconds` compute whose factor is steady*noise."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return 0.0
        sleep = (steady - 1.0) * seconds  # the steady factor of the step's own compute
        self.balance += steady * (noise - 1.0) * seconds
        if self.balance > 0:
            sleep, self.balance = sleep + self.balance, 0.0
        return max(sleep, 0.0)
