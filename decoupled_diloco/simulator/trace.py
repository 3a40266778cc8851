"""Failure traces: who fails when, and when the failed hardware is back.

A trace is a set of *units* (slices in chip-MTBF mode, learners in FaultSpec mode), each
owned by one learner, plus a time-sorted list of events on them. The same trace feeds
every method, so for one seed DP, elastic DP and Decoupled DiLoCo see the same failures.
"""

import dataclasses

import numpy as np

from decoupled_diloco import faults
from decoupled_diloco.simulator.params import SimParams

FAIL, BACK, LEAVE, JOIN = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class Trace:
    """Units and their events over [0, horizon_s).

    Event arrays are [E], sorted by time. `back` is, for a FAIL, when that unit (or its
    replacement) is available again; for a JOIN, when the joining unit is up (after `time`
    if it joins in the middle of an outage); for other kinds it equals `time`.
    """

    horizon_s: float
    unit_chips: np.ndarray  # [U] chips per unit
    unit_learner: np.ndarray  # [U] learner owning each unit
    initial_up: np.ndarray  # [U] bool, in service at time 0
    allocated_chip_s: float  # chip-seconds the job holds over the horizon
    time: np.ndarray
    kind: np.ndarray
    unit: np.ndarray
    back: np.ndarray
    syncer_down: tuple[tuple[float, float], ...] = ()


def slice_layout(chips: int, learners: int, slice_chips: int) -> tuple[np.ndarray, np.ndarray]:
    """(unit_chips [U], unit_learner [U]): each learner's N/M chips cut into slices, the last
    slice of a learner partial when slice_chips does not divide N/M."""
    per_learner = chips // learners
    full, rest = divmod(per_learner, slice_chips)
    one = [slice_chips] * full + ([rest] if rest else [])
    unit_chips = np.tile(np.asarray(one, dtype=np.int64), learners)
    unit_learner = np.repeat(np.arange(learners), len(one))
    return unit_chips, unit_learner


def sample_chip_failures(
    chips: int, learners: int, p: SimParams, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(time [F] sorted, unit [F]) of every chip failure, as if no chip were ever down.

    N independent exponential chip clocks superpose to one Poisson process of rate N/MTBF
    whose events hit uniformly random chips: sample that, never N clocks.
    """
    horizon = p.horizon_s
    n = rng.poisson(chips * horizon / p.chip_mtbf_s)
    time = np.sort(rng.uniform(0.0, horizon, n))
    chip = rng.integers(0, chips, n)
    per_learner = chips // learners
    slices_per_learner = -(-per_learner // p.slice_chips)
    unit = (chip // per_learner) * slices_per_learner + (chip % per_learner) // p.slice_chips
    return time, unit


def drop_failures_while_down(time: np.ndarray, unit: np.ndarray, down_s: float) -> np.ndarray:
    """Mask [F] of failures that hit a unit in service: a unit is out for down_s after each
    kept failure, and its chips cannot fail meanwhile (exact thinning, by memorylessness)."""
    order = np.lexsort((time, unit))
    t, u = time[order], unit[order]
    keep = np.ones(len(t), dtype=bool)
    suspects = np.flatnonzero((u[1:] == u[:-1]) & (np.diff(t) < down_s)) + 1
    for i in suspects.tolist():  # rare (a few % of failures): walk back to the last kept one
        j = i - 1
        while not keep[j]:
            j -= 1
        keep[i] = t[i] - t[j] >= down_s
    out = np.empty_like(keep)
    out[order] = keep
    return out


def chip_trace(chips: int, learners: int, p: SimParams) -> Trace:
    """Chip-MTBF mode, the same trace for every method: a failed slice is out of the job
    until its replacement is ready, replace_s later (a BACK event); its chips cannot fail
    meanwhile. The failed slice's own repair happens outside the job's allocation."""
    unit_chips, unit_learner = slice_layout(chips, learners, p.slice_chips)
    rng = np.random.default_rng([p.seed % 2**63, 0])
    time, unit = sample_chip_failures(chips, learners, p, rng)
    keep = drop_failures_while_down(time, unit, p.replace_s)
    time, unit = time[keep], unit[keep]
    ret = time + p.replace_s
    inside = ret < p.horizon_s
    kind = np.concatenate([np.full(len(time), FAIL), np.full(int(inside.sum()), BACK)])
    back = np.concatenate([ret, ret[inside]])
    time = np.concatenate([time, ret[inside]])
    unit = np.concatenate([unit, unit[inside]])
    order = np.argsort(time, kind="stable")
    time, kind, unit, back = time[order], kind[order], unit[order], back[order]
    return Trace(
        horizon_s=p.horizon_s,
        unit_chips=unit_chips,
        unit_learner=unit_learner,
        initial_up=np.ones(len(unit_chips), dtype=bool),
        allocated_chip_s=float(chips) * p.horizon_s,
        time=time,
        kind=kind,
        unit=unit,
        back=back,
    )


def schedule_trace(schedule: faults.FaultSchedule, chips_per_learner: int) -> Trace:
    """FaultSpec mode: one unit per learner; crashes, restarts, joins and leaves come from
    the schedule (the same timeline a real run replays).

    Events at one instant are ordered so that the unit is in service right after it exactly
    when the schedule has it up (`FaultSchedule.is_up`): leaves, restarts of earlier
    crashes, joins, then crashes, each followed by its own restart if the delay is 0. The
    schedule's order (crash before restart and join) would hide a crash at the instant the
    learner's last outage ends or its membership begins, since it hits no unit in service.
    """
    m, horizon = schedule.num_learners, schedule.horizon_s
    rows = []  # (time, rank, learner, crash index, kind, back): sorted, ties by rank
    for i in range(m):
        for n, (a, b) in enumerate(schedule.down[i]):
            rows.append((a, 3, i, n, FAIL, b))
            if b < horizon and schedule.is_member(i, b):  # (the schedule's restart event)
                rows.append((b, 3 if b == a else 1, i, n, BACK, b))
        for join, leave in schedule.member_windows[i]:
            if 0 < join < horizon:  # back: when a learner that joins mid-outage is up
                ends = [b for a, b in schedule.down[i] if a < join < b]
                rows.append((join, 2, i, 0, JOIN, ends[0] if ends else join))
            if leave < horizon:
                rows.append((leave, 0, i, 0, LEAVE, leave))
    rows.sort(key=lambda r: r[:4])
    time = np.asarray([r[0] for r in rows], dtype=np.float64)
    kind = np.asarray([r[4] for r in rows], dtype=np.int64)
    unit = np.asarray([r[2] for r in rows], dtype=np.int64)
    back = np.asarray([r[5] for r in rows], dtype=np.float64)
    member_s = sum(
        min(b, horizon) - a for wins in schedule.member_windows for a, b in wins if a < horizon
    )
    return Trace(
        horizon_s=horizon,
        unit_chips=np.full(m, chips_per_learner, dtype=np.int64),
        unit_learner=np.arange(m),
        initial_up=np.asarray([schedule.is_member(i, 0.0) for i in range(m)]),
        allocated_chip_s=float(member_s) * chips_per_learner,
        time=time,
        kind=kind,
        unit=unit,
        back=back,
        syncer_down=tuple(schedule.syncer_down),
    )
