"""Goodput's allocation follows the membership: time a learner is out of it (scavenged
capacity given back, between a leave and its next window) is not the job's."""

from decoupled_diloco.runtime import accounting
from decoupled_diloco.runtime.records import RunLog


def _steps(log: RunLog, m: int, first: int, last: int, at: float) -> float:
    """Steps first..last of learner m, one second each from `at`; returns when they end."""
    for _ in range(first, last + 1):
        at += 1.0
        log.step(m, 1.0, at)
    return at


def _merge(log: RunLog, steps: list[int], at: float) -> None:
    """A merge of one fragment holding the whole model, of `steps` steps of each learner."""
    log.record({"event": "merge", "fragment": 0, "version": 1, "time": at, "share": 1.0,
                "learners": [0, 1], "c_steps": steps, "steps": steps})  # fmt: skip


def test_a_learner_out_of_the_membership_is_not_allocated(tmp_path):
    log = RunLog(str(tmp_path), accounting.Ledger(2, sync_every=4, fragments=1))
    end = _steps(log, 0, 1, 20, 0.0)
    # Learner 1 trains 10 steps, leaves for 30 s, its window reopens, it trains 10 more.
    t = _steps(log, 1, 1, 10, 0.0)  # (steps at 1..10 s)
    log.event({"event": "learner_leave", "learner": 1, "step": 10, "time": t})
    log.event({"event": "member_join", "learner": 1, "step": 10, "time": t + 30.5,
               "window_opened": t + 30.0})  # fmt: skip
    t = _steps(log, 1, 11, 20, t + 30.0)
    _merge(log, [20, 20], max(t, end))
    log.ledger.finish(0, end)
    log.ledger.finish(1, t)
    out = log.ledger.summary(max(t, end), True, [20, 20])
    log.close()
    # Every step merged, and each allocated second stepped: 40 s of compute in 40 s.
    assert out["goodput"] == 1.0, out["goodput"]


def test_a_learner_out_of_the_membership_at_the_end_is_allocated_until_it_left(tmp_path):
    log = RunLog(str(tmp_path), accounting.Ledger(2, sync_every=4, fragments=1))
    end = _steps(log, 0, 1, 20, 0.0)
    t = _steps(log, 1, 1, 10, 0.0)
    log.event({"event": "learner_leave", "learner": 1, "step": 10, "time": t})
    # The run ends while it waits for a window that the step budget never reaches.
    _merge(log, [20, 10], end)
    log.ledger.finish(0, end)
    log.ledger.finish(1, end)
    out = log.ledger.summary(end, True, [20, 10])
    log.close()
    # learner 0: 20 useful of 20 s; learner 1: 10 useful of 10 s (not of 20 s).
    assert out["goodput"] == 1.0, out["goodput"]


def test_a_late_joiners_first_join_changes_no_allocation(tmp_path):
    log = RunLog(str(tmp_path), accounting.Ledger(2, sync_every=4, fragments=1))
    end = _steps(log, 0, 1, 20, 0.0)
    log.event({"event": "member_join", "learner": 1, "step": 0, "time": 10.0,
               "window_opened": 9.0})  # fmt: skip
    t = _steps(log, 1, 1, 10, 10.0)
    _merge(log, [20, 5], end)
    log.ledger.finish(0, end)
    log.ledger.finish(1, t)
    out = log.ledger.summary(end, True, [20, 10])
    log.close()
    # 25 useful step-seconds of 30 allocated: half of learner 1's steps did not merge.
    assert abs(out["goodput"] - 25 / 30) < 1e-9, out["goodput"]
