"""Issue 18, item 7: downtime in the run's own time scale, fault schedules in steps.

Attacks: a slow host (every step k times slower) must not turn into downtime; a syncer
outage must show as downtime of about its length; a data-parallel run is up unless its job
is down; a step-scheduled crash hits the same training step on a fast and a slow learner;
malformed step schedules are refused with the field named. Ledger tests replay synthetic
timelines (pure, milliseconds); one tiny local run checks the crash steps end to end.
"""

import dataclasses
import json
import logging
import time

import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco import fault_steps, faults
from decoupled_diloco.faults import FaultSchedule, FaultSpec, validate_fault_spec
from decoupled_diloco.runtime.accounting import Ledger, down_gaps
from decoupled_diloco.simulator import SimParams, simulate

STEP_S = 0.1  # seconds per step of the synthetic fast host


def decoupled_run(scale: float, syncer_outage=None, crash=None, steps=300) -> Ledger:
    """Two learners (H = 4, P = 2, K = 1) stepping every STEP_S * scale s, with a little
    per-step jitter; a merge every H/P steps, none while the syncer is down. `crash`:
    (learner, start, end) in fast-host seconds; `syncer_outage`: (start, end)."""
    ledger = Ledger(2, sync_every=4, fragments=2)
    down = syncer_outage or (float("inf"), float("inf"))
    for m in range(2):
        t = 0.0
        for i in range(steps):
            t += STEP_S * (1.0 + 0.3 * ((7 * i + 3 * m) % 5) / 5)  # uneven, deterministic
            if crash and crash[0] == m and crash[1] <= t < crash[2]:
                continue
            ledger.step(m, STEP_S * scale, t * scale)
            if m == 0 and i % 2 == 1 and not down[0] <= t < down[1]:
                rec = {"time": (t + 0.01) * scale, "fragment": i // 2 % 2}
                ledger.merge({**rec, "learners": [0], "c_steps": [2]})
    if crash:
        ledger.failure(crash[0], crash[1] * scale)
        ledger.restart(crash[0], crash[2] * scale)
    if syncer_outage:
        ledger.failure(("syncer", 0), down[0] * scale)
        ledger.restart(("syncer", 0), down[1] * scale)
    return ledger


def test_uniformly_slow_host_is_not_downtime():
    fast = decoupled_run(1.0, crash=(1, 10.0, 14.0))  # K = 1: learner 0 keeps merging
    slow = decoupled_run(5.0, crash=(1, 10.0, 14.0))
    for ledger in (fast, slow):
        uptime, down = ledger.uptime(wall=1e9)
        assert uptime == 1.0 and down == 0.0


def test_a_syncer_outage_is_downtime_of_about_its_length_on_any_host():
    fast_up, fast_down = decoupled_run(1.0, syncer_outage=(10.0, 14.0)).uptime(1e9)
    slow_up, slow_down = decoupled_run(5.0, syncer_outage=(10.0, 14.0)).uptime(1e9)
    # The whole gap between the merges around it: 4 s plus at most ~2 merge intervals.
    assert 4.0 <= fast_down <= 4.0 + 4 * 2 * STEP_S
    assert slow_down == pytest.approx(5 * fast_down)
    assert slow_up == pytest.approx(fast_up) and 0.8 < fast_up < 0.9
    # Shorter than the tolerance (2H = 8 steps): no advance came later than usual.
    assert decoupled_run(1.0, syncer_outage=(10.0, 10.3)).uptime(1e9) == (1.0, 0.0)


def test_quorum_that_cannot_fill_is_downtime():
    """K = 2 of 2: learner 1 is down, merges stop although learner 0 steps on."""
    ledger = Ledger(2, sync_every=4, fragments=1)
    for i in range(200):
        t = (i + 1) * STEP_S
        ledger.step(0, STEP_S, t)
        if not 8.0 <= t < 12.0:
            ledger.step(1, STEP_S, t)
            if i % 4 == 3:
                ledger.merge({"time": t, "learners": [0, 1], "c_steps": [4, 4]})
    ledger.failure(1, 8.0)
    ledger.restart(1, 12.0)
    _, down = ledger.uptime(1e9)
    assert 4.0 <= down <= 4.0 + 2 * 4 * STEP_S


def test_start_up_until_every_fragment_merged_is_not_downtime():
    """A loaded host compiles the merge paths slowly: fragment 1 first merges 4 s after
    fragment 0 while the learners step on; from then on merges come as usual."""
    ledger = Ledger(1, sync_every=4, fragments=2)
    for i in range(200):
        t = (i + 1) * STEP_S
        ledger.step(0, STEP_S, t)
        if i % 2 == 1 and (t > 5.0 or i == 1):
            ledger.merge({"time": t, "fragment": i // 2 % 2, "learners": [0], "c_steps": [2]})
    assert ledger.uptime(1e9) == (1.0, 0.0)
    ledger.fragments = 3  # a fragment that never merges: measured from the first advance
    assert ledger.uptime(1e9)[1] == pytest.approx(5.0, abs=STEP_S)


def test_an_attempt_that_trains_nothing_has_no_downtime():
    """A resume whose learners had finished takes no step and merges nothing: no horizon,
    not a whole attempt of downtime; one whose learners stepped without a merge is down."""
    ledger = Ledger(2, sync_every=4, fragments=2)
    assert ledger.uptime(30.0) == (1.0, 0.0)
    ledger.step(0, 0.1, 1.0)
    assert ledger.uptime(30.0) == (0.0, 30.0)


def dp_run(scale: float, crash=None, stall=None) -> Ledger:
    """Data-parallel: one learner, every step an advance. `crash`/`stall`: (start, end) in
    fast-host seconds without steps; a crash is a failure, a stall (slow host) is not."""
    ledger = Ledger(1)
    for i in range(200):
        t = (i + 1) * STEP_S
        if any(gap and gap[0] <= t < gap[1] for gap in (crash, stall)):
            continue
        ledger.step(0, STEP_S * scale, t * scale)
        ledger.advance(t * scale)
    if crash:
        ledger.failure(0, crash[0] * scale)
        ledger.restart(0, (crash[1] - 1.0) * scale)  # back, then 1 s to its first step
    return ledger


def test_data_parallel_is_up_unless_its_job_is_down():
    assert dp_run(1.0).uptime(1e9) == (1.0, 0.0)
    assert dp_run(5.0, stall=(5.0, 9.0)).uptime(1e9) == (1.0, 0.0)  # a stall, nobody down
    for scale in (1.0, 5.0):
        uptime, down = dp_run(scale, crash=(5.0, 9.0)).uptime(1e9)
        assert down == pytest.approx(4.0 * scale, abs=STEP_S * scale)
        assert uptime == pytest.approx(1 - 4.0 / 20.0, abs=0.01)


def test_the_run_ending_during_an_outage_counts_it():
    ledger = dp_run(1.0)
    ledger.failure(0, 20.0)
    ledger.finish(0, 26.0)  # stopped while down
    _, down = ledger.uptime(26.0)
    assert down == pytest.approx(6.0, abs=STEP_S)


# --- fault schedules in steps ------------------------------------------------------------------
def test_step_crash_fires_at_its_step_on_a_fast_and_a_slow_host():
    spec = FaultSpec(unit="steps", crashes=((0, 30),), restart_delay_s=2.0)
    for step_s in (0.01, 0.5):
        schedule = FaultSchedule(spec, 2, 1e6)
        fired = [s for s in range(1, 60) if schedule.learner_reached(0, s, s * step_s)]
        assert fired == [30]
        t = 30 * step_s
        assert not schedule.is_up(0, t) and schedule.is_up(0, t + 2.0) and schedule.is_up(1, t)
        assert [(e.kind, e.time) for e in schedule.events_between(0, 1e6)] == [
            ("crash", t),
            ("restart", t + 2.0),
        ]


def test_step_crash_fires_once_and_not_when_resumed_past_it():
    schedule = FaultSchedule(FaultSpec(unit="steps", crashes=((0, 5),)), 1, 1e6)
    assert [s for s in range(10) if schedule.learner_reached(0, s, float(s))] == [5]
    assert not schedule.learner_reached(0, 5, 100.0)  # redone after a restore
    resumed = FaultSchedule(FaultSpec(unit="steps", crashes=((0, 5), (0, 12))), 1, 1e6)
    assert [s for s in range(8, 15) if resumed.learner_reached(0, s, float(s))] == [12]
    # Resumed at the crash's own step (it fired there before the kill): not again (it did,
    # and a Ctrl-C'd run resumed at step 30 counted 3 failures for one crash).
    at = FaultSchedule(FaultSpec(unit="steps", crashes=((0, 30), (0, 31))), 1, 1e6)
    assert [s for s in range(30, 35) if at.learner_reached(0, s, float(s))] == [31]


def test_a_resumed_run_does_not_replay_the_syncer_crashes_its_lead_passed():
    spec = FaultSpec(unit="steps", syncer_crashes=(20, 36, 50), syncer_restart_delay_s=1.0)
    resumed = FaultSchedule(spec, 2, 1e6)
    for step in range(36, 60):  # resumed at step 36: the crashes at 20 and 36 happened
        resumed.run_reached(step, float(step))
    assert resumed.syncer_down == [(50.0, 51.0)]


def test_a_resume_starts_in_the_membership_the_earlier_attempts_left():
    """Resumed at lead step 30 of a step schedule: learner 0, whose window ended at step 20,
    is no member from the start (it was one until some learner's first step applied the
    leave, and in that race it started, rejoined and trained a step), learner 1, who joined
    at 25, is one, and neither change fires again; those after 30 still do."""
    spec = FaultSpec(unit="steps", membership=((0, 0, 20), (0, 40, 60), (1, 25, 60),
                                               (2, 0, 60)))  # fmt: skip
    s = FaultSchedule(spec, 3, 1e6, steps_checked={"learners": [20, 30, 30], "lead": 30})
    assert [s.is_member(m, 0.0) for m in range(3)] == [False, True, True]
    s.run_reached(31, 1.0)
    assert [(e.kind, e.learner) for e in s.events if e.kind in ("join", "leave")] == []
    s.run_reached(40, 2.0)
    assert [(e.kind, e.learner) for e in s.events if e.kind in ("join", "leave")] == [("join", 0)]
    assert s.is_member(0, 2.0) and not s.never_member_again(0, 2.0, 60)
    fresh = FaultSchedule(spec, 3, 1e6)  # a fresh run: the windows from step 0
    assert [fresh.is_member(m, 0.0) for m in range(3)] == [True, False, True]


def test_a_resume_fires_exactly_the_step_faults_no_attempt_checked():
    """attempts.jsonl records how far each learner checked its step schedule (and the lead,
    the syncer's): a resume replays nothing that fired and drops nothing that did not.
    Without the record, a learner resumed at a crash's own step took it as fired, so a
    Ctrl-C there (which stops the learner before it checks the step) lost the crash."""
    spec = FaultSpec(unit="steps", crashes=((0, 30), (0, 25), (1, 40)), syncer_crashes=(30,),
                     syncer_restart_delay_s=1.0)  # fmt: skip

    def attempt(first: int, last: int, checked=None) -> tuple[list, list, dict]:
        """Learner 0 checks steps first..last, learner 1 reaches the same; returns what
        fired (learner 0's crashes, syncer crashes) and the attempt's record."""
        s = FaultSchedule(spec, 2, 1e6, steps_checked=checked)
        fired = [t for t in range(first, last + 1) if s.learner_reached(0, t, float(t))]
        for t in range(first, last + 1):
            s.run_reached(t, float(t))
        return fired, [a for a, _ in s.syncer_down], s.steps.progress()

    # Ctrl-C at step 30: learner 0 stopped before checking 30, the lead too.
    fired, syncer, record = attempt(0, 29)
    assert fired == [25] and syncer == [] and record == {"learners": [29, -1], "lead": 29}
    fired, syncer, _ = attempt(30, 35, fault_steps.merge_progress([record]))
    assert fired == [30] and syncer == [30.0]
    # Checked (and fired) at 30 before the kill: resumed at 30, not again.
    _, _, record = attempt(0, 30)
    fired, syncer, _ = attempt(30, 35, fault_steps.merge_progress([record]))
    assert fired == [] and syncer == []
    # Resumed from an older checkpoint (step 20) than the attempt reached (28), then cut
    # ahead to Θ's clock: the crash at 25 fired then, and does not again.
    _, _, record = attempt(0, 28)
    s = FaultSchedule(spec, 2, 1e6, steps_checked=fault_steps.merge_progress([record]))
    assert not s.learner_reached(0, 20, 0.0) and not s.learner_reached(0, 29, 1.0)
    assert s.learner_reached(0, 30, 2.0)
    # The record of several attempts: the furthest each got; none recorded: None.
    merged = fault_steps.merge_progress([{"learners": [3, 9], "lead": 9}, None,
                                         {"learners": [7], "lead": 7}])  # fmt: skip
    assert merged == {"learners": [7, 9], "lead": 9}
    assert fault_steps.merge_progress([None, None]) is None


def test_attempts_record_how_far_the_step_schedule_was_checked(tmp_path):
    from decoupled_diloco.runtime.workdir import ATTEMPTS, Attempt

    first = Attempt(str(tmp_path), [], forced=False)
    progress = {"learners": [12, 9], "lead": 12}
    first.watch(lambda: {}, lambda: 0.0, lambda: progress)
    first.stop()
    assert json.loads((tmp_path / ATTEMPTS).read_text())["fault_steps"] == progress
    second = Attempt(str(tmp_path), [], forced=False)
    assert second.fault_steps_checked == progress
    second.stop()  # one that checked nothing carries the record on
    assert Attempt(str(tmp_path), [], forced=False).fault_steps_checked == progress


def test_syncer_crash_and_membership_follow_the_runs_lead_step():
    spec = FaultSpec(
        unit="steps",
        syncer_crashes=(20,),
        syncer_restart_delay_s=3.0,
        membership=((1, 10, 40), (2, 0, 15)),
    )
    schedule = FaultSchedule(spec, 3, 1e6)
    assert not schedule.is_member(1, 0.0) and schedule.is_member(2, 0.0)
    for step in range(1, 50):
        schedule.run_reached(step, float(step))
        schedule.run_reached(step // 2, float(step))  # a slower learner: the lead counts
    assert schedule.syncer_down == [(20.0, 23.0)]
    assert schedule.member_windows[1] == [(10.0, 40.0)]
    assert schedule.member_windows[2] == [(0.0, 15.0)]
    assert schedule.never_member_again(2, 16.0, last_step=100)
    late = FaultSchedule(FaultSpec(unit="steps", membership=((0, 30, 40),)), 2, 1e6)
    assert not late.never_member_again(0, 5.0, last_step=100)  # its join is still to come
    assert late.never_member_again(0, 5.0, last_step=20)  # beyond the step budget: never


def test_simulator_places_a_step_schedule_at_its_step_time():
    p = SimParams(horizon_days=0.01, step_s=0.5)
    steps = FaultSpec(unit="steps", crashes=((0, 100),), restart_delay_s=30.0)
    seconds = FaultSpec(crashes=((0, 50.0),), restart_delay_s=30.0)
    assert fault_steps.in_seconds(steps, 0.5) == seconds
    assert simulate("dp", 1, 1, p, steps) == simulate("dp", 1, 1, p, seconds)


def test_simulator_places_a_slow_learners_step_schedule_at_its_own_pace():
    """A learner twice as slow as the fastest (whose step time step_s is) reaches its step
    100 twice as late; the lead step (syncer crashes, membership) moves at the fastest
    learner's pace (every entry was placed at step_s per step)."""
    p = SimParams(horizon_days=0.01, step_s=0.5)
    steps = FaultSpec(unit="steps", crashes=((0, 100), (1, 100)), syncer_crashes=(40,),
                      membership=((2, 10, 60),), speed_factors=(1.5, 3.0, 2.0))  # fmt: skip
    placed = fault_steps.in_seconds(steps, 0.5, faults.speed_factors_of(steps, 3))
    assert placed.crashes == ((0, 50.0), (1, 100.0))
    assert placed.syncer_crashes == (20.0,) and placed.membership == ((2, 5.0, 30.0),)
    uniform = dataclasses.replace(steps, speed_factors=(6.0, 6.0, 6.0))  # step_s measured
    assert fault_steps.in_seconds(uniform, 0.5, [6.0] * 3).crashes == ((0, 50.0), (1, 50.0))
    seconds = dataclasses.replace(placed, unit="seconds")
    assert simulate("decoupled", 3, 3, p, steps) == simulate("decoupled", 3, 3, p, seconds)
    halves = FaultSpec(unit="steps", crashes=((1, 100),), slow_fraction=0.5, slow_factor=2.0)
    assert faults.speed_factors_of(halves, 2).tolist() == [1.0, 2.0]
    assert fault_steps.in_seconds(halves, 0.5, [1.0, 2.0]).crashes == ((1, 100.0),)


def test_a_learners_later_step_crashes_come_after_its_earlier_outages():
    """A step crash fires when the learner completes that step, which a learner down for an
    earlier crash reaches that much later: placed at s*step_s alone, a crash two steps after
    another fell inside that one's outage, and the simulator dropped it."""
    p = SimParams(horizon_days=200 / 86400, step_s=1.0, restore_s=1.0, sync_period_s=8.0,
                  fragments=4)  # fmt: skip
    close = FaultSpec(unit="steps", crashes=((0, 12), (1, 30), (0, 10), (0, 12)),
                      restart_delay_s=5.0)  # fmt: skip
    placed = fault_steps.in_seconds(close, 1.0)
    assert placed.crashes == ((0, 10.0), (0, 17.0), (1, 30.0))  # one crash per step
    far = dataclasses.replace(close, crashes=((0, 10), (0, 20)))
    for method in ("decoupled", "elastic_dp"):
        assert simulate(method, 2, 2, p, close).failures == 3
        assert simulate(method, 2, 2, p, far).failures == 2


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(unit="minutes"), "faults.unit must be one of"),
        (dict(unit="steps", crashes=((0, 2.5),)), "faults.crashes .*whole steps"),
        (dict(unit="steps", crashes=((0, 0),)), "faults.crashes .*>= 1"),
        (dict(unit="steps", syncer_crashes=(0.5,)), "faults.syncer_crashes"),
        (dict(unit="steps", membership=((0, 1.5, 4),)), "faults.membership .*whole steps"),
        (dict(unit="steps", membership=((0, 4, 4),)), "faults.membership needs 0 <= join"),
    ],
)
def test_bad_step_schedules_are_refused_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        validate_fault_spec(FaultSpec(**fields), 2)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(crashes=((0, 60),)), r"faults.crashes .*< train.steps \(60\): \(0, 60\) would"),
        (dict(syncer_crashes=(75,)), "faults.syncer_crashes .*75 would never happen"),
        (dict(membership=((1, 60, 80),)), "faults.membership .*would never join"),
    ],
)
def test_a_step_schedule_past_the_runs_end_is_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        validate_fault_spec(FaultSpec(unit="steps", **fields), 2, max_step=60)
    validate_fault_spec(FaultSpec(unit="steps", crashes=((0, 59),), syncer_crashes=(59,),
                                  membership=((1, 59, 80),)), 2, max_step=60)  # fmt: skip


