"""The seeded fault schedule: determinism, crash/restart pairing, membership, speeds, links."""

import dataclasses
import math

import numpy as np
import pytest

from decoupled_diloco.faults import (
    HORIZON_S,
    FaultSchedule,
    FaultSpec,
    SlowdownDebt,
    fault_spec_from_dict,
    validate_fault_spec,
)

BUSY = FaultSpec(
    seed=7,
    chip_mtbf_hours=2.0,
    chips_per_learner=4,
    restart_delay_s=30.0,
    straggler_rate_per_hour=6.0,
    speed_noise=0.1,
    membership=((3, 600.0, 2400.0),),
    syncer_crashes=(100.0, 103.0, 1500.0),
)


def test_same_seed_same_timeline_and_different_seed_differs():
    a = FaultSchedule(BUSY, 4, 3600.0).to_json()
    b = FaultSchedule(BUSY, 4, 3600.0).to_json()
    c = FaultSchedule(dataclasses.replace(BUSY, seed=8), 4, 3600.0).to_json()
    assert a == b
    assert a != c
    assert any(e["kind"] == "crash" for e in a)


def test_explicit_crashes_pair_with_restarts_and_crash_while_down_is_ignored():
    spec = FaultSpec(crashes=((1, 50.0), (1, 52.0), (0, 10.0), (1, 70.0)), restart_delay_s=5.0)
    sched = FaultSchedule(spec, 2, 1000.0)
    got = [(e.time, e.kind, e.learner) for e in sched.events]
    assert got == [
        (10.0, "crash", 0),
        (15.0, "restart", 0),
        (50.0, "crash", 1),
        (55.0, "restart", 1),  # the crash at 52 hit a learner already down
        (70.0, "crash", 1),
        (75.0, "restart", 1),
    ]


def test_events_are_sorted_and_is_up_agrees_with_them():
    sched = FaultSchedule(BUSY, 4, 3600.0)
    times = [e.time for e in sched.events]
    assert times == sorted(times)
    member = [sched.is_member(i, 0.0) for i in range(4)]
    crashed = [False] * 4
    for k, e in enumerate(sched.events):
        if e.learner < 0:
            continue
        if e.kind in ("crash", "restart"):
            crashed[e.learner] = e.kind == "crash"
        elif e.kind in ("join", "leave"):
            member[e.learner] = e.kind == "join"
        nxt = sched.events[k + 1].time if k + 1 < len(sched.events) else 3600.0
        probe = (e.time + nxt) / 2  # strictly between this event and the next one
        if probe > e.time:
            for i in range(4):
                assert sched.is_up(i, probe) == (member[i] and not crashed[i]), (i, probe)


def test_random_crash_count_matches_superposed_rate():
    spec = FaultSpec(seed=3, chip_mtbf_hours=1000.0, chips_per_learner=500, restart_delay_s=0.0)
    horizon = 10 * 3600.0
    n = sum(e.kind == "crash" for e in FaultSchedule(spec, 8, horizon).events)
    expected = 8 * 500 / 1000.0 * 10  # learners * chips / MTBF(h) * hours = 40
    assert abs(n - expected) < 5 * math.sqrt(expected)


def test_membership_windows_and_crashes_only_hit_members():
    spec = FaultSpec(
        seed=1, chip_mtbf_hours=0.05, membership=((2, 100.0, 200.0), (2, 300.0, 400.0))
    )
    sched = FaultSchedule(spec, 3, 500.0)
    assert [
        (e.time, e.kind) for e in sched.events if e.learner == 2 and e.kind in ("join", "leave")
    ] == [
        (100.0, "join"),
        (200.0, "leave"),
        (300.0, "join"),
        (400.0, "leave"),
    ]
    assert not sched.is_member(2, 50.0) and sched.is_member(2, 150.0)
    assert not sched.is_member(2, 250.0) and not sched.is_up(2, 450.0)
    assert all(sched.is_member(e.learner, e.time) for e in sched.events if e.kind == "crash")
    assert sched.is_member(0, 0.0) and sched.is_member(0, 499.0)


