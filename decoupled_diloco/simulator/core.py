"""`simulate`: goodput, uptime and downtime of one method on one failure trace.

Methods (any chip count N, any learner count M):

* ``dp`` -- non-elastic data parallelism over all N chips (`restart_timeline`).
* ``elastic_dp`` -- elastic data parallelism over all N chips (`elastic_timeline`).
* ``decoupled`` -- M learners of N/M chips, each an elastic job of its own slices that never
  waits for the others; the syncer merges whatever arrives (quorum K, max_wait = 0).

Accounting, identical for every method:

* goodput = useful chip-time / allocated chip-time. Useful = chip-time in running segments
  less the discarded part (in-flight steps, work since the last checkpoint or offer when
  state is lost, data-parallel snapshot stalls), times the synchronisation efficiency (a
  synchronous job's chips idle while waiting for its slowest slice each step). Allocated = N
  chips for the whole horizon (FaultSpec mode: the learners' membership windows),
  including slices waiting for their replacement; the fleet's spares and repairs are
  outside the job's allocation, for every method alike.
* uptime = fraction of the horizon in which the global model advances: the job runs (DP,
  elastic DP), or >= K learners run and the syncer is up (Decoupled DiLoCo).
* downtime_seconds = (1 - uptime) * horizon; failures = failures that hit hardware in service,
  and for Decoupled DiLoCo each syncer crash the schedule keeps (one that starts an outage:
  as the run's ledger counts them, which with diloco.syncer_shards = S counts one per shard).
  Real runs measure uptime from the advances they see (runtime/accounting.py): the same
  quantity, except that a measured outage counts the whole gap between the advances around
  it, and outages shorter than two sync periods (2·H steps, `tolerance_steps`) are not seen.

Consequences worth knowing: Decoupled DiLoCo with M = 1 and K = 1 is *exactly* elastic DP
(same trace, same numbers) as long as the job never loses every unit at once (then elastic
DP falls back to its last checkpoint and a learner to its last offers, which coincide for
P = 1 fragment offered every checkpoint interval); and Decoupled DiLoCo with M learners has
the expected goodput of elastic DP on N/M chips -- the paper's rule of thumb falls out of
the model instead of being put in. One approximation shows at small N only: a unit that
failed while a DP job was already recovering cannot fail again until its own replacement
time has passed (trace.drop_failures_while_down), so DP on one or a few slices whose MTBF is
near its recovery time is optimistic (one 64-chip slice failing every 30 s with a 55 s
recovery: uptime 0.41 where 30/85 = 0.35); at 10^5 chips and more it does not move a digit.
"""

import dataclasses

import numpy as np

from decoupled_diloco import fault_steps, faults
from decoupled_diloco.simulator import timeline as tlm
from decoupled_diloco.simulator.params import METHODS, SimParams, validate_sim_params
from decoupled_diloco.simulator.trace import JOIN, Trace, chip_trace, schedule_trace

_MC_STEPS = 32  # Monte-Carlo steps for the expected slowest-slice wait


@dataclasses.dataclass(frozen=True)
class SimResult:
    method: str
    chips: int
    learners: int
    seed: int
    horizon_s: float
    goodput: float
    uptime: float
    downtime_seconds: float
    failures: int
    recoveries: int
    sync_efficiency: float  # useful fraction of running chip-time (stragglers, speed spread)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# What one process models: it keeps arrays per chip (~16 bytes each), per slice (~70 bytes:
# the synchronisation efficiency draws one step's noise at a time; --slice_chips=1 at 4M
# chips took 297 MB) and per failure (~200 bytes: 1.2M chips and 0.92M failures took
# 210 MB, 12M chips and 0.46M failures 173 MB).
MAX_CHIPS = 100_000_000
MAX_FAILURES = 20_000_000
# With a FaultSpec, a synchronous job's pace is sampled per learner at up to
# _PACE_SAMPLES instants (~36 KB a learner: 20,000 learners took 0.77 GB).
MAX_PACED_LEARNERS = 100_000
_PACE_SAMPLES = 2048