def test_a_step_crash_after_its_learners_last_window_is_refused():
    """A learner's own step never passes the run's lead step, so a crash at a step at or
    after its last membership window's end would never happen (the leave at that step comes
    before the crash; it was accepted, and silently never fired). Before the window's end,
    or with a later window, it may."""
    members = ((0, 0, 20), (1, 0, 60))
    for step in (20, 30):
        match = (rf"faults.crashes .* has \(0, {step}\) at or after the end of learner 0's "
                 r"last membership window \(step 20\)")  # fmt: skip
        with pytest.raises(ValueError, match=match):
            validate_fault_spec(FaultSpec(unit="steps", crashes=((0, step),),
                                          membership=members), 2, max_step=60)  # fmt: skip
    for crashes, membership in ((((0, 19),), members),
                                (((0, 30),), members + ((0, 40, 50),)),
                                (((1, 30),), members)):  # fmt: skip
        validate_fault_spec(FaultSpec(unit="steps", crashes=crashes, membership=membership),
                            2, max_step=60)  # fmt: skip


def test_a_resumed_late_joiner_has_no_random_crash_from_before_this_attempt():
    """Learner 1 joined at the run's step 25, in an earlier attempt; the run resumes at
    run time 200 (lead 30). When it joined is not recorded, so its random crashes are
    placed from the resume on: one at run time 85 (before it could have joined; a fresh run
    leaves those unplaced until the join) put it down from the start and hid later ones."""
    spec = FaultSpec(unit="steps", membership=((0, 0, 60), (1, 25, 60)), chip_mtbf_hours=0.02,
                     chips_per_learner=1, restart_delay_s=200.0, seed=3)  # fmt: skip
    fresh = FaultSchedule(spec, 2, 1e4)
    assert not fresh.down[1] and any(t < 200 for t in fresh._unplaced[1])
    resumed = FaultSchedule(spec, 2, 1e4, offset_s=200.0,
                            steps_checked={"learners": [30, 30], "lead": 30})  # fmt: skip
    assert resumed.is_member(1, 0.0) and resumed.down_since(1, 0.0) is None
    later = [t for t in fresh._unplaced[1] if t >= 200]
    assert resumed.down[1] and resumed.down[1][0][0] == later[0]
    assert resumed.down[0] == fresh.down[0]  # a member from step 0: as in the fresh run


