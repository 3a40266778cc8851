"""Where a learner thread's step time goes, for its metrics rows.

A step's wall time less its evaluations (idle, not training) is what a row's shares divide:
the thread waited for late merges, and for the device in two ways: reading a step's metrics
(the device still computing it), and launching a program while the device's queue was full
(XLA:CPU holds at most 32 programs per device in flight; `fragment_ops.dispatch_waited`). The
rest it was busy on the host: `host_share` near 1 means the device idles between steps (a
host-bound learner). Of that, `data_share` is getting the step's batch (`reading_data`: its
read, or the wait for the prefetching thread): near host_share, a data-bound learner. The
step's time as the learner's ledger counts it (`compute_seconds`, what goodput calls useful
once merged) leaves the merge and data waits out: a learner starved of data is allocated
but not training.
"""

import contextlib
import time
from typing import NamedTuple

from decoupled_diloco.train.fragment_ops import dispatch_waited


class _Mark(NamedTuple):  # the clocks and totals at a step's start
    wall: float
    cpu: float
    merge_wait: float
    evaluation: float
    data_wait: float
    device_wait: float
    idle_cpu: float
    launch_wait: float
    compile_wait: float


class StepTimes:
    """One learner thread's clock: `begin()` and `end()` around each step (its metrics
    reads included), `reading_device()` and `time_evaluation(fn)` around the waits,
    `shares()` at each row."""

    def __init__(self, compile_waited=None):
        """`compile_waited()`: the thread's seconds so far waiting for its protocol ops'
        background compile (`Replica.compile_waited`), a wait as the device's is, not host
        work (a learner waiting on it read host_share 0.99 with host_cpu_share 0.004)."""
        self._compile_waited = compile_waited or (lambda: 0.0)
        self.merge_wait = 0.0  # seconds blocked on late merges, all told
        self.evaluation = 0.0  # seconds evaluating (data-parallel), all told
        self.data_wait = 0.0  # seconds reading or waiting for batches, all told
        self.device_wait = 0.0  # seconds waiting for the device in metrics reads, all told
        self.idle_cpu = 0.0  # CPU seconds spent in those waits and evaluations, all told
        # Since the previous row: the steps' wall seconds less evaluations, of those the
        # seconds waiting (for merges, for the device), and the thread's CPU seconds outside
        # its waits (`time.thread_time`).
        self._wall = self._blocked = self._cpu = self._data = 0.0
        self._mark: _Mark | None = None
        self._off = 0.0  # the current step's waits for merges and data, and evaluations

    def begin(self) -> None:
        totals = (self.merge_wait, self.evaluation, self.data_wait, self.device_wait,
                  self.idle_cpu)  # fmt: skip
        self._mark = _Mark(time.perf_counter(), time.thread_time(), *totals, dispatch_waited(),
                           self._compile_waited())  # fmt: skip
        self._off = 0.0

    def end(self) -> float:
        """Ends the step begun last, after its metrics reads: adds its times to the row's.
        Returns the seconds it waited for the device in metrics reads."""
        mark = self._mark
        evaluating, blocked = self.evaluation - mark.evaluation, self.merge_wait - mark.merge_wait
        device_wait = self.device_wait - mark.device_wait
        data = self.data_wait - mark.data_wait
        self._off = blocked + evaluating + data
        self._data += data
        self._wall += time.perf_counter() - mark.wall - evaluating
        self._blocked += blocked + device_wait + (dispatch_waited() - mark.launch_wait)
        self._blocked += self._compile_waited() - mark.compile_wait
        self._cpu += time.thread_time() - mark.cpu - (self.idle_cpu - mark.idle_cpu)
        return device_wait

    def compute_seconds(self) -> float:
        """The current step's seconds since `begin`, less its waits for merges and data, and
        its evaluations."""
        return time.perf_counter() - self._mark.wall - self._off

    @contextlib.contextmanager
    def reading_device(self):
        """Times a read of the device's results: the device was still busy with them."""
        t0, c0 = time.perf_counter(), time.thread_time()
        yield
        self.device_wait += time.perf_counter() - t0
        self.idle_cpu += time.thread_time() - c0  # a runtime may spin while it waits

    def reading_data(self, data):
        """`next(data)`, timed as the step's wait for its data."""
        t0 = time.perf_counter()
        try:
            return next(data)
        finally:
            self.data_wait += time.perf_counter() - t0

    def time_evaluation(self, fn):
        """`fn()` timed as an evaluation: (its result, seconds)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn()
        self.idle_cpu += time.thread_time() - c0
        seconds = time.perf_counter() - t0
        self.evaluation += seconds
        return out, seconds

    def shares(self) -> dict:
        """A row's shares of the steps since the previous row ({} without steps), and a new
        count from here."""
        out = {}
        if self._wall > 0:
            # Share of the steps' wall time this thread was busy on the host (data, the
            # protocol's boundary, dispatch, rows) instead of waiting for the device.
            out["host_share"] = round(min(max(1.0 - self._blocked / self._wall, 0.0), 1.0), 4)
            # Of that, the share it ran on a CPU: host_share - host_cpu_share is time it was
            # ready to run Python but did not (the interpreter lock other threads held,
            # other locks, the OS run queue), not its own work; and the device waits not
            # timed as such (a boundary finishing the device's steps before it waits for a
            # late merge: runs that wait for merges).
            out["host_cpu_share"] = round(min(max(self._cpu / self._wall, 0.0), 1.0), 4)
            # Of host_share, the share spent getting the steps' batches (reading them, or
            # waiting for the prefetching thread): near host_share, a data-bound learner.
            out["data_share"] = round(min(max(self._data / self._wall, 0.0), 1.0), 4)
        self._wall = self._blocked = self._cpu = self._data = 0.0
        return out
