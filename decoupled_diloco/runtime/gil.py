"""Python's thread switch interval for a run's threads (config key `gil_switch_ms`).

The local runtime runs every learner, its outbox and merge stager, the syncer and its merge
threads in one interpreter. The syncer's host math is numpy, which lets go of the
interpreter lock inside every call and must take it back after each one: a merge of a `mid`
fragment makes a few hundred such calls. A thread waiting for the lock only asks its holder
to let go after the switch interval (Python's default 5 ms), so while learner threads run
Python (dispatching steps, bookkeeping) each of those calls can wait up to that long. On
one H100 host with four `mid` learners a merge took 123 ms that takes 15 ms alone
(experiments/results/quality_targets_mid_h100/); a merge beside four threads that hold the
lock in 0.5 ms bursts reproduces it on a CPU, and a 0.2 ms interval merged ~3x faster there
(experiments/results/merge_gil/). A shorter interval costs the busy threads only a few
more hand-overs per millisecond.
"""

import contextlib
import sys


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