@pytest.mark.parametrize(
    "membership, match",
    [
        (((0, 0, 40), (1, 50, 100)), r"leaves steps 40\.\.50 without a member"),
        (((0, 5, 40), (1, 10, 100)), "has no learner at step 0"),
        (((0, 0, 40), (1, 20, float("inf"))), "needs whole steps .*a leave past train.steps"),
        # every learner gone at step 50 of 60: the run ended there, exit 0
        (((0, 0, 20), (0, 30, 50), (1, 10, 35)), "every learner gone after step 50: the run "),
    ],
)
def test_a_step_membership_that_would_stall_the_lead_step_is_refused(membership, match):
    """Joins follow the run's lead step, which only moves while some member trains: a gap
    hung the run (the join waited for a step nobody would take)."""
    with pytest.raises(ValueError, match="faults.membership .*" + match):
        validate_fault_spec(FaultSpec(unit="steps", membership=membership), 2, max_step=60)


@pytest.mark.parametrize(
    "membership",
    [
        ((0, 0, 40), (1, 40, 100)),  # the hand-over step: learner 1 joins as 0 leaves
        ((1, 30, 50),),  # learner 0 has no window: a member throughout
        ((0, 0, 20), (0, 30, 60), (1, 10, 35)),  # the last leave at train.steps
    ],
)
def test_a_step_membership_with_a_member_at_every_step_is_accepted(membership):
    validate_fault_spec(FaultSpec(unit="steps", membership=membership), 2, max_step=60)