def test_slow_fraction_applies_to_the_last_learners():
    sched = FaultSchedule(FaultSpec(slow_fraction=0.5, slow_factor=1.18), 4, 100.0)
    assert [sched.step_time_factor(i, 3, 1.0) for i in range(4)] == [1.0, 1.0, 1.18, 1.18]
    sched = FaultSchedule(FaultSpec(speed_factors=(1.0, 2.0, 1.5)), 3, 100.0)
    assert [sched.step_time_factor(i, 0, 0.0) for i in range(3)] == [1.0, 2.0, 1.5]


def test_noise_is_a_function_of_learner_and_step_only():
    spec = FaultSpec(seed=5, speed_noise=0.1)
    a, b = FaultSchedule(spec, 3, 100.0), FaultSchedule(spec, 3, 100.0)
    assert a.step_time_factor(1, 17, 0.0) == b.step_time_factor(1, 17, 99.0)
    assert a.step_time_factor(1, 17, 0.0) != a.step_time_factor(1, 18, 0.0)
    assert a.step_time_factor(1, 17, 0.0) != a.step_time_factor(2, 17, 0.0)
    other = FaultSchedule(FaultSpec(seed=6, speed_noise=0.1), 3, 100.0)
    assert a.step_time_factor(1, 17, 0.0) != other.step_time_factor(1, 17, 0.0)
    f = a.step_time_factors(np.arange(20000), np.zeros(20000))
    assert f.shape == (3, 20000)
    assert abs(f.mean() - 1.0) < 0.005 and abs(np.log(f).std() - 0.1) < 0.005
    assert f[2, 123] == pytest.approx(a.step_time_factor(2, 123, 0.0))


def _emulated_slowdown(spec, learner, steps, seconds=0.1):
    """Mean emulated step time / compute over `steps` steps slept by a `SlowdownDebt`."""
    sched, debt = FaultSchedule(spec, 2, 100.0), SlowdownDebt()
    slept = sum(debt.owed(*sched.step_time_parts(learner, i, 0.0), seconds) for i in steps)
    return 1.0 + slept / (len(steps) * seconds)


def test_emulated_noise_keeps_its_mean_and_a_slow_chip_its_factor():
    # A step cannot run faster than its compute: sleeping only the draws above one would
    # make mean-one noise of std 0.1 a 4% slowdown. The balance repays fast draws.
    steps = range(1, 20001)
    noisy = FaultSpec(seed=3, speed_noise=0.1)
    assert abs(_emulated_slowdown(noisy, 0, steps) - 1.0) < 0.01
    slow = FaultSpec(seed=3, speed_noise=0.1, speed_factors=(1.0, 1.18))
    assert _emulated_slowdown(slow, 1, steps) == pytest.approx(1.18, abs=0.01)
    assert _emulated_slowdown(FaultSpec(speed_factors=(1.0, 1.5)), 1, steps) == pytest.approx(1.5)


def test_noise_credit_never_shortens_a_slowdown_episode():
    debt = SlowdownDebt()
    for _ in range(50):  # lucky steps earn credit
        assert debt.owed(1.0, 0.8, 1.0) == 0.0
    assert debt.owed(3.0, 1.0, 1.0) == pytest.approx(2.0)  # an episode is slept in full
    assert debt.owed(1.0, 1.5, 1.0) == 0.0  # a slow draw is paid from the credit
    assert debt.owed(1.0, 1.0, float("nan")) == 0.0


