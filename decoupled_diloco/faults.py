"""Seeded fault schedule: one description of failures shared by real runs and the simulator.

A `FaultSpec` (part of the run config) says *what* can go wrong; `FaultSchedule` turns it
into a deterministic timeline for M learners over a horizon, reproducible from
`spec.seed`. The runtime consumes the events (crash a learner, restart it, slow it down,
drop the syncer); the goodput simulator (`decoupled_diloco.simulator`) consumes the same
schedule, so a real CPU run's measured goodput can be set beside the simulator's
prediction for the very same timeline.

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
import dataclasses
import math
import threading
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from decoupled_diloco import fault_random, fault_steps

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
UNITS = ("seconds", "steps")


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """What can go wrong in a run; times in seconds of wall (or simulated) time, except the
    explicit schedule (crashes, membership, syncer_crashes) with `unit = "steps"`."""

    seed: int = 0  # draws of the random faults (chip failures, stragglers, speed noise)
    # "seconds" | "steps": unit of the times in crashes, membership and syncer_crashes
    # (steps: a learner's own completed steps for its crashes, the run's lead step for the
    # others; see fault_steps.py). Delays and durations stay in seconds.
    unit: str = "seconds"
    crashes: tuple[tuple[int, float], ...] = ()  # explicit (learner, time) crashes
    chip_mtbf_hours: float = 0.0  # 0 = no random crashes; else exponential per chip
    chips_per_learner: int = 1  # a learner crashes when any of its chips fails
    restart_delay_s: float = 5.0  # seconds, in either unit: crash -> learner back (rejoins)
    straggler_rate_per_hour: float = 0.0  # Poisson rate of slowdown episodes per learner
    straggler_duration_s: float = 10.0  # seconds each slowdown episode lasts
    straggler_slowdown: float = 2.0  # step-time multiplier during an episode
    speed_factors: tuple[float, ...] = ()  # per-learner step-time multiplier; () = all 1
    slow_fraction: float = 0.0  # alternative to speed_factors: the last this-fraction...
    slow_factor: float = 1.0  # ...of learners get this step-time multiplier (1.18 = 18% slower)
    speed_noise: float = 0.0  # std of the multiplicative per-step log-normal noise (0.10)
    link_latency_s: tuple[float, ...] = ()  # per-learner one-way latency to the syncer; () = 0
    link_bandwidth_bps: tuple[float, ...] = ()  # per-learner bits/s; () or 0 = unlimited
    membership: tuple[tuple[int, float, float], ...] = ()  # (learner, join, leave) times
    syncer_crashes: tuple[float, ...] = ()  # times the syncer crashes
    syncer_restart_delay_s: float = 5.0  # seconds, in either unit


class FaultEvent(NamedTuple):
    """One timeline entry; `learner` is -1 for syncer events."""

    time: float
    kind: str  # one of _KIND_ORDER
    learner: int
    factor: float = 1.0  # step-time multiplier, for straggle_start


_ORDER = {k: i for i, k in enumerate(_KIND_ORDER)}


def _event_key(e: FaultEvent) -> tuple:
    return (e.time, _ORDER[e.kind], e.learner)


def _fail(field: str, msg: str):
    raise ValueError(f"faults.{field} {msg}")


def _is_number(x) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


def _check_shapes(spec: FaultSpec) -> None:
    """Every field has the form its docs give (a flat list where pairs are due, a string
    among numbers): named here, before any arithmetic on it could fail unnamed."""
    forms = {"crashes": ("learner", spec.unit), "membership": ("learner", "join", "leave")}
    for field, names in forms.items():
        entries = getattr(spec, field)
        if isinstance(entries, str):  # a command-line value that is no Python literal
            _fail(field, f"must be a Python literal: a list of ({', '.join(names)}) entries, "
                  f"got the text {entries!r} (an infinite leave is written 1e400)")  # fmt: skip
        if not isinstance(entries, tuple | list):
            _fail(field, f"must be a list of ({', '.join(names)}) entries, got {entries!r}")
        for entry in entries:
            if not isinstance(entry, tuple | list) or len(entry) != len(names):
                _fail(field, f"entries must be ({', '.join(names)}), got {entry!r}")
            if not all(_is_number(x) for x in entry):
                _fail(field, f"entries must hold numbers, got {entry!r}")
    for field in ("speed_factors", "link_latency_s", "link_bandwidth_bps", "syncer_crashes"):
        values = getattr(spec, field)
        if not isinstance(values, tuple | list) or not all(_is_number(x) for x in values):
            _fail(field, f"must be a list of numbers, got {values!r}")
    for f in dataclasses.fields(FaultSpec):
        v = getattr(spec, f.name)
        if _is_number(f.default) and not _is_number(v):
            _fail(f.name, f"must be a number, got {v!r}")
        values = _numbers(v) if f.name != "membership" else [x for e in v for x in e[:2]]
        bad = [x for x in values if _is_number(x) and not math.isfinite(x)]  # (leave: inf = stays)
        if bad:  # would reach sleeps and rates as hangs or silent no-ops
            _fail(f.name, f"must be finite, got {bad[0]}{_FINITE_HINTS.get(f.name, '')}")


# What an infinite value may have meant, and how a schedule says it.
_FINITE_HINTS = {
    "link_bandwidth_bps": " (0 is unlimited)",
    "chip_mtbf_hours": " (0: no random crashes)",
    "restart_delay_s": " (a learner gone for good: end its faults.membership window)",
    "syncer_restart_delay_s": " (a syncer that never returns stops every merge)",
}


def _numbers(value) -> list:
    """The numbers in a field's value: a number, a list of them or a list of entries."""
    if not isinstance(value, tuple | list):
        return [value]
    return [x for e in value for x in (e if isinstance(e, tuple | list) else (e,))]