def test_seconds_schedules_keep_fractional_times():
    validate_fault_spec(FaultSpec(crashes=((0, 2.5),), syncer_crashes=(0.5,)), 2)


def test_ray_refuses_step_membership_before_starting_anything(small_config, tmp_path):
    pytest.importorskip("ray")
    cfg = small_config(**{"diloco.learners": 2, "diloco.sync_every": 4, "runtime": "ray",
                          "faults.unit": "steps", "faults.membership": [[1, 2, 8]]})  # fmt: skip
    with pytest.raises(ValueError, match="membership .*local runtime"):
        config_lib.validate(cfg)  # at start-up, before any workdir


@pytest.mark.slow
def test_local_run_crashes_a_fast_and_a_slow_learner_at_their_scheduled_steps(
    small_config, tmp_path
):
    """Learner 1 runs 4x slower; each crashes after its step 5 and rejoins 1 s later."""
    from decoupled_diloco.runtime.local import LocalRuntime

    cfg = small_config(**{"train.steps": 10, "diloco.learners": 2, "diloco.sync_every": 2,
                          "diloco.fragments": 2, "diloco.grace_gamma": 0.0,
                          "faults.unit": "steps", "faults.crashes": [[0, 5], [1, 5]],
                          "faults.restart_delay_s": 1.0,
                          "faults.speed_factors": [1.0, 4.0]})  # fmt: skip
    summary = LocalRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False).run()
    with open(tmp_path / "events.jsonl", encoding="utf-8") as f:
        events = [json.loads(line) for line in f]
    downs = {e["learner"]: e for e in events if e["event"] == "learner_down"}
    backs = {e["learner"]: e for e in events if e["event"] == "rejoin"}
    assert {m: e["step"] for m, e in downs.items()} == {0: 5, 1: 5}
    for m in (0, 1):
        assert backs[m]["time"] >= downs[m]["time"] + 1.0 and backs[m]["step"] == 5
    assert summary["failures"] == 2 and summary["restarts"] == 2
    assert summary["steps"] == 10 and summary["downtime_gap_steps"] == 2 * 2