def test_straggler_episodes_multiply_the_step_time():
    spec = FaultSpec(
        seed=2, straggler_rate_per_hour=20.0, straggler_duration_s=30.0, straggler_slowdown=3.0
    )
    sched = FaultSchedule(spec, 2, 3600.0)
    starts = [e for e in sched.events if e.kind == "straggle_start"]
    assert starts and all(e.factor == 3.0 for e in starts)
    e = starts[0]
    assert sched.step_time_factor(e.learner, 0, e.time + 1.0) == 3.0
    assert sched.step_time_factor(e.learner, 0, e.time - 1e-3) == 1.0


def test_link_and_transfer_seconds():
    spec = FaultSpec(link_latency_s=(0.1, 0.0), link_bandwidth_bps=(1e6, 0.0))
    sched = FaultSchedule(spec, 2, 10.0)
    assert sched.link(0) == (0.1, 1e6) and sched.link(1) == (0.0, math.inf)
    assert sched.transfer_seconds(0, 125_000) == pytest.approx(0.1 + 1.0)  # 1 Mbit at 1 Mbit/s
    assert sched.transfer_seconds(1, 10**9) == 0.0
    assert FaultSchedule(FaultSpec(), 2, 10.0).transfer_seconds(0, 10**6) == 0.0


def test_syncer_crashes_and_events_between():
    sched = FaultSchedule(
        FaultSpec(syncer_crashes=(10.0, 12.0, 40.0), syncer_restart_delay_s=5.0), 1, 100.0
    )
    assert [(e.time, e.kind, e.learner) for e in sched.events] == [
        (10.0, "syncer_crash", -1),
        (15.0, "syncer_restart", -1),
        (40.0, "syncer_crash", -1),
        (45.0, "syncer_restart", -1),
    ]
    assert not sched.syncer_up(12.0) and sched.syncer_up(15.0) and sched.syncer_up(39.9)
    assert [e.time for e in sched.events_between(15.0, 40.0)] == [15.0]


