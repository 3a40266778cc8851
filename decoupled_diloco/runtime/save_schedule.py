"""When a learner takes its periodic checkpoints (`train.checkpoint_every`,
`train.checkpoint_duty`).

A learner's save is synchronous (its device idles through it), so saves are spaced to take
at most `checkpoint_duty` of its time: a save of s seconds is followed by s·(1/duty − 1)
seconds of steps, counted in steps at the step time between the last two saves. A save falls
due every `checkpoint_every` steps and is taken at the first step at or after that gap.
"""

import collections
import math

import jax
import numpy as np
from jax.experimental import multihost_utils


class SaveSchedule:
    """`due(step)` once per step says whether to save after it; `saved(step, start, end)`
    after each save the step loop takes (periodic ones, a data-parallel learner's last)
    sets the gap to the next one."""

    def __init__(self, every: int, duty: float):
        self.every, self.duty = every, duty
        self._pending = False  # a periodic save fell due and waits for step `_at`
        self._at = 0
        self._seconds: collections.deque = collections.deque(maxlen=2)  # the last two saves
        self._last_end = (0.0, 0)  # (time, step) at the end of the last save

    def due(self, step: int) -> bool:
        """Whether this step saves a periodic checkpoint (called once per step)."""
        self._pending = self._pending or (bool(self.every) and step % self.every == 0)
        return self._pending and step >= self._at

    def saved(self, step: int, start: float, end: float) -> None:
        """A save after `step` ran from `start` to `end` (now, perf_counter seconds)."""
        self._pending = False
        self._at = step + self._gap_steps(step, start, end)

    def _gap_steps(self, step: int, start: float, end: float) -> int:
        """Steps to the next save. The save's seconds are the shorter of the last two (none
        before two: the first, with the checkpointer's set-up, would space out the rest).
        Host 0's count on every host of a multi-host learner, so that all of its hosts take
        the save, a collective, at the same step."""
        if self.duty >= 1:
            return 0
        self._seconds.append(end - start)
        (last_end, last_step), self._last_end = self._last_end, (end, step)
        gap = 0
        if len(self._seconds) == 2 and step > last_step and start > last_end:
            step_s = (start - last_end) / (step - last_step)
            gap = math.ceil(min(self._seconds) * (1.0 / self.duty - 1.0) / step_s)
        if jax.process_count() > 1:
            gap = int(multihost_utils.broadcast_one_to_all(np.int32(gap)))
        return gap