@pytest.mark.slow
def test_a_crash_before_the_first_step_is_a_failure_and_a_rejoin(small_config, tmp_path):
    """A crash at time 0 comes before the learner's state exists: it was only a late start,
    counted nowhere (2 crashes scheduled, 1 failure reported). (A step schedule refuses
    step 0.)"""
    from decoupled_diloco.runtime.local import LocalRuntime

    cfg = small_config(**{"train.steps": 6, "diloco.learners": 2, "diloco.sync_every": 2,
                          "diloco.fragments": 2, "diloco.grace_gamma": 0.0,
                          "faults.crashes": [[1, 0.0]],
                          "faults.restart_delay_s": 0.5})  # fmt: skip
    summary = LocalRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False).run()
    with open(tmp_path / "events.jsonl", encoding="utf-8") as f:
        events = [json.loads(line) for line in f if json.loads(line).get("learner") == 1]
    kinds = [
        e["event"] for e in events if e["event"] in ("learner_start", "learner_down", "rejoin")
    ]
    assert kinds == ["learner_down", "rejoin"]
    assert summary["failures"] == 1 and summary["restarts"] == 1 and summary["steps"] == 6


def test_a_learner_down_in_a_gap_does_not_pace_it():
    """Learner 1 took 2 steps, then crashed: the gap is paced by learner 0's 10 steps."""
    steps = [[0.1 * i for i in range(1, 11)], [0.1, 0.2]]
    gaps = down_gaps([0.0, 1.05], steps, [(1, 0.25, 2.0)], (0.0, 1.05), tolerance=8)
    assert gaps == [(0.0, 1.05)]


def test_the_progress_line_follows_the_leading_learner_and_names_those_down(tmp_path):
    """Learner 0 down at the start (a long restart delay): the line moves with the others'
    rows and says who is down (it followed learner 0 alone, and printed nothing for minutes)."""
    import io

    from decoupled_diloco.metrics import Progress
    from decoupled_diloco.runtime.records import RunLog

    log, out = RunLog(str(tmp_path), Ledger(3), tensorboard=False), io.StringIO()
    progress = Progress(20, stream=out, learners=3)
    log.event({"event": "learner_down", "learner": 0, "step": 0, "time": 0.0})
    for m, step in [(1, 5), (2, 5), (1, 10), (2, 8)]:
        rec = {"learner": m, "step": step, "loss": 2.0, "tokens_per_second": 100.0}
        progress.learner_row(m, step, log.progress_text(rec, uses_syncer=True))
    lines = out.getvalue().splitlines()
    assert [ln.split("s learner ")[1].split()[0] for ln in lines] == ["1", "2", "1"]  # 2@8: behind
    assert lines[-1].endswith("merges 0 down: learner 0") and " 10/20 " in lines[-1]
    log.event({"event": "rejoin", "learner": 0, "step": 0, "time": 1.0})
    rec = {"learner": 0, "step": 11, "loss": 2.0, "tokens_per_second": 100.0}
    assert "down" not in log.progress_text(rec, uses_syncer=True)
    log.close()


