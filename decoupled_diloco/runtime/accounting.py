"""Goodput accounting of real runs (the same quantities the simulator predicts).

goodput  = useful learner compute / allocated learner compute (from a learner's first step
           to its last, minus time it spends evaluating, which is not training; the tail
           after its last step, final offers and checkpoint, is not allocation), where a
           learner's step is useful once its work reached a merged global fragment (per
           fragment, weighted by the fragment's share of the parameters; a merge record's
           c_steps are the steps its offers brought, and each step travels in exactly one
           merged offer per fragment, see diloco/learner.py; work lost to a crash does not
           count); in a run without a syncer, steps that survive to
           the end (not lost to a restore) are useful.
uptime   = fraction of windows of `window` seconds, from the first advance of the global
           model to the last learner step, in which the global model advanced (a merge, or
           a DP step). The tail after training (final merges, checkpoints, evaluation) is
           not downtime; advances in it count for the last window. A learner still down
           when the run ends (stopped early) extends the horizon to that end, so its outage
           counts as downtime.
global_downtime_seconds = the windows in which it did not, times the window length.
"""

import math
import threading


class Ledger:
    def __init__(self, num_learners: int, window: float = 2.0):
        self.window = window
        self._lock = threading.Lock()
        self.merges = 0
        self.merged_learners = 0
        self.rejected = 0
        self.dropped = 0
        self.failures = 0
        self.restarts = 0
        self.syncer_failures = 0
        self.advances: list[float] = []
        self.useful_steps = [0.0] * num_learners
        self.step_seconds = [0.0] * num_learners
        self.steps = [0] * num_learners
        self.started = [math.nan] * num_learners
        self.last_step = -math.inf  # when any learner last finished a step
        self._down: set = set()  # learners (or ("syncer", shard)) failed and not yet restarted
        self.finished = [math.nan] * num_learners
        self.idle_seconds = [0.0] * num_learners  # allocated but not training (evaluation)

    def step(self, m: int, seconds: float, now: float) -> None:
        with self._lock:
            if math.isnan(self.started[m]):
                self.started[m] = now - seconds
            self.steps[m] += 1
            self.step_seconds[m] += seconds
            self.last_step = max(self.last_step, now)

    def idle(self, m: int, seconds: float) -> None:
        with self._lock:
            self.idle_seconds[m] += seconds

    def advance(self, now: float) -> None:
        with self._lock:
            self.advances.append(now)

    def merge(self, rec: dict) -> None:
        with self._lock:
            self.merges += 1
            self.merged_learners += len(rec["learners"])
            self.advances.append(rec["time"])
            share = rec.get("share", 0.0)
            for m, c in zip(rec["learners"], rec["c_steps"], strict=True):
                self.useful_steps[m] += c * share

    def is_down(self, who) -> bool:
        with self._lock:
            return who in self._down

    def failure(self, who, now: float) -> None:
        """`who`: a learner index or ("syncer", shard)."""
        with self._lock:
            if isinstance(who, tuple):
                self.syncer_failures += 1
            self.failures += 1
            self._down.add(who)

    def restart(self, who, now: float) -> None:
        with self._lock:
            self.restarts += 1
            self._down.discard(who)

    def finish(self, m: int, now: float) -> None:
        """Learner m's allocation ends at `now` (the first call wins: a runtime reports the
        end of training before its tail of final offers and checkpoint)."""
        with self._lock:
            if not math.isnan(self.finished[m]):
                return
            self.finished[m] = now
            if m in self._down:  # the run ended during its outage
                self.last_step = max(self.last_step, now)

    def uptime(self, wall: float) -> tuple[float, float]:
        """(uptime fraction, downtime seconds) over windows after the first advance."""
        if not self.advances:
            return 0.0, wall
        start = min(self.advances)
        end = min(wall, self.last_step) if math.isfinite(self.last_step) else wall
        n = max(math.ceil((end - start) / self.window), 1)
        hit = {min(int((t - start) / self.window), n - 1) for t in self.advances}
        return len(hit) / n, (n - len(hit)) * self.window

    def summary(self, wall: float, uses_syncer: bool, learner_steps: list[int]) -> dict:
        """`learner_steps`: each learner's final step (a run without a syncer counts the
        steps that survive to the end as useful)."""
        useful = allocated = 0.0
        for m, final_step in enumerate(learner_steps):
            if self.steps[m] == 0:
                continue
            per_step = self.step_seconds[m] / self.steps[m]
            steps = self.useful_steps[m] if uses_syncer else final_step
            useful += min(steps, self.steps[m]) * per_step
            end = self.finished[m] if not math.isnan(self.finished[m]) else wall
            allocated += max(end - self.started[m] - self.idle_seconds[m], 1e-9)
        uptime, downtime = self.uptime(wall)
        return {
            "merges": self.merges,
            "mean_learners_per_merge": self.merged_learners / self.merges if self.merges else 0.0,
            "goodput": min(useful / allocated, 1.0) if allocated else 0.0,
            "uptime": uptime,
            "global_downtime_seconds": downtime,
            "failures": self.failures,
            "restarts": self.restarts,
            "rejected_offers": self.rejected,
            "dropped_offers": self.dropped,
        }
