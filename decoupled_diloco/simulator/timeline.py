"""Event loops turning a job's failure events into its running segments.

Two recovery policies, one loop each (pure functions; one pass over the job's events):

* `restart_timeline` -- non-elastic data parallelism: any failure stops the job; it comes
  back after detection + relaunch (and the failed slice's replacement) + snapshot restore
  and loses the work since the last snapshot; snapshots stall it for their cost.
* `elastic_timeline` -- elastic data parallelism, and equally one Decoupled DiLoCo
  learner: a failure pauses the job for detection + reconfiguration, after which it runs on
  without the failed unit; units that come back join at the next reconfiguration, or at a
  dedicated one once the capacity they have idled (chip-seconds) equals what that pause
  would cost the running chips (the 2-competitive ski-rental rule: at scale, returned
  slices ride along with the next failure's reconfiguration; in a 4-learner run they are
  re-added within seconds).

Shared rule: a failure that arrives while the job is already recovering is folded into
that recovery without extending it (the recovery's final health check excludes or
replaces every unit found dead), except that a non-elastic job cannot finish recovering
before the unit whose failure started the recovery (or its replacement) is back, nor,
without spares (FaultSpec mode), before any unit that failed meanwhile is back.
"""

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from decoupled_diloco.simulator.trace import FAIL, JOIN, LEAVE

_RUN, _PAUSE, _DOWN = 0, 1, 2


@dataclasses.dataclass
class Timeline:
    """Running segments [start, end) with the chips computing in each, plus losses."""

    starts: list = dataclasses.field(default_factory=list)
    ends: list = dataclasses.field(default_factory=list)
    chips: list = dataclasses.field(default_factory=list)
    lost_chip_s: float = 0.0  # computed work thrown away (in-flight steps, since-checkpoint)
    failures: int = 0  # failures that hit a unit in service
    recoveries: int = 0  # pauses / relaunches / rejoins

    def down_s(self, horizon: float) -> float:
        """Seconds outside the running segments (summed gaps: exactly 0 if never down)."""
        gaps = np.subtract(self.starts + [horizon], [0.0] + self.ends)
        return float(gaps.sum())

    def chip_s(self) -> float:
        return float(np.dot(np.subtract(self.ends, self.starts), self.chips))