def test_merges_a_syncer_restore_rolls_back_are_no_longer_useful_work(tmp_path, caplog):
    """Learner 0's merges of fragment 0 at versions 1-3, of fragment 1 at 1-2; the syncer
    restores fragment 0 at version 1 and fragment 1 at 2: the merges at versions 2 and 3 of
    fragment 0 are gone from Θ, and their steps no longer count as useful."""
    from decoupled_diloco.runtime.records import RunLog

    log = RunLog(str(tmp_path), Ledger(1, sync_every=4, fragments=2))
    for t, (p, version) in enumerate([(0, 1), (1, 1), (0, 2), (1, 2), (0, 3)]):
        log.ledger.step(0, 1.0, t + 1.0)
        rec = {"fragment": p, "version": version, "offer_seconds": [0.1], "time": t + 1.5}
        log.record({"event": "merge", "learners": [0], "c_steps": [4], "share": 0.5, **rec})
    assert log.ledger.useful_steps == [10.0] and log.ledger.merges == 5
    with caplog.at_level(logging.WARNING):
        log.event({"event": "syncer_restore", "shard": 0, "versions": {"0": 1, "1": 2},
                   "after_failure": True, "time": 6.0})  # fmt: skip
    assert "2 merges made since are rolled back" in caplog.text  # and logged
    assert "(8 learner steps, less what" in caplog.text
    assert log.ledger.useful_steps == [6.0]
    s = log.ledger.summary(wall=7.0, uses_syncer=True, learner_steps=[5])
    assert (s["merges"], s["rolled_back_merges"], s["mean_offer_steps"]) == (3, 2, 4.0)
    assert s["syncer_lost_steps"] == 8  # fragment 0's versions 2 and 3
    # The restored life merges version 2 again; a later restore at 1 takes that one back.
    log.record({"event": "merge", "fragment": 0, "version": 2, "learners": [0], "c_steps": [4],
                "share": 0.5, "time": 6.5})  # fmt: skip
    log.event({"event": "syncer_restore", "shard": 0, "versions": {0: 1}, "time": 7.0})
    assert log.ledger.useful_steps == [6.0] and log.ledger.rolled_back_merges == 3
    assert log.ledger.syncer_lost_steps == 12
    log.close()


def test_a_learner_down_when_its_membership_ends_counts_what_its_crash_lost(tmp_path):
    """Learner 0's life began at step 8; it crashed at step 28 and its window ended while
    it was down, so no rejoin counts the loss (it counted none). Fragment 0 holds its
    steps up to 24, fragment 1 up to 16: 12 steps are lost, as crash losses; an offer of
    fragment 1 in flight at the crash, merged later, brings it down to 4. Steps a syncer
    restore rolled back stay syncer losses."""
    from decoupled_diloco.runtime.records import RunLog

    log = RunLog(str(tmp_path), Ledger(2, sync_every=8, fragments=2))

    def merge(fragment, version, step):
        log.record({"event": "merge", "fragment": fragment, "version": version,
                    "learners": [0], "c_steps": [8], "steps": [step], "share": 1.0,
                    "time": 1.0})  # fmt: skip

    for fragment, version, step in [(0, 1, 16), (0, 2, 24), (1, 1, 16)]:
        merge(fragment, version, step)
    log.event({"event": "learner_down", "learner": 0, "step": 28, "time": 2.0})
    assert log.ledger.crash_lost_steps == 0  # it may yet rejoin and count it there
    log.event({"event": "learner_gone", "learner": 0, "step": 28, "life_start": 8, "time": 3.0})
    assert log.ledger.crash_lost_steps == 12
    assert log.ledger.summary(wall=4.0, uses_syncer=True, learner_steps=[28, 0])[
        "crash_lost_steps"] == 12  # fmt: skip
    merge(1, 2, 24)
    assert log.ledger.crash_lost_steps == 4
    log.event({"event": "syncer_restore", "shard": 0, "versions": {"0": 1},
               "after_failure": True, "time": 5.0})  # fmt: skip
    assert (log.ledger.crash_lost_steps, log.ledger.syncer_lost_steps) == (4, 8)
    log.close()


def test_a_crash_does_not_count_the_steps_a_syncer_restore_rolled_back(tmp_path):
    """Learner 0's offers of steps 1-4 and 5-8 were merged, then rolled back by a restore;
    it had not seen the second merge when it crashed at step 10, so its rejoin finds Θ
    lacking steps 5-10. Steps 5-8 are `syncer_lost_steps`: the crash lost 9-10 only."""
    from decoupled_diloco.runtime.records import RunLog

    log = RunLog(str(tmp_path), Ledger(2, sync_every=4, fragments=1))
    for version, step in [(1, 4), (2, 8)]:
        log.record({"event": "merge", "fragment": 0, "version": version, "learners": [0],
                    "c_steps": [4], "steps": [step], "share": 1.0, "time": 1.0})  # fmt: skip
    log.event({"event": "syncer_restore", "shard": 0, "versions": {"0": 0},
               "after_failure": True, "time": 2.0})  # fmt: skip
    assert log.ledger.syncer_lost_steps == 8
    log.event({"event": "learner_down", "learner": 0, "step": 10, "time": 2.5})
    log.event({"event": "rejoin", "learner": 0, "step": 10, "lost_steps": 6,
               "lost_spans": {"0": [[4, 10]]}, "time": 3.0})  # fmt: skip
    assert log.ledger.crash_lost_steps == 2
    # Learner 1's spans are its own: nothing of it was rolled back.
    log.event({"event": "rejoin", "learner": 1, "step": 6, "lost_steps": 6,
               "lost_spans": {"0": [[0, 6]]}, "time": 3.5})  # fmt: skip
    assert log.ledger.crash_lost_steps == 2 + 6
    # A learner restored from its checkpoint at step 6 goes on on another timeline: the
    # rolled-back spans past it no longer stand for its later steps.
    log.event({"event": "resume_cut", "learner": 0, "step": 6, "lost_steps": 2,
               "lost_spans": {"0": [[4, 6]]}, "time": 4.0})  # fmt: skip
    assert log.ledger.resume_lost_steps == 0  # steps 5-6 were rolled back
    log.event({"event": "rejoin", "learner": 0, "step": 9, "lost_steps": 3,
               "lost_spans": {"0": [[6, 9]]}, "time": 5.0})  # fmt: skip
    assert log.ledger.crash_lost_steps == 8 + 3
    log.close()
    lines = (tmp_path / "events.jsonl").read_text(encoding="utf-8").splitlines()
    first = [e for e in map(json.loads, lines) if e["event"] == "rejoin"][0]
    assert (first["lost_steps"], first["rolled_back_steps"]) == (2, 4)  # the log says so too