HORIZON_S = 7 * 24 * 3600.0  # fault timelines of a run are drawn this far ahead
MAX_RANDOM_EVENTS = 1_000_000  # expected draws of one random process over a timeline
# Larger finite values are refused at start-up: a learner this much slower, a delay this
# long, a link this slow is no schedule a run lives through (the sleeps and waits they
# reach overflowed, killing a learner or link thread mid-run).
MAX_SLOWDOWN = 1e4  # step-time multipliers (speed_factors, slow_factor, straggler_slowdown)
MAX_SPEED_NOISE = 2.0  # std of the per-step log-normal noise (the paper's is 0.10)
MIN_BANDWIDTH_BPS = 1e3  # a limited link's bits/s (0 = unlimited)


def _check_rates(spec: FaultSpec, m: int, horizon_s: float) -> None:
    """Refuses random processes that would draw more than MAX_RANDOM_EVENTS events over the
    timeline (a crash every few milliseconds: memory and start-up time, never a run)."""
    expected = {"straggler_rate_per_hour": m * spec.straggler_rate_per_hour / 3600 * horizon_s}
    if spec.chip_mtbf_hours > 0:
        chips = m * spec.chips_per_learner
        expected["chip_mtbf_hours"] = chips / (spec.chip_mtbf_hours * 3600) * horizon_s
    for field, n in expected.items():
        if n > MAX_RANDOM_EVENTS:
            _fail(field, f"({getattr(spec, field)}) draws ~{n:.3g} events over the "
                  f"{horizon_s / 3600:g} h fault timeline of {m} learners (at most "
                  f"{MAX_RANDOM_EVENTS:.0e}); an event every "
                  f"{horizon_s / n * 1e3:.3g} ms cannot be a schedule")  # fmt: skip


