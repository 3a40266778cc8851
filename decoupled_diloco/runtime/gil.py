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

import contextlib
import sys
import threading
import time

import numpy as np


def set_switch_interval(ms: float) -> None:
    """Sets the interval for this process (an actor's own); 0 leaves Python's."""
    if ms > 0:
        sys.setswitchinterval(ms / 1e3)


@contextlib.contextmanager
def switch_interval(ms: float):
    """The interval while the block runs (a run in a process that outlives it); 0 leaves
    Python's. Restores the interval it found."""
    before = sys.getswitchinterval()
    set_switch_interval(ms)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class LockProbe:
    """How long this process's threads wait to run Python again: a thread that sleeps
    `period_s` at a time (letting go of the interpreter lock) and records how much later
    than asked it is running again, i.e. woken and holding the lock. On an idle process the
    lateness is the OS's timer slack (~0.1 ms); threads that hold the lock add their bursts,
    up to the switch interval each, and a host short of cores adds its run queue.

    Use as a context manager; `summary()` afterwards: mean and p99 lateness in ms."""

    def __init__(self, period_s: float = 0.005):
        self.period_s = period_s
        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            time.sleep(self.period_s)
            self.late.append(time.perf_counter() - start - self.period_s)

    def __enter__(self) -> "LockProbe":
        self._thread = threading.Thread(target=self._run, name="lock_probe", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict:
        """{"mean_ms", "p99_ms", "samples"} of the lateness (NaNs before any sample)."""
        late = np.asarray(self.late, np.float64) * 1e3
        if not late.size:
            return {"mean_ms": float("nan"), "p99_ms": float("nan"), "samples": 0}
        return {"mean_ms": float(late.mean()), "p99_ms": float(np.percentile(late, 99)),
                "samples": int(late.size)}  # fmt: skip