def test_fault_spec_from_dict_round_trip_and_unknown_key():
    spec = fault_spec_from_dict({"seed": 3, "crashes": [[0, 1.5]], "membership": [[1, 0, 9]]})
    assert spec.crashes == ((0, 1.5),) and spec.membership == ((1, 0, 9),)
    with pytest.raises(ValueError, match="faults.bogus"):
        fault_spec_from_dict({"bogus": 1})


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"crashes": ((5, 1.0),)}, "faults.crashes"),
        ({"crashes": ((0, -1.0),)}, "faults.crashes"),
        ({"chip_mtbf_hours": -1.0}, "faults.chip_mtbf_hours"),
        ({"chips_per_learner": 0}, "faults.chips_per_learner"),
        ({"restart_delay_s": -2.0}, "faults.restart_delay_s"),
        ({"straggler_duration_s": 0.0}, "faults.straggler_duration_s"),
        ({"straggler_slowdown": 0.5}, "faults.straggler_slowdown"),
        ({"speed_factors": (1.0,)}, "faults.speed_factors"),
        ({"speed_factors": (1.0, 1.0), "slow_fraction": 0.5}, "faults.speed_factors"),
        ({"slow_fraction": 1.5}, "faults.slow_fraction"),
        ({"slow_factor": 0.0}, "faults.slow_factor"),
        # a learner cannot run faster than its device: below 1 ran at 1
        ({"slow_fraction": 0.5, "slow_factor": 0.5}, r"faults.slow_factor must be >= 1"),
        ({"speed_factors": (0.25, 1.0)}, r"faults.speed_factors must all be >= 1"),
        ({"speed_noise": -0.1}, "faults.speed_noise"),
        ({"link_latency_s": (0.1, 0.1, 0.1)}, "faults.link_latency_s"),
        # the field at fault first (the two were named together, latency first), and a list
        # beside a tuple (a spec built in Python) was a TypeError
        ({"link_bandwidth_bps": (-1.0, 1.0)}, "^faults.link_bandwidth_bps values must be >= 0"),
        (
            {"link_latency_s": [0.1, 0.2], "link_bandwidth_bps": (1e6, -1.0)},
            "^faults.link_bandwidth_bps values must be >= 0, got -1.0",
        ),
        ({"link_latency_s": [0.1, -0.2]}, "^faults.link_latency_s values must be >= 0, got -0.2"),
        ({"membership": ((0, 5.0, 5.0),)}, "faults.membership"),
        ({"membership": ((9, 0.0, 5.0),)}, "faults.membership"),
        ({"syncer_crashes": (-1.0,)}, "faults.syncer_crashes"),
        # malformed: a flat pair, a string among numbers, a bool learner, a restart never due
        ({"crashes": (0, 5)}, "faults.crashes entries must be"),
        ({"crashes": ((0, "5"),)}, "faults.crashes entries must hold numbers"),
        ({"crashes": ((True, 5.0),)}, "faults.crashes entries must hold numbers"),
        ({"crashes": ((0.0, 5.0),)}, "faults.crashes names learner 0.0"),
        ({"membership": (1, 5, 30)}, "faults.membership entries must be"),
        ({"membership": "[[0, 0, inf]]"}, "faults.membership must be a Python literal"),
        ({"speed_factors": (1.0, "x")}, "faults.speed_factors must be a list of numbers"),
        ({"syncer_crashes": 5.0}, "faults.syncer_crashes must be a list of numbers"),
        ({"restart_delay_s": "1"}, "faults.restart_delay_s must be a number"),
        ({"syncer_restart_delay_s": float("inf")}, "faults.syncer_restart_delay_s must be finite"),
        ({"restart_delay_s": float("nan")}, "faults.restart_delay_s must be finite"),
        # infinities would hang (rates), kill a link thread (latency) or pass as no-ops
        ({"link_latency_s": (0.1, float("inf"))}, "faults.link_latency_s must be finite"),
        ({"link_bandwidth_bps": (float("inf"), 1.0)}, "faults.link_bandwidth_bps must be finite"),
        ({"straggler_rate_per_hour": float("inf")}, "faults.straggler_rate_per_hour must be"),
        ({"chip_mtbf_hours": float("inf")}, "faults.chip_mtbf_hours must be finite"),
        ({"straggler_slowdown": float("inf")}, "faults.straggler_slowdown must be finite"),
        ({"speed_noise": float("nan")}, "faults.speed_noise must be finite"),
        ({"crashes": ((0, float("inf")),)}, "faults.crashes must be finite"),
        ({"membership": ((0, float("nan"), 5.0),)}, "faults.membership must be finite"),
        # finite, but no run lives through them (a sleep overflowed, killing a thread)
        ({"speed_factors": (1.0, 1e300)}, "faults.speed_factors must be at most"),
        ({"slow_fraction": 0.5, "slow_factor": 1e5}, "faults.slow_factor must be at most"),
        ({"straggler_slowdown": 1e9}, "faults.straggler_slowdown must be at most"),
        ({"speed_noise": 50.0}, "faults.speed_noise must be at most"),
        ({"link_latency_s": (0.0, 1e300)}, "faults.link_latency_s must be at most"),
        ({"restart_delay_s": 1e9}, "faults.restart_delay_s must be at most"),
        ({"straggler_duration_s": 1e12}, "faults.straggler_duration_s must be at most"),
        ({"link_bandwidth_bps": (0.0, 1e-300)}, "faults.link_bandwidth_bps must be 0"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        validate_fault_spec(FaultSpec(**kwargs), 2)


def test_link_lists_may_be_python_lists():
    """A spec built in Python may hold lists where a config holds tuples: the check of the
    link values added the two fields together, a TypeError for a list beside a tuple."""
    spec = FaultSpec(link_latency_s=[0.5, 0.0], link_bandwidth_bps=(8e3, 0.0))
    validate_fault_spec(spec, 2)
    sched = FaultSchedule(spec, 2, 100.0)
    assert sched.transfer_seconds(0, 1000) == pytest.approx(0.5 + 1.0)
    assert sched.transfer_seconds(1, 1000) == 0.0


def test_a_membership_window_may_stay_open():
    """A learner that joins at 30 s and stays: its window's leave is infinite."""
    schedule = FaultSchedule(FaultSpec(membership=((1, 30.0, float("inf")),)), 2, 1e6)
    assert not schedule.is_member(1, 10.0) and schedule.is_member(1, 9e5)
    assert [e.kind for e in schedule.events] == ["join"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"chip_mtbf_hours": 1e-6, "chips_per_learner": 64}, "faults.chip_mtbf_hours"),
        ({"straggler_rate_per_hour": 1e9}, "faults.straggler_rate_per_hour"),
    ],
)
def test_rates_that_would_flood_the_timeline_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field + r" .*events over the 168 h fault timeline"):
        FaultSchedule(FaultSpec(**kwargs), 4, HORIZON_S)