def validate_fault_spec(
    spec: FaultSpec, num_learners: int, max_step: int | None = None, horizon_s: float = HORIZON_S
) -> None:
    """Raises ValueError naming the offending `faults.<field>` (or `num_learners`).
    `max_step`: the run's last step; a step schedule's faults must fall inside it.
    `horizon_s`: the timeline the random processes are drawn over (a run's: HORIZON_S)."""
    if num_learners < 1:
        raise ValueError(f"num_learners must be >= 1, got {num_learners}")
    m = num_learners

    def learner_ok(i, field):
        if not isinstance(i, int | np.integer) or isinstance(i, bool) or not 0 <= i < m:
            _fail(field, f"names learner {i!r}, but learners are the integers 0..{m - 1}")

    if spec.unit not in UNITS:
        _fail("unit", f"must be one of {UNITS}, got {spec.unit!r}")
    _check_shapes(spec)
    steps = spec.unit == "steps"
    for entry in spec.crashes:
        learner_ok(entry[0], "crashes")
        if not entry[1] >= 0:
            _fail("crashes", f"times must be >= 0, got {entry!r}")
    for field in ("chip_mtbf_hours", "straggler_rate_per_hour", "speed_noise"):
        if not getattr(spec, field) >= 0:
            _fail(field, f"must be >= 0, got {getattr(spec, field)}")
    for field in ("restart_delay_s", "syncer_restart_delay_s"):  # a restart that never comes
        if not 0 <= getattr(spec, field) < math.inf:  # is a removal: faults.membership
            _fail(field, f"must be finite and >= 0, got {getattr(spec, field)}")
    if int(spec.chips_per_learner) != spec.chips_per_learner or spec.chips_per_learner < 1:
        _fail("chips_per_learner", f"must be an integer >= 1, got {spec.chips_per_learner}")
    if not spec.straggler_duration_s > 0:
        _fail("straggler_duration_s", f"must be > 0, got {spec.straggler_duration_s}")
    if not spec.straggler_slowdown >= 1:
        _fail("straggler_slowdown", f"must be >= 1 (a slowdown), got {spec.straggler_slowdown}")
    if not 0 <= spec.slow_fraction <= 1:
        _fail("slow_fraction", f"must be in [0, 1], got {spec.slow_fraction}")
    if not spec.slow_factor > 0:
        _fail("slow_factor", f"must be > 0, got {spec.slow_factor}")
    if spec.speed_factors and spec.slow_fraction > 0:
        _fail("speed_factors", "and faults.slow_fraction are alternatives; set only one")
    for field in ("speed_factors", "link_latency_s", "link_bandwidth_bps"):
        values = getattr(spec, field)
        if values and len(values) != m:
            _fail(field, f"needs one value per learner ({m}) or none, got {len(values)}")
    if any(not f > 0 for f in spec.speed_factors):
        _fail("speed_factors", f"must all be > 0, got {spec.speed_factors}")
    if any(not x >= 0 for x in spec.link_latency_s + spec.link_bandwidth_bps):
        _fail("link_latency_s", "and faults.link_bandwidth_bps values must be >= 0")
    for entry in spec.membership:
        learner_ok(entry[0], "membership")
        if not 0 <= entry[1] < entry[2]:
            _fail("membership", f"needs 0 <= join < leave, got {entry!r}")
    if any(not t >= 0 for t in spec.syncer_crashes):
        _fail("syncer_crashes", f"times must be >= 0, got {spec.syncer_crashes}")
    _check_bounds(spec)
    if steps:
        fault_steps.validate(spec, max_step, m)
    _check_rates(spec, m, horizon_s)


def _check_bounds(spec: FaultSpec) -> None:
    """Finite values past what any run could live through (`MAX_SLOWDOWN` and the rest)."""
    gone = " (a learner that slow is gone: end its faults.membership window)"
    for field in ("speed_factors", "slow_factor", "straggler_slowdown"):
        big = [x for x in _numbers(getattr(spec, field)) if x > MAX_SLOWDOWN]
        if big:
            _fail(field, f"must be at most {MAX_SLOWDOWN:g}, got {big[0]:g}{gone}")
    if spec.speed_noise > MAX_SPEED_NOISE:
        _fail("speed_noise", f"must be at most {MAX_SPEED_NOISE:g} (a log-normal std; the "
              f"paper's is 0.10), got {spec.speed_noise:g}")  # fmt: skip
    for field in ("restart_delay_s", "syncer_restart_delay_s", "straggler_duration_s",
                  "link_latency_s"):  # fmt: skip
        long = [x for x in _numbers(getattr(spec, field)) if x > HORIZON_S]
        if long:
            _fail(field, f"must be at most {HORIZON_S:g} s (the {HORIZON_S / 86400:g}-day "
                  f"fault timeline), got {long[0]:g}")  # fmt: skip
    slow = [x for x in spec.link_bandwidth_bps if 0 < x < MIN_BANDWIDTH_BPS]
    if slow:
        _fail("link_bandwidth_bps", f"must be 0 (unlimited) or at least {MIN_BANDWIDTH_BPS:g} "
              f"bits/s, got {slow[0]:g}")  # fmt: skip


def timed_in_seconds(spec: FaultSpec) -> list[str]:
    """The `faults.*` fields that place events on the run's clock in seconds (which a
    resumed attempt continues: `FaultSchedule`'s offset), [] if none."""
    fields = [] if spec.unit == "steps" else [
        f for f in ("crashes", "membership", "syncer_crashes") if getattr(spec, f)
    ]  # fmt: skip
    if spec.chip_mtbf_hours > 0:
        fields.append("chip_mtbf_hours")
    if spec.straggler_rate_per_hour > 0:
        fields.append("straggler_rate_per_hour")
    return fields