def test_rolled_back_steps_that_are_merged_again_are_not_lost(tmp_path):
    """Learner 0 had not applied the merge of its steps 1-2 when a restore rolled it back:
    that work was still its own, and its next offer brought it again (steps 1-5). Only
    learner 1, which had applied its merge of steps 1-4 and rebased away from it, lost
    steps (it counted 2 + 4)."""
    from decoupled_diloco.runtime.records import RunLog

    log = RunLog(str(tmp_path), Ledger(2, sync_every=4, fragments=1))
    log.record({"event": "merge", "fragment": 0, "version": 1, "learners": [0, 1],
                "c_steps": [2, 4], "steps": [2, 4], "share": 1.0, "time": 1.0})  # fmt: skip
    log.event({"event": "syncer_restore", "shard": 0, "versions": {"0": 0},
               "after_failure": True, "time": 2.0})  # fmt: skip
    assert log.ledger.syncer_lost_steps == 6  # as far as the restore can tell
    log.record({"event": "merge", "fragment": 0, "version": 1, "learners": [0],
                "c_steps": [5], "steps": [5], "share": 1.0, "time": 3.0})  # fmt: skip
    assert log.ledger.syncer_lost_steps == 4
    log.close()


def test_a_resume_does_not_count_again_the_steps_an_earlier_attempts_restore_rolled_back(
    tmp_path,
):
    """Attempt 1: learner 0's steps 1-4 and 5-8 were merged, then rolled back (8 steps of
    `syncer_lost_steps`); the run was killed before the learner saw it, so its notes beside
    the checkpoints lack them. Attempt 2 takes them from attempt 1's record: its cut, which
    finds Θ lacking steps 1-10 of the learner restored at step 10, counts 9-10 only, and
    its own `syncer_lost_steps` are 0 (attempt 1 counted them). A cut that goes back past
    them (a checkpoint at step 6) leaves them on the timeline it left."""
    from decoupled_diloco.runtime.records import RunLog

    first = Ledger(1, sync_every=4, fragments=1)
    for version, step in [(1, 4), (2, 8)]:
        first.merge({"fragment": 0, "version": version, "learners": [0], "c_steps": [4],
                     "steps": [step], "share": 1.0, "time": 1.0})  # fmt: skip
    first.rollback({"0": 0})
    record = json.loads(json.dumps(first.rolled_spans()))  # (through attempts.jsonl)
    assert record == {"0": {"0": [[0, 8]]}} and first.syncer_lost_steps == 8
    log = RunLog(str(tmp_path), Ledger(1, sync_every=4, fragments=1))
    log.ledger.seed_rolled(record)
    assert log.ledger.syncer_lost_steps == 0
    assert log.ledger.rolled_spans() == record  # carried on to a third attempt
    log.event({"event": "resume_cut", "learner": 0, "step": 10, "lost_steps": 10,
               "lost_spans": {"0": [[0, 10]]}, "time": 1.0})  # fmt: skip
    assert log.ledger.resume_lost_steps == 2
    log.ledger.rewound(0, 6)
    assert log.ledger.rolled_spans() == {"0": {"0": [[0, 6]]}}
    log.close()


def test_a_syncer_restore_counts_each_learners_most_lost_steps_of_any_fragment(tmp_path):
    """Per learner, the most steps any one fragment lost (a step is work on every fragment:
    lost from two it is still one step), summed over learners."""
    from decoupled_diloco.runtime.records import RunLog

    log = RunLog(str(tmp_path), Ledger(2, sync_every=4, fragments=2))
    for p, version, c_steps in [(0, 1, [4, 3]), (1, 1, [4, 4]), (0, 2, [2, 5])]:
        log.record({"event": "merge", "fragment": p, "version": version, "learners": [0, 1],
                    "c_steps": c_steps, "share": 0.5, "time": 1.0})  # fmt: skip
    log.event({"event": "syncer_restore", "shard": 0, "versions": {"0": 0, "1": 0},
               "after_failure": True, "time": 2.0})  # fmt: skip
    # learner 0: fragment 0 lost 4 + 2, fragment 1 lost 4; learner 1: 3 + 5 and 4
    assert log.ledger.syncer_lost_steps == 6 + 8
    log.close()


