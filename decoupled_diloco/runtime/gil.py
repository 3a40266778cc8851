"""Python's thread switch interval for a run's threads (config key `gil_switch_ms`).

The local runtime runs every learner, its outbox and merge stager, the syncer and its merge
threads in one interpreter. The syncer's host math is numpy, which lets go of the
interpreter lock inside every call and must take it back after each one: a merge of a `mid`
fragment makes a few hundred such calls. A thread waiting for the lock only asks its holder
to let go after the switch interval (Python's default 5 ms), so while learner threads run
Python (dispatching steps, bookkeeping) each of those calls can wait up to that long. On
one H100 host with four `mid` learners a merge took 123 ms that takes 15 ms alone
(experiments/results/quality_targets_mid_h100/); a merge beside four threads that hold the
lock in 0.5 ms bursts reproduces it on a CPU (79-127 ms), and a 0.2 ms interval merged
1.3-2x faster there (experiments/results/merge_gil/). A shorter interval costs the busy
threads only a few more hand-overs per millisecond.
"""

import bisect
import contextlib
import sys
import threading
import time

import numpy as np

_lock = threading.Lock()
_active = 0  # runs inside `switch_interval` now
_python_s = None  # the interval the first of them found, given back by the last


def set_switch_interval(ms: float) -> None:
    """Sets the interval for this process (an actor's own); 0 leaves it as it is."""
    if ms > 0:
        sys.setswitchinterval(ms / 1e3)


@contextlib.contextmanager
def switch_interval(ms: float):
    """The interval while the block runs (a run in a process that outlives it); 0 leaves
    it as it is. Blocks may overlap (runs on threads of one process): the last one set
    holds while several run, and the last to end gives back what the first found."""
    global _active, _python_s
    with _lock:
        if _active == 0:
            _python_s = sys.getswitchinterval()
        _active += 1
        set_switch_interval(ms)
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                sys.setswitchinterval(max(_python_s, 1e-6))


class LockProbe:
    """How long this process's threads wait to run Python again: a thread that sleeps
    `period_s` at a time (letting go of the interpreter lock) and records how much later
    than asked it is running again, i.e. woken and holding the lock. On an idle process the
    lateness is the OS's timer slack (~0.1 ms); threads that hold the lock add their bursts,
    up to the switch interval each, and a host short of cores adds its run queue.

    `start()` ... `stop()` (or a `with` block), then `summary()`: mean and p99 lateness in
    ms. Memory stays fixed however long it runs: a histogram of 1000 log-spaced bins from
    1 µs to 10 s (each ~1.6% wide) gives the p99."""

    EDGES = np.geomspace(1e-6, 10.0, 1001)  # seconds

    def __init__(self, period_s: float = 0.005):
        self.period_s = period_s
        self.counts = np.zeros(len(self.EDGES) + 1, np.int64)  # [< 1 µs, bins..., >= 10 s]
        self.total_s, self.samples = 0.0, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        edges = self.EDGES.tolist()
        while not self._stop.is_set():
            start = time.perf_counter()
            time.sleep(self.period_s)
            late = max(time.perf_counter() - start - self.period_s, 0.0)
            self.counts[bisect.bisect_right(edges, late)] += 1
            self.total_s += late
            self.samples += 1

    def start(self) -> "LockProbe":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="lock_probe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "LockProbe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self) -> dict:
        """{"mean_ms", "p99_ms", "samples"}; the two times are None before any sample. The
        p99 is the upper edge of the bin holding it."""
        if not self.samples:
            return {"mean_ms": None, "p99_ms": None, "samples": 0}
        at = int(np.searchsorted(np.cumsum(self.counts), 0.99 * self.samples))
        upper = self.EDGES[min(at, len(self.EDGES) - 1)]
        return {"mean_ms": 1e3 * self.total_s / self.samples, "p99_ms": float(1e3 * upper),
                "samples": self.samples}  # fmt: skip
