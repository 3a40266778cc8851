"""Learners out of a Ray run for good, and the rule that stops one failing the same way.

Ray restarts a learner process that died, up to `ray.max_restarts` times (-1: forever, the
TPU configs' choice: Spot slices are preempted again and again). A learner whose code raises
the same exception every time it comes back (a missing package, a bad path, a corrupt
shard at a fixed step) would then restart forever, holding its slice and filling the log.
So the driver also counts a learner's *consecutive* failures with the same signature
(exception type and message, numbers and addresses normalised away): at
`ray.max_same_failures` it stops the learner (its processes are killed without restart),
reports `learner_stopped` with the error and a line on stderr, and tells the syncer shards
it left, so no round waits for it. A streak counts only raised errors (the learner's
`learner_error` events): a preemption or a scheduled crash kills the process without one.
It is broken by a different error, or by the learner training past the step where it last
failed: an error that strikes now and then, days apart, never adds up to a stop, while one
that comes back before the learner gets any further does.

The run goes on without a stopped learner, exactly as without a lost one (restarts
exhausted): Decoupled DiLoCo's merges need only the quorum's offers. It fails once every
learner is out (runtime.py).
"""

import dataclasses
import re
import sys

from decoupled_diloco.runtime import accounting
from decoupled_diloco.runtime.records import RunLog

_HEX = re.compile(r"0x[0-9a-fA-F]+")  # -> "@" (not a digit: numbers are replaced next)
_NUMBER = re.compile(r"\d+(\.\d+)?")
_SPACE = re.compile(r"\s+")
SIGNATURE_CHARS = 300  # a signature's length cap (a huge message is still one signature)


def signature(error: str) -> str:
    """`Type: message` with what changes from one occurrence to the next (numbers, addresses,
    whitespace) normalised: `ValueError: bad shard 17 at 0x7f3a` -> `ValueError: bad shard #
    at @`."""
    text = _HEX.sub("@", error.strip())
    text = _NUMBER.sub("#", text)
    return _SPACE.sub(" ", text)[:SIGNATURE_CHARS]


@dataclasses.dataclass
class Streak:
    signature: str
    count: int  # consecutive failures with this signature
    step: int  # the learner's step at the last of them


class RepeatedFailures:
    """The stopping rule, per learner: `limit` consecutive failures with one signature and
    no progress past the last failure's step (`limit` 0: never stop)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.streaks: dict[int, Streak] = {}

    def failed(self, m: int, error: str, step: int) -> bool:
        """Learner m raised `error` at `step`; True when it must be stopped."""
        sig = signature(error)
        s = self.streaks.get(m)
        if s is not None and s.signature == sig:
            s.count, s.step = s.count + 1, max(s.step, step)
        else:
            s = self.streaks[m] = Streak(sig, 1, step)
        return self.limit > 0 and s.count >= self.limit

    def progressed(self, m: int, step: int) -> None:
        """Learner m reports `step`: beyond its last failure's step, its streak is over."""
        s = self.streaks.get(m)
        if s is not None and step > s.step:
            del self.streaks[m]


class LearnerFates:
    """The driver's account of learners that are out of the run: `lost` (Ray gave up
    restarting them) or stopped here (`RepeatedFailures`); both are in `out`."""

    def __init__(self, num_learners: int, max_same_failures: int, max_restarts: int, log: RunLog):
        self.num_learners, self.max_restarts, self.log = num_learners, max_restarts, log
        self.repeats = RepeatedFailures(max_same_failures)
        self.out: set[int] = set()
        self.errors: dict[int, str] = {}  # learner -> its last error

    def error(self, m: int, error: str, step: int) -> bool:
        """Learner m raised; True when it must be stopped now."""
        self.errors[m] = error
        return m not in self.out and self.repeats.failed(m, error, step)

    def remove(self, m: int, step: int, now: float, stopped: bool, error: str = "") -> None:
        """Records that learner m is out for good at `step`: `stopped` by the repeated-failure
        rule, else lost (its restarts exhausted; `error` is Ray's when it raised none)."""
        if m in self.out:
            return
        self.out.add(m)
        ledger: accounting.Ledger = self.log.ledger
        if not ledger.is_down(m):  # died by itself: its last death is a failure too
            ledger.failure(m, now)
        ledger.finish(m, now)
        last = self.errors.get(m, error.strip().splitlines()[0][:300] if error else "")
        rec = {"learner": m, "step": step, "error": last, "time": now}
        if stopped:
            n = self.repeats.streaks[m].count
            self.log.event({"event": "learner_stopped", **rec, "failures": n})
            why = (
                f"failed {n} times in a row with the same error (ray.max_same_failures="
                f"{self.repeats.limit}); stopped, not restarted again"
            )
        else:
            self.log.event({"event": "learner_lost", **rec})
            why = f"lost for good (ray.max_restarts={self.max_restarts} exhausted)"
        print(
            f"learner {m} {why} at step {step}; last error: {last}; the run goes on with "
            f"{self.num_learners - len(self.out)} learners",
            file=sys.stderr,
            flush=True,
        )
