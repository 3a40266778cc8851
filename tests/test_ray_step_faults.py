"""The Ray driver applies a step schedule's crashes at the steps it polls
(runtime/ray/runtime.py); a learner's first poll may already be many steps past its start."""

import pytest

from decoupled_diloco import faults

pytest.importorskip("ray")

from decoupled_diloco.runtime.ray.runtime import RayRuntime  # noqa: E402


def _driver(spec: faults.FaultSpec, checked: dict | None = None) -> RayRuntime:
    """The driver's state `_learner_started` and `_apply_faults` read, without a cluster."""
    rt = object.__new__(RayRuntime)
    rt._started, rt._earlier_rows = {}, False
    rt.schedule = faults.FaultSchedule(spec, 2, horizon_s=3600.0, steps_checked=checked)
    rt.now = lambda: 10.0
    return rt


def _crashes(rt: RayRuntime) -> list:
    return [(e.kind, e.learner) for e in rt.schedule.events_between(0.0, 1e9)]


@pytest.mark.parametrize("checked", [None, {"learners": [-1, -1], "lead": -1}])
def test_a_crash_scheduled_before_the_first_poll_fires_at_it(checked):
    """Learner 0 started at step 0, crash at step 5, first polled at step 20: the crash
    fires then (it was dropped as passed before a fresh run's first poll)."""
    rt = _driver(faults.FaultSpec(unit="steps", crashes=((0, 5),), restart_delay_s=1.0), checked)
    rt._learner_started(0, 0)
    assert rt.schedule.learner_reached(0, 20, rt.now())
    assert ("crash", 0) in _crashes(rt)


def test_a_resumed_learner_does_not_replay_the_crashes_before_its_start():
    """Started at step 30 (its checkpoint's) in a resumed run: the crash at step 5 happened
    in an earlier attempt and does not fire again; the one at 35 fires when polled past it."""
    spec = faults.FaultSpec(unit="steps", crashes=((0, 5), (0, 35)), restart_delay_s=1.0)
    rt = _driver(spec, {"learners": [30, 30], "lead": 30})
    rt._learner_started(0, 30)
    assert _crashes(rt) == []
    assert rt.schedule.learner_reached(0, 40, rt.now())
    assert [c for c in _crashes(rt) if c[0] == "crash"] == [("crash", 0)]