def _check(method: str, chips: int, learners: int, p: SimParams, spec) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if int(chips) != chips or chips < 1:
        raise ValueError(f"chips must be an integer >= 1, got {chips}")
    if int(learners) != learners or learners < 1:
        raise ValueError(f"learners must be an integer >= 1, got {learners}")
    if chips % learners:
        raise ValueError(f"chips ({chips}) must be divisible by learners ({learners})")
    if method == "decoupled" and p.quorum > learners:
        raise ValueError(f"quorum ({p.quorum}) cannot exceed learners ({learners})")
    slow = p.slow_fraction * learners
    if spec is None and p.slow_factor != 1 and abs(slow - round(slow)) > 1e-9:
        raise ValueError(
            f"slow_fraction ({p.slow_fraction}) of {learners} learner(s) is {slow:g} "
            f"learners: use a multiple of 1/{learners} (for DP, pass the compared run's "
            "--learners: its slow chips are the same)"
        )
    if spec is not None and chips != learners * spec.chips_per_learner:
        raise ValueError(
            f"chips ({chips}) must equal learners ({learners}) * faults.chips_per_learner "
            f"({spec.chips_per_learner}) when a FaultSpec drives the simulation"
        )
    validate_sim_params(p)
    if chips > MAX_CHIPS:
        raise ValueError(
            f"chips ({chips:,}) above {MAX_CHIPS:,}: the simulation keeps arrays per chip "
            "and per slice in memory (~16 bytes a chip, ~70 a slice: --slice_chips=1 at "
            "100M chips takes ~7 GB)"
        )
    if spec is not None and method != "decoupled" and learners > MAX_PACED_LEARNERS:
        raise ValueError(
            f"learners ({learners:,}) above {MAX_PACED_LEARNERS:,} for --method={method} with "
            f"a fault spec: the job's pace is sampled per learner at up to {_PACE_SAMPLES} "
            f"instants (~36 KB a learner, ~{learners * 36e3 / 1e9:.0f} GB here): simulate "
            "fewer learners"
        )
    failures = _failures_per_s(chips, p, spec) * p.horizon_s
    if failures > MAX_FAILURES:
        raise ValueError(
            f"~{failures:,.0f} failures expected (chips x horizon / chip MTBF) above "
            f"{MAX_FAILURES:,}, each kept in memory (~200 bytes): shorten the horizon or "
            "simulate fewer chips"
        )


def _slice_efficiency(trace: Trace, learners: int, groups: int, p: SimParams) -> np.ndarray:
    """[groups] E[busy chip-time] / E[chips * slowest slice] per synchronous group of slices."""
    unit_chips = trace.unit_chips
    busy_U = unit_chips.astype(np.float64)
    slowest_U = np.ones(len(unit_chips))
    rng = np.random.default_rng([p.seed % 2**63, 1])
    if p.chip_speed_std > 0:
        s = p.chip_speed_std
        chip_f = np.exp(s * rng.standard_normal(int(unit_chips.sum())) - 0.5 * s * s)
        offsets = np.concatenate([[0], np.cumsum(unit_chips)[:-1]])
        busy_U = np.add.reduceat(chip_f, offsets)
        slowest_U = np.maximum.reduceat(chip_f, offsets)
    n_slow = round(p.slow_fraction * learners)
    slow_U = np.where(trace.unit_learner >= learners - n_slow, p.slow_factor, 1.0)
    busy_U, slowest_U = busy_U * slow_U, slowest_U * slow_U
    group_U = trace.unit_learner * groups // learners
    starts = np.flatnonzero(np.r_[True, group_U[1:] != group_U[:-1]])
    busy, slowest = np.zeros(len(starts)), np.zeros(len(starts))
    steps = _MC_STEPS if p.step_noise_std > 0 else 1
    for _ in range(steps):  # one step's noise at a time: a few arrays per unit in memory
        noise_U = np.ones(1)
        if p.step_noise_std > 0:
            s = p.step_noise_std
            noise_U = np.exp(s * rng.standard_normal(len(unit_chips)) - 0.5 * s * s)
        busy += np.add.reduceat(busy_U * noise_U, starts)
        slowest += np.maximum.reduceat(slowest_U * noise_U, starts)
    return busy / (slowest * np.add.reduceat(unit_chips, starts))


