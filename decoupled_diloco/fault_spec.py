"""What can go wrong in a run (`FaultSpec`, part of the run config) and its validation.

`validate_fault_spec` refuses, naming the `faults.<field>`, every value a run could not live
through: malformed entries, non-finite or absurd values (`MAX_SLOWDOWN` and the rest), random
processes that would draw more than `MAX_RANDOM_EVENTS` events over the `HORIZON_S`
timeline, and step schedules outside the run (`fault_steps.validate`). `faults.py` turns a
spec into the timeline the runtimes and the simulator consume.
"""

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from decoupled_diloco import fault_steps

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
    speed_factors: tuple[float, ...] = ()  # per-learner step-time multiplier >= 1; () = all 1
    slow_fraction: float = 0.0  # alternative to speed_factors: the last this-fraction...
    slow_factor: float = 1.0  # ...of learners get this step-time multiplier (1.18 = 18% slower)
    speed_noise: float = 0.0  # std of the multiplicative per-step log-normal noise (0.10)
    link_latency_s: tuple[float, ...] = ()  # per-learner one-way latency to the syncer; () = 0
    link_bandwidth_bps: tuple[float, ...] = ()  # per-learner bits/s; () or 0 = unlimited
    membership: tuple[tuple[int, float, float], ...] = ()  # (learner, join, leave) times
    syncer_crashes: tuple[float, ...] = ()  # times the syncer crashes
    syncer_restart_delay_s: float = 5.0  # seconds, in either unit


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
            hint = " (an infinite leave is written 1e400)" if field == "membership" else ""
            _fail(field, f"must be a Python literal: a list of ({', '.join(names)}) entries, "
                  f"got the text {entries!r}{hint}")  # fmt: skip
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

    if not isinstance(spec.seed, int | np.integer) or not 0 <= spec.seed < 2**63:
        _fail("seed", f"must be an int in [0, 2**63), got {spec.seed!r}")
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
    # A learner runs at its device's pace or slower: the runtime sleeps to slow one down and
    # cannot speed one up, so a factor below 1 ran at 1 (the simulator took it as asked).
    if not spec.slow_factor >= 1:
        _fail("slow_factor", f"must be >= 1 (a slowdown), got {spec.slow_factor}")
    slow = spec.slow_fraction * m
    if spec.slow_factor != 1 and abs(slow - round(slow)) > 1e-9:  # (rounding made 0.5 of 1 none)
        _fail("slow_fraction", f"of {m} learner(s) is {slow:g} learners: use a multiple of 1/{m}")
    if spec.speed_factors and spec.slow_fraction > 0:
        _fail("speed_factors", "and faults.slow_fraction are alternatives; set only one")
    for field in ("speed_factors", "link_latency_s", "link_bandwidth_bps"):
        values = getattr(spec, field)
        if values and len(values) != m:
            _fail(field, f"needs one value per learner ({m}) or none, got {len(values)}")
    if any(not f >= 1 for f in spec.speed_factors):
        _fail("speed_factors", f"must all be >= 1 (slowdowns: a learner runs at its "
              f"device's pace or slower; scale them so the fastest is 1), got "
              f"{spec.speed_factors}")  # fmt: skip
    # Each on its own: the error names the one at fault, and a list and a tuple (a spec built
    # in Python) cannot be concatenated.
    for field in ("link_latency_s", "link_bandwidth_bps"):
        negative = [x for x in getattr(spec, field) if not x >= 0]
        if negative:
            _fail(field, f"values must be >= 0, got {negative[0]}")
    for entry in spec.membership:
        learner_ok(entry[0], "membership")
        if not 0 <= entry[1] < entry[2]:
            _fail("membership", f"needs 0 <= join < leave, got {entry!r}")
    if any(not t >= 0 for t in spec.syncer_crashes):
        _fail("syncer_crashes", f"times must be >= 0, got {spec.syncer_crashes}")
    _check_bounds(spec)
    if steps:
        fault_steps.validate(spec, max_step, m)
    else:  # in seconds: an event past the timeline never happens
        late = [("crashes", e[1]) for e in spec.crashes if e[1] >= horizon_s]
        late += [("membership", e[1]) for e in spec.membership if e[1] >= horizon_s]
        late += [("syncer_crashes", t) for t in spec.syncer_crashes if t >= horizon_s]
        if late:
            field, t = late[0]
            _fail(field, f"time {t:g} s is past the {horizon_s:g} s fault timeline, where "
                  "nothing happens (a membership leave may be inf)")  # fmt: skip
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


# (field, the fields that make it read, when they do, what to set): a field off its default
# is read only when its reader is on; otherwise the run does not do what it seems to ask.
_READ_ONLY_WITH = (
    ("slow_factor", "slow_fraction", lambda s: s.slow_fraction > 0,
     "set faults.slow_fraction, the share of learners it slows"),
    ("chips_per_learner", "chip_mtbf_hours", lambda s: s.chip_mtbf_hours > 0,
     "set faults.chip_mtbf_hours, each chip's mean time between failures"),
    ("straggler_duration_s", "straggler_rate_per_hour", lambda s: s.straggler_rate_per_hour > 0,
     "set faults.straggler_rate_per_hour for straggler episodes"),
    ("straggler_slowdown", "straggler_rate_per_hour", lambda s: s.straggler_rate_per_hour > 0,
     "set faults.straggler_rate_per_hour for straggler episodes"),
    ("restart_delay_s", "crashes or chip_mtbf_hours",
     lambda s: bool(s.crashes) or s.chip_mtbf_hours > 0, "no learner crashes"),
    ("syncer_restart_delay_s", "syncer_crashes", lambda s: bool(s.syncer_crashes),
     "the syncer never crashes"),
)  # fmt: skip


def unread_fields(spec: FaultSpec) -> list[tuple[str, str]]:
    """(field, why) of the fields set off their defaults that nothing in `spec` reads (a
    slowdown factor with no slow learners, a chip count with no chip failures, ...)."""
    default = FaultSpec()
    out = []
    for field, reader, reads, fix in _READ_ONLY_WITH:
        if getattr(spec, field) != getattr(default, field) and not reads(spec):
            out.append((field, f"only read with faults.{reader} set: {fix}"))
    if spec.slow_fraction > 0 and spec.slow_factor == 1:
        out.append(("slow_fraction", "slows its learners by faults.slow_factor, which is 1"))
    return out


def speed_factors_of(spec: FaultSpec, num_learners: int) -> np.ndarray:
    """Each learner's constant step-time multiplier: `speed_factors`, or `slow_factor` for
    the last `slow_fraction` of the learners, or 1 (stragglers and noise come on top)."""
    if spec.speed_factors:
        return np.asarray(spec.speed_factors, dtype=np.float64)
    speed = np.ones(num_learners)
    if spec.slow_fraction > 0:
        n_slow = round(spec.slow_fraction * num_learners)
        speed[num_learners - n_slow :] = spec.slow_factor
    return speed


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
