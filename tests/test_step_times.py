"""A learner's step clock (runtime/step_times.py) and its save spacing
(runtime/save_schedule.py), outside any run."""

import time

from decoupled_diloco.runtime.save_schedule import SaveSchedule
from decoupled_diloco.runtime.step_times import StepTimes


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_steps_waits_for_the_device_and_merges_are_not_host_work():
    """A step of 50 ms reading the device, 50 ms blocked on a merge and 50 ms of host work,
    with a 150 ms evaluation beside: a third of its time on the host, all of that on a CPU;
    its compute time leaves the merge wait and the evaluation out."""
    times = StepTimes()
    times.begin()
    with times.reading_device():
        time.sleep(0.05)
    t0 = time.perf_counter()
    time.sleep(0.05)
    times.merge_wait += time.perf_counter() - t0
    _busy(0.05)
    loss, seconds = times.time_evaluation(lambda: time.sleep(0.15) or 1.5)
    assert loss == 1.5 and seconds >= 0.15
    assert 0.05 <= times.end() < 0.2  # the device wait of this step
    assert 0.09 < times.compute_seconds() < 0.3  # device wait and host work
    # (a loaded machine stretches the waits and the busy part alike; left out, the device
    # wait would read 0.67, the merge wait 0.67, and the evaluation counted 0.67)
    shares = times.shares()
    assert 0.15 < shares["host_share"] < 0.55, shares
    assert 0.1 < shares["host_cpu_share"] < 0.45, shares
    assert shares["data_share"] == 0.0
    assert times.shares() == {}  # counted anew from each row


def test_a_wait_for_the_protocols_background_compile_is_not_host_work():
    """A step that waits 100 ms for its fragment ops' compile (`Replica.compile_waited`) and
    works 50 ms: the wait reads as a wait, not as host work (rows at start-up read
    host_share 0.98-0.99 with host_cpu_share 0.001-0.004: a host-bound learner)."""
    waited = [0.0]
    times = StepTimes(lambda: waited[0])
    times.begin()
    time.sleep(0.1)
    waited[0] += 0.1  # what the replica counted of that sleep
    _busy(0.05)
    times.end()
    shares = times.shares()
    assert 0.15 < shares["host_share"] < 0.55, shares  # about a third, not all


def test_a_steps_wait_for_its_data_is_not_compute():
    """A step that waits 100 ms for its batch and works 50 ms: its compute time (what
    goodput counts as useful) leaves the data wait out; the row shows it as data_share."""

    def batches():
        while True:
            time.sleep(0.1)
            yield "batch"

    times, data = StepTimes(), batches()
    times.begin()
    assert times.reading_data(data) == "batch"
    _busy(0.05)
    times.end()
    assert 0.04 < times.compute_seconds() < 0.1  # the data wait would make it >= 0.15
    assert times.data_wait >= 0.1
    shares = times.shares()
    assert 0.5 < shares["data_share"] <= shares["host_share"], shares


def test_saves_are_spaced_to_their_duty_from_the_third_on():
    """duty 0.5: a save of s seconds is followed by s of steps. The first save (the
    checkpointer's set-up) sets no gap; from the second on the shorter of the last two
    does, in steps at the step time between them; a save falling due inside the gap waits
    for its end."""
    saves = SaveSchedule(every=1, duty=0.5)
    assert saves.due(1)
    saves.saved(1, start=0.0, end=1.0)  # slow first save
    assert saves.due(2)
    saves.saved(2, start=1.25, end=1.75)  # one step of 0.25 s since the last; 0.5 s save
    assert [saves.due(s) for s in (3, 4)] == [False, True]  # 0.5 s of steps = 2 steps


def test_without_a_duty_every_due_save_is_taken_at_its_step():
    saves = SaveSchedule(every=3, duty=1.0)
    due = []
    for step in range(1, 10):
        if saves.due(step):
            due.append(step)
            saves.saved(step, start=float(step), end=step + 100.0)  # however long
    assert due == [3, 6, 9]


def test_a_save_due_inside_the_gap_is_taken_at_its_end():
    saves = SaveSchedule(every=5, duty=0.5)
    saves.saved(1, start=0.0, end=1.0)
    saves.saved(2, start=1.25, end=2.25)  # 1 s save at 0.25 s per step: 4 steps, to 6
    assert [saves.due(s) for s in (5, 6)] == [False, True]  # the save due at 5 waits for 6