def restart_timeline(
    events: tuple[list, list, list, list],
    unit_chips: list,
    initial_up: list,
    horizon: float,
    *,
    relaunch_s: float,
    graceful_relaunch_s: float,
    restore_s: float,
    checkpoint_interval_s: float,
    checkpoint_cost_s: float = 0.0,
    wait_for_back: bool = True,
) -> Timeline:
    """Non-elastic job over all units in service. events = (time, kind, unit, back) lists.

    A failure lasts relaunch_s + restore_s, or until the failed unit (or its replacement) is
    back + restore_s if that is later, and costs the work since the last snapshot. Another
    failure during the recovery extends it to that unit's back + restore_s only if
    `wait_for_back` (no spare can stand in for the unit); otherwise the recovery's final
    health check swaps in a spare prepared alongside the relaunch. A unit the recovery waits
    for that leaves meanwhile is waited for no more: the job relaunches without it,
    graceful_relaunch_s + restore_s after the leave at the earliest. After each
    relaunch the job computes checkpoint_interval_s, stalls checkpoint_cost_s for a
    snapshot, and so on: the stalls are lost work too. A join or leave relaunches the job at
    its new size after a snapshot: graceful_relaunch_s + restore_s, nothing else lost; a
    unit that joins in the middle of an outage (its back later than the join) is awaited
    as a failed one is.
    """
    tl = Timeline()
    snap = snapshot_loss(checkpoint_interval_s, checkpoint_cost_s)
    in_service = list(initial_up)
    live = sum(c for c, up in zip(unit_chips, in_service, strict=True) if up)
    state, run_start, rec_end = (_RUN if live > 0 else _DOWN), 0.0, 0.0
    awaited: dict = {}  # unit -> when it is back, for the units the recovery waits for
    relaunched = 0.0  # the recovery's end without them, less restore_s
    for t, k, u, b in zip(*events, strict=True):
        if state == _PAUSE and t >= rec_end:
            state, run_start = (_RUN if live > 0 else _DOWN), rec_end
        if k == FAIL:
            if not in_service[u]:
                continue
            tl.failures += 1
            if state == _RUN:
                tl.starts.append(run_start), tl.ends.append(t), tl.chips.append(live)
                tl.lost_chip_s += live * snap(t - run_start, True)
                state, rec_end = _PAUSE, max(t + relaunch_s, b) + restore_s
                awaited, relaunched = {u: b}, t + relaunch_s
                tl.recoveries += 1
            elif wait_for_back and state == _PAUSE:
                rec_end = max(rec_end, b + restore_s)
                awaited[u] = b
        elif k in (LEAVE, JOIN):
            joining = k == JOIN
            if in_service[u] == joining:
                continue
            in_service[u] = joining
            if state == _PAUSE and not joining and u in awaited:
                del awaited[u]
                relaunched = max(relaunched, t + graceful_relaunch_s)
                rec_end = max([relaunched, *awaited.values()]) + restore_s
            if state == _RUN:
                tl.starts.append(run_start), tl.ends.append(t), tl.chips.append(live)
                tl.lost_chip_s += live * snap(t - run_start, False)
            if state != _PAUSE:
                state, rec_end = _PAUSE, t + graceful_relaunch_s + restore_s
                awaited, relaunched = {}, t + graceful_relaunch_s
                tl.recoveries += 1
            if joining and b > t:  # it joins in the middle of an outage: awaited as failed
                awaited[u] = b
                rec_end = max(rec_end, b + restore_s)
            live += unit_chips[u] if joining else -unit_chips[u]
    if state == _PAUSE and rec_end < horizon and live > 0:
        state, run_start = _RUN, rec_end
    if state == _RUN:
        tl.starts.append(run_start), tl.ends.append(horizon), tl.chips.append(live)
        tl.lost_chip_s += live * snap(horizon - run_start, False)
    return tl


def snapshot_loss(interval_s: float, cost_s: float) -> Callable[[float, bool], float]:
    """Seconds of work lost in a run segment of `elapsed` seconds that computes interval_s,
    stalls cost_s for a snapshot, and so on: the stalls, plus (if it ends in a `failed`
    state) everything since the last completed snapshot."""
    cycle = interval_s + cost_s

    def loss(elapsed: float, failed: bool) -> float:
        if failed:
            return elapsed - interval_s * math.floor(elapsed / cycle)
        return elapsed * cost_s / cycle

    return loss