def _schedule_efficiency(schedule: faults.FaultSchedule, p: SimParams, method: str) -> float:
    """Synchronous learners wait for the slowest running one each step: the running
    learners' busy time over their time at the slowest's pace, E[sum f] / E[n * max f]
    over the step time factors f of the learners in the job: members that are up (a slow
    learner that left or is down paces nothing; a DP job runs only while every member is
    up)."""
    horizon = schedule.horizon_s
    n = int(min(_PACE_SAMPLES, np.ceil(horizon / p.step_s)))
    t = (np.arange(n) + 0.5) * (horizon / n)
    f = schedule.step_time_factors(np.floor(t / p.step_s).astype(np.int64), t)
    member, running = _running(schedule, t)
    if method == "dp":
        running &= (running == member).all(0)
    busy = np.where(running, f, 0.0).sum(0)
    paced = running.sum(0) * np.where(running, f, 0.0).max(0)
    return float(busy.sum() / paced.sum()) if paced.sum() > 0 else 1.0


def _running(schedule: faults.FaultSchedule, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[learners, len(t)] twice: whether each learner is a member at times t, and whether
    it is a member and not down."""
    t = t + schedule.offset  # (the schedule's intervals are on its own clock)
    member = np.zeros((schedule.num_learners, t.size), dtype=bool)
    for learner in range(schedule.num_learners):
        for a, b in schedule.member_windows[learner]:
            member[learner] |= (t >= a) & (t < b)
    up = member.copy()
    for learner in range(schedule.num_learners):
        for a, b in schedule.down[learner]:
            up[learner] &= ~((t >= a) & (t < b))
    return member, up


def _quorum_down_s(tls: list, quorum: int, syncer_down, horizon: float) -> float:
    """Seconds in which fewer than quorum learners run or the syncer is down."""
    big = len(tls) + 1
    starts = [np.asarray(tl.starts) for tl in tls] + [np.asarray([a for a, _ in syncer_down])]
    ends = [np.asarray(tl.ends) for tl in tls] + [np.asarray([b for _, b in syncer_down])]
    deltas = [np.ones(len(x)) for x in starts[:-1]] + [np.full(len(syncer_down), -big)]
    times = np.concatenate(starts + ends)
    delta = np.concatenate(deltas + [-d for d in deltas])
    order = np.argsort(times, kind="stable")
    t = np.minimum(times[order], horizon)
    count = np.cumsum(delta[order])
    dur = np.diff(np.append(t, horizon))
    return float(dur[count < quorum].sum()) + (float(t[0]) if len(t) else horizon)


def snapshot_interval_s(p: SimParams, failures_per_s: float) -> float:
    """p.checkpoint_interval_s, or for 0 Young's optimum sqrt(2 * cost * job MTBF) (the
    first-order minimum of cost / interval + interval / (2 * MTBF)), at least one step."""
    if p.checkpoint_interval_s > 0:
        return p.checkpoint_interval_s
    if failures_per_s <= 0:
        return p.horizon_s
    return max(p.step_s, float(np.sqrt(2.0 * p.checkpoint_cost_s / failures_per_s)))


def _failures_per_s(chips: int, p: SimParams, spec) -> float:
    """The job's expected failure rate: what it would size its snapshot interval on."""
    if spec is None:
        return chips / p.chip_mtbf_s
    rate = chips / (spec.chip_mtbf_hours * 3600.0) if spec.chip_mtbf_hours > 0 else 0.0
    return rate + len(spec.crashes) / p.horizon_s


def _timelines(
    method: str,
    trace: Trace,
    p: SimParams,
    groups: int,
    interval_s: float,
    spares_ok: bool,
) -> list[tlm.Timeline]:
    """One timeline for DP / elastic DP, one per learner for Decoupled DiLoCo. Without
    spares (FaultSpec mode) a failed unit's restart in the schedule is its relaunch: an
    elastic job or learner that lost every unit runs again restore_s after one is back."""
    chips_U, up_U = trace.unit_chips.tolist(), trace.initial_up.tolist()
    if method == "dp":
        events = (trace.time.tolist(), trace.kind.tolist(), trace.unit.tolist())
        return [
            tlm.restart_timeline(
                events + (trace.back.tolist(),),
                chips_U,
                up_U,
                trace.horizon_s,
                relaunch_s=p.detect_s + p.restart_s,
                graceful_relaunch_s=p.restart_s,
                restore_s=p.restore_s,
                checkpoint_interval_s=interval_s,
                checkpoint_cost_s=p.checkpoint_cost_s,
                wait_for_back=not spares_ok,
            )
        ]
    if method == "decoupled":
        loss = tlm.fragment_loss(p.sync_period_s, p.fragments)
        owner_E, owner_U = trace.unit_learner[trace.unit], trace.unit_learner
    else:
        loss = tlm.checkpoint_loss(interval_s)
        owner_E, owner_U = np.zeros(len(trace.unit), int), np.zeros(len(chips_U), int)
    # A unit that joins in the middle of an outage is in service from its restart (BACK) on.
    usable_E = (trace.kind != JOIN) | (trace.back <= trace.time)
    out = []
    for g in range(groups):
        sel = (owner_E == g) & usable_E
        out.append(
            tlm.elastic_timeline(
                (trace.time[sel].tolist(), trace.kind[sel].tolist(), trace.unit[sel].tolist()),
                chips_U,
                (trace.initial_up & (owner_U == g)).tolist(),
                trace.horizon_s,
                detect_s=p.detect_s,
                reconfig_s=p.reconfig_s,
                relaunch_s=p.detect_s + p.restart_s if spares_ok else 0.0,
                graceful_relaunch_s=p.restart_s if spares_ok else 0.0,
                restore_s=p.restore_s,
                step_s=p.step_s,
                state_loss_s=loss,
            )
        )
    return out