def test_late_joiners_of_a_step_schedule_take_random_crashes_once_they_join():
    """Chip failures hit a learner that joins at a step once it is a member, not before;
    they used to be dropped for good because its join time was unknown when drawn."""
    spec = FaultSpec(unit="steps", chip_mtbf_hours=0.05, restart_delay_s=1.0,
                     membership=((1, 10, 1000),))  # fmt: skip
    schedule = FaultSchedule(spec, 2, 3600.0)

    def crashes(s, m):
        return [e.time for e in s.events if e.kind == "crash" and e.learner == m]

    assert crashes(schedule, 0) and not crashes(schedule, 1)
    schedule.run_reached(10, 600.0)  # the run's lead step reaches the join at t = 600 s
    late = crashes(schedule, 1)
    assert late and min(late) >= 600.0
    assert not schedule.is_up(1, late[0]) and schedule.is_up(1, late[0] + 1.0)
    # The same chips' clocks as a seconds schedule whose window opens at 600 s.
    window = ((1, 600.0, 1e6),)
    seconds = FaultSchedule(dataclasses.replace(spec, unit="seconds", membership=window), 2, 3600.0)
    assert late == crashes(seconds, 1)


def test_validation_of_learners_and_horizon():
    with pytest.raises(ValueError, match="num_learners"):
        FaultSchedule(FaultSpec(), 0, 10.0)
    with pytest.raises(ValueError, match="horizon_s"):
        FaultSchedule(FaultSpec(), 2, 0.0)


def test_short_horizon_timeline_is_a_prefix_of_a_long_one():
    """Runs draw their schedule far ahead; a simulation of the first hour must agree."""
    short = FaultSchedule(BUSY, 4, 3600.0)
    long = FaultSchedule(BUSY, 4, 10 * 3600.0)
    assert short.events == long.events_between(0.0, 3600.0)


def test_an_offset_schedule_is_the_same_timeline_read_from_where_a_resume_starts():
    """A resumed attempt's schedule (offset o) answers at its time t what the run's answers at
    o + t: nothing before o comes back, an outage straddling o goes on, later events move."""
    o = 1000.0
    run, resumed = FaultSchedule(BUSY, 4, 3600.0), FaultSchedule(BUSY, 4, 3600.0, offset_s=o)
    later = run.events_between(o, 3600.0)
    assert later and resumed.events_between(0.0, 3600.0 - o) == [
        e._replace(time=e.time - o) for e in later
    ]
    before = resumed.events_between(-o, 0.0)  # the first attempt's: never asked for from 0 on
    assert before and [e.time + o for e in before] == [e.time for e in run.events_between(0.0, o)]
    probes = np.linspace(0.0, 2600.0, 1301)
    for t in probes:
        for m in range(4):
            assert resumed.is_up(m, t) == run.is_up(m, t + o)
            assert resumed.straggle_factor(m, t) == run.straggle_factor(m, t + o)
            assert resumed.step_time_factor(m, 5, t) == run.step_time_factor(m, 5, t + o)
        assert resumed.syncer_up(t) == run.syncer_up(t + o)
    since = run.member_since(3, o)  # learner 3 joined at 600 s, before the resume
    assert since == 600.0 and resumed.member_since(3, 0.0) == since - o
    assert not resumed.joins_late(3) and run.joins_late(3)
    assert run.syncer_down_since(1501.0) - o == resumed.syncer_down_since(1501.0 - o)
    factors = resumed.step_time_factors(np.arange(5), probes[:5])
    assert np.array_equal(factors, run.step_time_factors(np.arange(5), probes[:5] + o))
    with pytest.raises(ValueError, match="offset_s"):
        FaultSchedule(BUSY, 4, 3600.0, offset_s=-1.0)