@pytest.mark.slow
def test_a_finished_learners_last_save_does_not_hold_up_the_others_merges(
    small_config, tmp_path, monkeypatch
):
    """Learners of speeds 1, 1.5 and 8 (K = 1): once learner 0 has finished, no offer is
    fresh and the others' merge in catch-up rounds, which wait for every live learner.
    Learner 1's last checkpoint lasts until two of the slowest learner's offers have merged
    after its first second (at most 30 s): it must not be live and silent through it (its
    final offers and leave go first), so those merges come. (None came for the whole save
    when the save came first.) The save waits for merges, not for a fixed time, which a
    fast machine's slowest learner outran."""
    from decoupled_diloco.runtime import learner_loop
    from decoupled_diloco.runtime.local import LocalRuntime

    steps, limit, window = 48, 30.0, []
    save = learner_loop.LearnerLoop.save

    def slowest_merges(after: float) -> list[float]:
        with open(tmp_path / "merges.jsonl", encoding="utf-8") as f:
            merges = [json.loads(line) for line in f if line.strip()]
        return [m["time"] for m in merges if 2 in m["learners"] and m["time"] > after]

    def slow_last_save(loop):
        if loop.m == 1 and loop.step == steps and not window:
            start = loop.clock()
            while len(slowest_merges(start + 1.0)) < 2 and loop.clock() < start + limit:
                time.sleep(0.05)
            window.extend([start, loop.clock()])
        save(loop)

    monkeypatch.setattr(learner_loop.LearnerLoop, "save", slow_last_save)
    cfg = small_config(**{"train.steps": steps, "diloco.learners": 3, "diloco.sync_every": 6,
                          "diloco.fragments": 2, "diloco.overlap": 1, "diloco.quorum": 1,
                          "diloco.max_wait": 0.0, "devices_per_learner": 2,
                          "faults.speed_factors": [1.0, 1.5, 8.0]})  # fmt: skip
    LocalRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False).run()
    start, end = window
    assert end - start < limit, (window, slowest_merges(0.0))


@pytest.mark.slow
def test_a_crashed_learner_leaves_at_once_and_the_others_final_sync_does_not_wait_for_it(
    small_config, tmp_path
):
    """Learner 2 crashes at its step 30 of 40 and is down for 8 s. Its runtime posts the
    dead life's Leave (as Ray's driver does for a process it kills): the other two finish
    their final sync while it is down, instead of waiting for it to rejoin (their final
    offers wait for a round that a live learner has not offered in; a silent one counted
    as live until diloco.heartbeat_timeout)."""
    from decoupled_diloco.runtime.local import LocalRuntime

    cfg = small_config(**{"train.steps": 40, "diloco.learners": 3, "diloco.sync_every": 4,
                          "diloco.fragments": 2, "diloco.overlap": 1, "diloco.quorum": 1,
                          "diloco.max_wait": 0.0, "devices_per_learner": 2,
                          "faults.unit": "steps", "faults.crashes": [[2, 30]],
                          "faults.restart_delay_s": 8.0})  # fmt: skip
    summary = LocalRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False).run()
    with open(tmp_path / "events.jsonl", encoding="utf-8") as f:
        events = [json.loads(line) for line in f]

    def first(kind, m, **match):
        return next(e for e in events if e["event"] == kind and e.get("learner") == m
                    and all(e.get(k) == v for k, v in match.items()))  # fmt: skip

    down, back = first("learner_down", 2), first("rejoin", 2)
    assert first("leave", 2, finished=False)["time"] < down["time"] + 1.0
    for m in (0, 1):
        assert first("learner_done", m)["time"] < back["time"], events
    assert not [e for e in events if e["event"] == "final_sync_unconfirmed"]
    assert summary["steps"] == 40 and summary["failures"] == 1


def test_a_syncer_outage_of_no_length_is_still_counted_as_a_crash():
    """A restart delay of 0 makes an empty outage, which `syncer_up` never sees; the count
    of outages begun says that one happened (and when)."""
    spec = FaultSpec(unit="steps", syncer_crashes=(4, 9), syncer_restart_delay_s=0.0)
    schedule = FaultSchedule(spec, 2, 1e6)
    assert schedule.syncer_crashes_by(100.0) == (0, None)
    for step in range(5):  # the lead reaches step 4 at time 10
        schedule.run_reached(step, 6.0 + step)
    assert schedule.syncer_up(10.0) and schedule.syncer_crashes_by(10.5) == (1, 10.0)
    for step in range(5, 10):
        schedule.run_reached(step, 11.0 + 2 * (step - 5))
    assert schedule.syncer_crashes_by(20.0) == (2, 19.0)
    assert schedule.syncer_crashes_by(15.0) == (1, 10.0)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 1.0])
def test_a_local_syncer_crash_happens_whatever_its_restart_delay(small_config, tmp_path, delay):
    """faults.syncer_restart_delay_s=0: the local syncer's loop, polling whether it was up,
    never saw the empty outage: no crash, no restore (Ray's driver acts on the event)."""
    from decoupled_diloco.runtime.local import LocalRuntime

    cfg = small_config(**{"train.steps": 10, "diloco.learners": 2, "diloco.sync_every": 2,
                          "faults.unit": "steps", "faults.syncer_crashes": [4],
                          "faults.syncer_restart_delay_s": delay})  # fmt: skip
    summary = LocalRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False).run()
    with open(tmp_path / "events.jsonl", encoding="utf-8") as f:
        events = [json.loads(line) for line in f]
    (crash,) = [e for e in events if e["event"] == "syncer_crash"]
    restores = [e for e in events if e["event"] == "syncer_restore" and e["time"] >= crash["time"]]
    assert len(restores) == 1 and restores[0]["time"] >= crash["down_since"] + delay
    assert crash["down_since"] <= crash["time"]
    assert summary["steps"] == 10
