"""The simulator in FaultSpec mode agrees with the schedule a real run replays
(`FaultSchedule.is_up`, its down intervals and membership windows)."""

import pytest
from test_simulator import CPU  # the toy CPU run's timings

from decoupled_diloco.faults import FaultSpec
from decoupled_diloco.simulator import simulate


@pytest.mark.parametrize("method", ["dp", "elastic_dp", "decoupled"])
@pytest.mark.parametrize(
    "tied",
    [
        # a second crash at the instant the first outage ends (the schedule: down to 140)
        lambda dt: FaultSpec(crashes=((0, 100.0), (0, 120.0 + dt)), restart_delay_s=20.0),
        # a crash at the instant the learner's membership begins
        lambda dt: FaultSpec(
            crashes=((0, 100.0 + dt),), membership=((0, 100.0, float("inf")),), restart_delay_s=20.0
        ),
        # zero restart delay: each crash's restart at its own instant, after it
        lambda dt: FaultSpec(crashes=((0, 100.0), (0, 100.0 + dt)), restart_delay_s=0.0),
    ],
    ids=["crash_at_restart", "crash_at_join", "zero_delay_twice"],
)
def test_a_crash_at_a_tied_instant_counts_as_one_a_microsecond_later(method, tied):
    """Events at one instant used the schedule's order (crash before restart and join): the
    crash hit a learner not yet back in service and was dropped, while the run keeps it
    down (a review found the learner running through the schedule's second outage)."""
    at, later = (simulate(method, 2, 2, CPU, tied(dt)) for dt in (0.0, 1e-6))
    assert at.failures == later.failures
    assert at.goodput == pytest.approx(later.goodput, abs=1e-8)
    assert at.uptime == pytest.approx(later.uptime, abs=1e-8)
    assert at.recoveries == later.recoveries


def test_a_learner_that_rejoins_in_the_middle_of_its_outage_is_back_at_its_restart():
    """Learner 0 crashes at 100 s (back at 120), leaves at 105 and joins again at 110: the
    schedule has it down until 120, but the simulator took the join for its return and ran
    it from 110 on (a review found it computing while `is_up` is False)."""
    gap = FaultSpec(
        crashes=((0, 100.0),), restart_delay_s=20.0, membership=((0, 0.0, 105.0), (0, 110.0, 1e400))
    )
    stays = FaultSpec(crashes=((0, 100.0),), restart_delay_s=20.0)
    # A learner's timeline is that of one that never left (back at 120 + restore); only
    # the allocation, 5 s short, differs.
    useful = [
        simulate("decoupled", 2, 2, CPU, s).goodput * a for s, a in ((gap, 1995), (stays, 2000))
    ]
    assert useful[0] == pytest.approx(useful[1])
    # DP: down from the crash to the relaunch without learner 0 (105 + restore), then
    # from its join to its restart + restore.
    assert simulate("dp", 2, 2, CPU, gap).downtime_seconds == pytest.approx(10.0 + 15.0)
    # Elastic DP: 2 chips to 100 (its in-flight step lost), 1 after the pause, 2 again from
    # the ski-rental re-add of learner 0 at 120 + reconfig_s.
    useful = 2 * 100.0 - 2 * (100.0 % 3.0) + (122.0 - 102.0) + 2 * (1000.0 - 124.0)
    assert simulate("elastic_dp", 2, 2, CPU, gap).goodput == pytest.approx(useful / 1995.0)