def fault_spec_from_dict(d: Mapping) -> FaultSpec:
    """Builds a FaultSpec from JSON-like data (lists become tuples); unknown keys raise."""
    known = {f.name for f in dataclasses.fields(FaultSpec)}
    for k in d:
        if k not in known:
            raise ValueError(f"faults.{k} is not a known key (known: {sorted(known)})")

    def tup(v):
        return tuple(tup(x) for x in v) if isinstance(v, (list, tuple)) else v

    return FaultSpec(**{k: tup(v) for k, v in d.items()})


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
    """

    def __init__(self, spec: FaultSpec, num_learners: int, horizon_s: float, offset_s: float = 0.0):
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        if not 0 <= offset_s < math.inf:
            raise ValueError(f"offset_s must be finite and >= 0, got {offset_s}")
        validate_fault_spec(spec, num_learners, horizon_s=horizon_s)
        self.spec, self.num_learners, self.horizon_s = spec, num_learners, float(horizon_s)
        self.offset = float(offset_s)
        m = num_learners
        self.speed = np.ones(m)
        if spec.speed_factors:
            self.speed = np.asarray(spec.speed_factors, dtype=np.float64)
        elif spec.slow_fraction > 0:
            n_slow = round(spec.slow_fraction * m)
            self.speed[m - n_slow :] = spec.slow_factor
        # Step-scheduled events are added while the run goes, from every learner's thread.
        self._lock = threading.RLock()
        self.steps = fault_steps.StepTriggers(spec, m) if spec.unit == "steps" else None
        windows: dict[int, list] = {}
        for learner, join, leave in spec.membership if self.steps is None else ():
            windows.setdefault(int(learner), []).append((float(join), float(leave)))
        if self.steps is not None:  # in steps: only a window from step 0 is open at the start
            for learner, wins in self.steps.windows.items():
                windows[learner] = [(0.0, math.inf)] if wins[0][0] == 0 else []
        self.member_windows = [merge_intervals(windows.get(i, [(0.0, math.inf)])) for i in range(m)]

        events: list[FaultEvent] = []
        self.down = [[] for _ in range(m)]  # per learner: sorted [crash, restart) intervals
        # A step schedule's late joiners: their random crash times, placed when they join.
        self._unplaced: dict[int, list[float]] = {}
        for t, learner in self._crash_candidates():
            if self.steps is not None and not self.member_windows[learner]:
                self._unplaced.setdefault(learner, []).append(t)
                continue
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
        """Events with t0 <= time < t1, in timeline order (attempt times)."""
        off = self.offset
        with self._lock:
            lo = bisect.bisect_left(self._keys, (t0 + off,))
            hi = bisect.bisect_left(self._keys, (t1 + off,))
            found = self.events[lo:hi]
        return [e._replace(time=e.time - off) for e in found] if off else found

    # --- step schedules (fault_steps.py): placed on the timeline as the run reaches them ----
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

    def is_up(self, learner: int, t: float) -> bool:
        """Alive (not between a crash and its restart) and a member at time t."""
        return self.is_member(learner, t) and not _inside(self.down[learner], t + self.offset)

    def straggle_factor(self, learner: int, t: float) -> float:
        """The episode slowdown if a straggler episode is active at t, else 1."""
        active = _inside(self.straggles[learner], t + self.offset)
        return self.spec.straggler_slowdown if active else 1.0

    def step_time_factor(self, learner: int, step: int, t: float) -> float:
        """Step-time multiplier: constant speed * active straggle * hashed per-step noise."""
        factor = float(self.speed[learner]) * self.straggle_factor(learner, t)
        if self.spec.speed_noise > 0:
            factor *= float(self.step_noise(np.asarray(learner), np.asarray(step)))
        return factor

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

    def syncer_up(self, t: float) -> bool:
        return not _inside(self.syncer_down, t + self.offset)

    def syncer_down_since(self, t: float) -> float | None:
        """When the syncer outage holding t began (None if the syncer is up at t)."""
        since = _since(self.syncer_down, t + self.offset)
        return None if since is None else since - self.offset

    def to_json(self) -> list[dict]:
        """The timeline as JSON-ready dicts (for the run's event log), in run times."""
        return [e._asdict() for e in self.events]