def test_an_offset_step_schedule_places_its_faults_at_the_run_time_they_happen():
    spec = FaultSpec(unit="steps", crashes=((1, 3),), syncer_crashes=(4,),
                     membership=((2, 5, 9),), restart_delay_s=2.0,
                     syncer_restart_delay_s=5.0)  # fmt: skip
    sched = FaultSchedule(spec, 3, 3600.0, offset_s=500.0)
    assert sched.joins_late(2) and not sched.joins_late(1)
    for step in range(5):  # (the first step reported: where the attempt began)
        sched.run_reached(step, 2.0 * step)
    assert not any(sched.learner_reached(1, step, 2.0 * step) for step in range(3))
    assert sched.learner_reached(1, 3, 10.0)
    assert not sched.is_up(1, 11.0) and sched.is_up(1, 12.5)
    assert sched.down[1] == [(510.0, 512.0)]  # run time
    sched.run_reached(5, 20.0)
    assert not sched.syncer_up(9.0) and sched.syncer_down_since(9.0) == 8.0
    assert sched.is_member(2, 20.0) and sched.member_since(2, 30.0) == 20.0
    assert [(e.time, e.kind) for e in sched.events_between(0.0, 100.0)] == [
        (8.0, "syncer_crash"), (10.0, "crash"), (12.0, "restart"), (13.0, "syncer_restart"),
        (20.0, "join"),
    ]  # fmt: skip


def test_a_frozen_schedule_begins_no_fault_and_lets_outages_under_way_end():
    """After `freeze(t)` (an attempt that stopped training) no crash or syncer outage begins,
    those under way end as scheduled, and the run's clock stays at t for the next attempt."""
    spec = FaultSpec(crashes=((0, 10.0), (1, 30.0)), restart_delay_s=15.0,
                     syncer_crashes=(12.0, 40.0), syncer_restart_delay_s=5.0)  # fmt: skip
    sched = FaultSchedule(spec, 2, 3600.0, offset_s=100.0)  # attempt time = run time - 100
    crashes = FaultSchedule(spec, 2, 3600.0)  # the same, never frozen
    sched.freeze(-80.0)  # run time 20: learner 0 down since 10, the syncer back at 17
    assert sched.frozen_at == -80.0 and sched.run_time(-50.0) == 20.0 == sched.run_time(5.0)
    assert not sched.is_up(0, -78.0) and sched.down_since(0, -78.0) == -90.0
    assert sched.is_up(0, -74.0)  # back at 25, as scheduled
    assert sched.is_up(1, -65.0) and not crashes.is_up(1, 35.0)  # its crash at 30: held back
    assert sched.syncer_up(-60.0) and not crashes.syncer_up(41.0)  # the outage at 40 too
    kinds = [(e.time, e.kind) for e in sched.events_between(-100.0, 0.0)]
    assert (-70.0, "crash") not in kinds and (-60.0, "syncer_crash") not in kinds
    assert (-90.0, "crash") in kinds and (-75.0, "restart") in kinds
    sched.freeze(-40.0)  # the first freeze holds
    assert sched.frozen_at == -80.0
    assert FaultSchedule(spec, 2, 3600.0).frozen_at is None