def simulate(
    method: str,
    chips: int,
    learners: int = 1,
    params: SimParams | None = None,
    fault_spec: faults.FaultSpec | None = None,
) -> SimResult:
    """Simulates one run. Without `fault_spec`, failures come from params.chip_mtbf_years
    on N chips in slices; with it, from `FaultSchedule(fault_spec, learners, horizon)`, each
    learner one unit of chips_per_learner chips (the comparison with real runs). The
    schedule then has its own seed (`fault_spec.seed`, also the result's `seed`) and speeds:
    params.seed and the other chip-MTBF fields (simulate.CHIP_MTBF_ONLY) are not used. A
    step schedule (`unit = "steps"`) is placed in time at params.step_s seconds per step of
    the fastest learner, a slower one's steps at its speed factor's share more
    (`fault_steps.in_seconds`)."""
    p = SimParams() if params is None else params
    _check(method, chips, learners, p, fault_spec)
    if fault_spec is not None:
        speeds = faults.speed_factors_of(fault_spec, learners)
        fault_spec = fault_steps.in_seconds(fault_spec, p.step_s, speeds)
    horizon = p.horizon_s
    if fault_spec is None:
        trace = chip_trace(chips, learners, p)
        groups = learners if method == "decoupled" else 1
        eff_G = _slice_efficiency(trace, learners, groups, p)
    else:
        schedule = faults.FaultSchedule(fault_spec, learners, horizon)
        trace = schedule_trace(schedule, fault_spec.chips_per_learner)
        eff = 1.0 if method == "decoupled" else _schedule_efficiency(schedule, p, method)
        eff_G = np.full(learners if method == "decoupled" else 1, eff)
    interval_s = snapshot_interval_s(p, _failures_per_s(chips, p, fault_spec))
    tls = _timelines(method, trace, p, len(eff_G), interval_s, fault_spec is None)
    # The discarded chip-time was running at the group's efficiency too: what it lost is
    # its share of the useful work (subtracted whole, its idle share counted twice).
    useful = sum(e * (tl.chip_s() - tl.lost_chip_s) for e, tl in zip(eff_G, tls, strict=True))
    syncer_down = trace.syncer_down if method == "decoupled" else ()  # (DP has no syncer)
    if method == "decoupled":
        down_s = _quorum_down_s(tls, p.quorum, syncer_down, horizon)
    else:
        down_s = tls[0].down_s(horizon)
    down_s = min(max(down_s, 0.0), horizon)  # (summed pieces can round past the horizon)
    run_chip_s = sum(tl.chip_s() for tl in tls)
    return SimResult(
        method=method,
        chips=int(chips),
        learners=int(learners),
        seed=int(p.seed if fault_spec is None else fault_spec.seed),
        horizon_s=horizon,
        goodput=float(max(useful, 0.0) / trace.allocated_chip_s),
        uptime=1.0 - down_s / horizon,
        downtime_seconds=down_s,
        failures=sum(tl.failures for tl in tls) + len(syncer_down),
        recoveries=sum(tl.recoveries for tl in tls),
        # (weighted by running chip-time; nothing ran: the groups' plain mean)
        sync_efficiency=float(
            np.dot(eff_G, [tl.chip_s() for tl in tls]) / run_chip_s
            if run_chip_s > 0
            else np.mean(eff_G)
        ),  # fmt: skip
    )