def elastic_timeline(
    events: tuple[list, list, list],
    unit_chips: list,
    initial_up: list,
    horizon: float,
    *,
    detect_s: float,
    reconfig_s: float,
    relaunch_s: float,
    graceful_relaunch_s: float,
    restore_s: float,
    step_s: float,
    state_loss_s: Callable[[float], float],
) -> Timeline:
    """Elastic job (or one learner) over its units. events = (time, kind, unit) lists.

    FAIL: pause detect_s + reconfig_s, the in-flight step is lost, the unit is out. LEAVE:
    the same without detection or loss (graceful). BACK / JOIN: the unit waits for the
    next reconfiguration, or forces one by the ski-rental rule. If no unit is left the job's
    state is gone: it loses state_loss_s(running time since its last fresh start) of work
    and is relaunched as a non-elastic job is (restart_timeline): running again restore_s
    after the first unit is back or, if later, relaunch_s after the failure that emptied it
    (graceful_relaunch_s after a leave). A unit's return (a replacement's) covers its
    hosts starting the job's processes, so the relaunch overlaps it, never follows it.
    """
    tl = Timeline()
    status = [2 if up else 0 for up in initial_up]  # 0 out, 1 back but waiting, 2 in the job
    back_t = [0.0] * len(status)  # when a waiting unit came back
    in_use = sum(c for c, up in zip(unit_chips, initial_up, strict=True) if up)
    pending: list[int] = []
    pend_chips, pend_cr = 0, 0.0  # sum of c_u and of c_u * r_u over waiting units (r: return)
    state = _RUN if in_use > 0 else _DOWN
    run_start, seg_chips, pause_end, clock = 0.0, in_use, math.inf, 0.0
    relaunched = 0.0  # when the relaunch after the job lost every unit is done
    times, kinds, units = events
    n, i = len(times), 0
    while True:
        t_next = times[i] if i < n else horizon
        if state == _PAUSE and pause_end <= t_next:
            for u in pending:
                status[u] = 2
                in_use += unit_chips[u]
            pending, pend_chips, pend_cr = [], 0, 0.0
            state = _RUN if in_use > 0 else _DOWN
            run_start, seg_chips = pause_end, in_use
            continue
        # Idle capacity sum_u c_u (t - r_u) reaches the pause's cost in_use * reconfig_s at:
        readd_t = (in_use * reconfig_s + pend_cr) / pend_chips if pend_chips else math.inf
        if state == _RUN and readd_t <= t_next:
            t = max(readd_t, run_start)  # planned, at a step boundary: nothing lost
            tl.starts.append(run_start), tl.ends.append(t), tl.chips.append(seg_chips)
            clock += t - run_start
            state, pause_end = _PAUSE, t + reconfig_s
            tl.recoveries += 1
            continue
        if i == n:
            break
        t, k, u = times[i], kinds[i], units[i]
        i += 1
        if k in (FAIL, LEAVE):
            failed = k == FAIL
            if status[u] == 1:
                status[u] = 0
                pending.remove(u)
                pend_chips -= unit_chips[u]
                pend_cr -= unit_chips[u] * back_t[u]
                tl.failures += failed
                continue
            if status[u] == 0:
                continue
            status[u] = 0
            tl.failures += failed
            in_use -= unit_chips[u]
            if state == _RUN:
                tl.starts.append(run_start), tl.ends.append(t), tl.chips.append(seg_chips)
                clock += t - run_start
                if failed and in_use > 0:
                    tl.lost_chip_s += seg_chips * ((t - run_start) % step_s)
            if in_use <= 0 and state != _DOWN:
                if failed:
                    tl.lost_chip_s += seg_chips * state_loss_s(clock)
                state, clock = _DOWN, 0.0
                relaunched = t + (relaunch_s if failed else graceful_relaunch_s)
                if pending:  # units already back but not yet re-added: restart on them
                    state, pause_end = _PAUSE, relaunched + restore_s
                    tl.recoveries += 1
            elif state == _RUN:
                state, pause_end = _PAUSE, t + (detect_s if failed else 0.0) + reconfig_s
                tl.recoveries += 1
        elif status[u] == 0:  # BACK or JOIN
            status[u] = 1
            pending.append(u)
            back_t[u] = t
            pend_chips += unit_chips[u]
            pend_cr += unit_chips[u] * t
            if state == _DOWN:
                state, pause_end = _PAUSE, max(t, relaunched) + restore_s
                tl.recoveries += 1
    if state == _RUN:
        tl.starts.append(run_start), tl.ends.append(horizon), tl.chips.append(seg_chips)
    return tl


def checkpoint_loss(interval_s: float) -> Callable[[float], float]:
    """Work lost by a job restored from periodic checkpoints: time since the last one."""
    return lambda clock: clock % interval_s


def fragment_loss(period_s: float, fragments: int) -> Callable[[float], float]:
    """Work a Decoupled DiLoCo learner loses with its state: per fragment, the running time
    since that fragment was last offered (offers staggered by period/P), averaged."""
    offsets = np.arange(fragments) * (period_s / fragments)

    def loss(clock: float) -> float:
        age = np.where(clock >= offsets, (clock - offsets) % period_s, clock)
        return float(age.mean())

    return loss
