"""Goodput and uptime accounting of real runs (the quantities the simulator predicts).

goodput = useful learner compute / allocated learner compute (from a learner's first step
to its last, minus time it spends evaluating, which is not training, and minus time it is out
of the membership between a leave and its next window, whose chips are not the job's, as in
the simulator's allocation (simulator/core.py); its steps' waits for
merges and for their data are allocated but not compute, runtime/step_times.py; the tail
after its last step, final offers and checkpoint, is not allocation), where a learner's step is
useful once its work reached a merged global fragment (per fragment, weighted by the
fragment's share of the parameters; a merge record's c_steps are the steps its offers
brought, and each step travels in exactly one merged offer per fragment, see
diloco/learner.py; work lost to a crash, or with merges a syncer restore rolled back, does
not count); in a run without a syncer, steps that survive to the end (not lost to a
restore) are useful.

uptime and global_downtime_seconds are measured in the run's own time scale, so that a
slow host is not downtime: a wall-clock window cannot tell a slow step from a stall, the
learners' steps can. With everyone healthy every fragment merges once per sync period of
H steps (the P fragments staggered, so the global model advances about every H/P steps;
diloco/syncer.py; data-parallel: every step is an advance). So time is cut at the advances
(merges, DP steps), and the gap between two consecutive advances is *down* when

  (a) the learners training through it (stepping in it, not down in it) completed on
      average more than `tolerance = 2·H` steps in it: two whole sync periods in which no
      fragment merged (data-parallel: 1). One period of slack absorbs what does not scale
      with the step time: transfers, the syncer's turn, grace windows, a fast learner's
      many steps against a slow one's. A syncer outage shows this way (learners step on,
      nothing merges), as does a quorum that cannot fill while a learner is down; or
  (b) no learner stepped for longer than `tolerance` median step times while a learner or
      a syncer shard was down (between its failure and its restart): every learner down
      or done while one is down, a data-parallel job restarting, learners blocked on a
      dead syncer. A stretch without steps while nothing is down is a slow or stalled
      host, not downtime.

global_downtime_seconds = the wall seconds of the down gaps, each counted whole (from the
advance before the outage to the first one after it: restore and recompilation included).
uptime = 1 - that / the horizon. The horizon starts once every fragment has merged once
(data-parallel: at the first step): before that the run is starting up, compiling its
copy, merge and apply paths and calibrating its grace windows, and a loaded host takes
seconds over it (if some fragment never merges, at the first advance). It ends at the last
learner step (at the end of the run when a learner is still down then; the tail after
training, final merges, checkpoints and evaluation, is not in it). Both rules scale with
the step time, so a uniformly k-times slower host gives the same uptime (and k times the
downtime seconds, zero stays zero). An outage shorter than the tolerance is not seen: it
delayed no advance beyond what a healthy run shows.

The simulator (decoupled_diloco/simulator/core.py) predicts the fraction of time in which
the model *can* advance (the job runs; Decoupled: >= K learners run and the syncer is up).
The measured number differs by design: it counts the whole gap around an outage (up to
one merge interval plus the rejoin more than the outage), it does not see outages shorter
than the tolerance, and with fewer than K learners running it counts downtime only when
the rounds really stall (the syncer also closes a round once every live learner has
offered).
"""

import bisect
import math
import statistics
import threading

from absl import logging

from decoupled_diloco import fault_steps, faults


def next_eval_step(lead: int, every: int) -> int:
    """The lead step at which Θ is next evaluated, after one at `lead`: the next multiple of
    `train.eval_every` (0: never). A resumed run starts past the evaluations its earlier
    attempts made, and one that fell behind evaluates once, not once per missed multiple."""
    return (lead // every + 1) * every if every else 0


def tolerance_steps(sync_every: int) -> int:
    """Steps without an advance that a healthy run does not reach: two sync periods, 2·H
    (data-parallel, H = 0: 1, every step advances)."""
    return 2 * sync_every if sync_every > 0 else 1


def _overlap(union: list[tuple[float, float]], u: float, v: float) -> float:
    """Length of (u, v) inside the sorted disjoint intervals."""
    total, i = 0.0, max(bisect.bisect_right(union, (u, math.inf)) - 1, 0)
    while i < len(union) and union[i][0] < v:
        total += max(min(union[i][1], v) - max(union[i][0], u), 0.0)
        i += 1
    return total


def down_gaps(
    advances: list[float],
    step_times: list[list[float]],
    outages: list[tuple[object, float, float]],
    horizon: tuple[float, float],
    tolerance: int,
) -> list[tuple[float, float]]:
    """The down gaps (start, end) of [horizon): see the module docstring. `step_times`: per
    learner, when each of its steps finished; `outages`: (who, failure, restart) of any
    learner (who = its index) or syncer shard (restart inf while still down)."""
    start, end = horizon
    cuts = [start, *sorted(t for t in advances if start < t < end), end]
    steps = [sorted(ts) for ts in step_times]
    every_step = sorted(t for ts in steps for t in ts)
    durations = [b - a for ts in steps for a, b in zip(ts, ts[1:], strict=False)]
    step_s = statistics.median(durations) if durations else math.inf
    down_union = faults.merge_intervals((a, b) for _, a, b in outages)
    union = faults.merge_intervals
    own = [union((a, b) for who, a, b in outages if who == m) for m in range(len(steps))]
    out = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        if b <= a:
            continue
        counts = [
            bisect.bisect_right(ts, b) - bisect.bisect_right(ts, a)
            for ts, down in zip(steps, own, strict=True)
            if _overlap(down, a, b) == 0.0  # a learner down in the gap does not pace it
        ]
        counts = [c for c in counts if c > 0]
        pace = sum(counts) / len(counts) if counts else 0.0
        stretch = [
            a,
            *every_step[bisect.bisect_right(every_step, a) : bisect.bisect_left(every_step, b)],
            b,
        ]
        idle = max(_overlap(down_union, u, v) for u, v in zip(stretch, stretch[1:], strict=False))
        if pace > tolerance or idle > tolerance * step_s:
            out.append((a, b))
    return out


class Ledger:
    def __init__(self, num_learners: int, sync_every: int = 0, fragments: int = 1):
        """`sync_every`, `fragments`: the run's H and P (H = 0: data-parallel)."""
        self.tolerance = tolerance_steps(sync_every)
        self._lock = threading.Lock()
        self.merges = 0  # merges Θ still holds (a syncer restore rolls later ones back)
        self.rolled_back_merges = 0
        # fragment -> [(version, what the merge credited)], to take back on a rollback
        self._credited: dict[int, list[tuple[int, tuple]]] = {}
        self.merged_learners = 0
        self.merged_steps = 0  # steps of work the merged offers carried
        self.offer_seconds = 0.0  # the merged offers' ages at their merges (summed)
        # Learners' steps from an offer to the boundary applying the merge holding it
        # (summed), and how many such merges (their metrics rows).
        self.delay_steps = 0.0
        self.delayed_merges = 0
        self.rejected_offers = 0
        self.dropped_offers = 0
        # Steps a resume found the syncer's Θ to lack (a kill after its last checkpoint),
        # summed over learners: trained, then lost (`resume_cut` events).
        self.resume_lost_steps = 0
        # Steps of unmerged work emulated crashes lost with the learners' device state,
        # summed over learners (`rejoin` events' `lost_steps`); `crash_lost_steps` adds
        # those of learners that crashed and never came back (`_left_down`).
        self.counted_crash_lost = 0
        # Learners whose membership ended while they were down after a crash (or a NaN
        # restart), never rejoining to count their loss at a cut (`learner_gone` events):
        # learner -> (the first step of the life that crashed, its step at the crash).
        self._left_down: dict[int, tuple[int, int]] = {}
        # (learner, fragment) -> the step spans (lo, hi] of the merges a restore rolled
        # back (`syncer_lost_steps`): a crash or cut that finds Θ lacking them does not
        # count them again.
        self._rolled: dict[tuple[int, int], list[tuple[int, int]]] = {}
        # The same of earlier attempts of a resumed run (`seed_rolled`): counted in their
        # `syncer_lost_steps`, not in this attempt's, and not again by this one's cuts.
        self._earlier: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._lost_unspanned = 0  # (rolled-back merge records without offer steps)
        self.failures = 0
        self.restarts = 0
        self.syncer_failures = 0
        self.advances: list[float] = []
        self.fragments = fragments
        self.first_merge: dict[int, float] = {}  # fragment -> when it first merged
        self.useful_steps = [0.0] * num_learners
        self.step_seconds = [0.0] * num_learners
        self.steps = [0] * num_learners
        self.step_times: list[list[float]] = [[] for _ in range(num_learners)]
        self.started = [math.nan] * num_learners
        self.last_step = -math.inf  # when any learner last finished a step
        self._down: dict = {}  # learner (or ("syncer", shard)) failed and not restarted -> when
        self.outages: list[tuple] = []  # (who, failure, restart) of learners and syncer shards
        self.finished = [math.nan] * num_learners
        self.idle_seconds = [0.0] * num_learners  # allocated but not training (evaluation)
        # Out of the membership (scavenged capacity given back): not allocated. `_away`:
        # learner -> when it left, until its next window opens.
        self.away_seconds = [0.0] * num_learners
        self._away: dict[int, float] = {}

    @classmethod
    def of_run(cls, run) -> "Ledger":
        """The ledger of a RunConfig: its M, and H and P when it has a syncer."""
        d = run.diloco
        return cls(run.num_learners, d.sync_every if run.uses_syncer else 0, d.fragments)

    def step(self, m: int, seconds: float, now: float) -> None:
        with self._lock:
            if math.isnan(self.started[m]):
                self.started[m] = now - seconds
            self.steps[m] += 1
            self.step_seconds[m] += seconds
            self.step_times[m].append(now)
            self.last_step = max(self.last_step, now)

    def idle(self, m: int, seconds: float) -> None:
        with self._lock:
            self.idle_seconds[m] += seconds

    def leave(self, m: int, now: float) -> None:
        """Learner m left the membership at `now` (`learner_leave`): no longer allocated."""
        with self._lock:
            self._away.setdefault(m, now)

    def join(self, m: int, now: float) -> None:
        """Learner m's next membership window opened at `now` (`member_join`): allocated
        again. A join with no leave before it (a late joiner's first) changes nothing: its
        allocation begins at its first step."""
        with self._lock:
            left = self._away.pop(m, None)
            if left is not None and not math.isnan(self.started[m]):
                self.away_seconds[m] += max(now - left, 0.0)

    def advance(self, now: float) -> None:
        with self._lock:
            self.advances.append(now)

    def merge(self, rec: dict) -> None:
        with self._lock:
            share = rec.get("share", 0.0)
            steps = list(zip(rec["learners"], rec["c_steps"], strict=True))
            useful = [(m, c * share) for m, c in steps]
            # Each offer's steps: (its step - c_steps, its step] of its learner.
            ends = rec.get("steps") or ()
            spans = [(m, s - c, s) for (m, c), s in zip(steps, ends, strict=False)]
            credit = (len(rec["learners"]), sum(rec["c_steps"]),
                      sum(rec.get("offer_seconds", ())), useful, steps, spans)  # fmt: skip
            self._credit(credit, +1)
            fragment = rec.get("fragment", 0)
            self._credited.setdefault(fragment, []).append((rec.get("version", 0), credit))
            self.advances.append(rec["time"])
            self.first_merge.setdefault(fragment, rec["time"])

    def _credit(self, credit: tuple, sign: int) -> None:
        learners, steps, offer_seconds, useful = credit[:4]
        self.merges += sign
        self.merged_learners += sign * learners
        self.merged_steps += sign * steps
        self.offer_seconds += sign * offer_seconds
        for m, u in useful:
            self.useful_steps[m] += sign * u

    def rollback(self, versions: dict) -> None:
        """A syncer shard restored its fragments at `versions` (fragment -> version): the
        merges past them are gone from Θ, and their steps with them (its learners rebase
        away from what was lost and do not offer it again), so they are no longer useful."""
        with self._lock:
            lost: dict[tuple[int, int], int] = {}  # (learner, fragment) -> steps
            for p, v in versions.items():
                kept = []
                for version, credit in self._credited.get(int(p), []):
                    if version > v:
                        self._credit(credit, -1)
                        self.rolled_back_merges += 1
                        for m, c in credit[4]:
                            lost[m, int(p)] = lost.get((m, int(p)), 0) + c
                        for m, lo, hi in credit[5]:
                            self._rolled.setdefault((m, int(p)), []).append((lo, hi))
                    else:
                        kept.append((version, credit))
                self._credited[int(p)] = kept
            most: dict[int, int] = {}
            for (m, p), c in lost.items():
                if (m, p) not in self._rolled:
                    most[m] = max(most.get(m, 0), c)
            self._lost_unspanned += sum(most.values())

    def left_down(self, m: int, life_start: int, step: int) -> None:
        """Learner m crashed at `step` in the life that began at `life_start` and will not
        rejoin: what Θ lacks of that life is lost (`crash_lost_steps`)."""
        with self._lock:
            self._left_down[m] = (int(life_start), int(step))

    @property
    def crash_lost_steps(self) -> int:
        """Steps of unmerged work crashes lost: those counted at the rejoins (and at NaNs in
        the last steps), and, of each learner that crashed and never came back, the most
        steps of its last life any fragment lacks now (no merge holds them, no syncer
        restore's rollback counted them), its offers in flight at the crash being merged
        or not by now."""
        with self._lock:
            gone, held = dict(self._left_down), self._held()
            lacking = {
                m: {p: spans_minus(start, end, held.get((m, p), ())) for p in range(self.fragments)}
                for m, (start, end) in gone.items()
            }
        return self.counted_crash_lost + sum(self.not_rolled_back(m, lacking[m]) for m in gone)

    @property
    def syncer_lost_steps(self) -> int:
        """Steps whose work a syncer restore rolled back with the merges holding them (those
        after its last checkpoint) and that no merge holds since, summed over learners,
        each learner's most any fragment lost. A learner rebases away from the merges it
        had applied and does not offer their steps again; those of a merge it had not
        applied yet are still its own unmerged work, offered again (and merged: not lost)."""
        with self._lock:
            most: dict[int, int] = {}
            for (m, _), gone in self._gone().items():
                most[m] = max(most.get(m, 0), span_steps(gone))
            return self._lost_unspanned + sum(most.values())

    def _held(self) -> dict[tuple[int, int], list[tuple[int, int]]]:
        """(learner, fragment) -> the step spans of the merges Θ holds (lock held)."""
        held: dict[tuple[int, int], list] = {}
        for p, credits in self._credited.items():
            for _, credit in credits:
                for m, lo, hi in credit[5]:
                    held.setdefault((m, int(p)), []).append((lo, hi))
        return held

    def _gone(self) -> dict[tuple[int, int], list[tuple[int, int]]]:
        """(learner, fragment) -> the rolled-back spans no merge holds since (lock held)."""
        held = self._held()
        gone = {}
        for (m, p), rolled in self._rolled.items():
            kept = held.get((m, p), ())
            windows = fault_steps.merge_windows(rolled)
            gone[m, p] = [x for lo, hi in windows for x in spans_minus(lo, hi, kept)]
        return gone

    def rolled_spans(self) -> dict[str, dict[str, list[list[int]]]]:
        """The steps counted in `syncer_lost_steps` by this attempt and the earlier ones, as
        {learner: {fragment: [[lo, hi], ...]}} (JSON): what an attempt's record keeps, so
        that a resume's cut, finding Θ without them, does not count them again when the
        learner was killed before it saw the rollback (and so had not noted them beside
        its checkpoints). Spans a merge held again after the record was written (up to a
        heartbeat) read as rolled back to a resume."""
        with self._lock:
            both: dict[tuple[int, int], list] = {}
            for key, spans in [*self._gone().items(), *self._earlier.items()]:
                both[key] = [*both.get(key, []), *spans]
            out: dict[str, dict[str, list[list[int]]]] = {}
            for (m, p), spans in sorted(both.items()):
                if spans:
                    windows = fault_steps.merge_windows(spans)
                    out.setdefault(str(m), {})[str(p)] = [list(w) for w in windows]
            return out

    def seed_rolled(self, spans: dict) -> None:
        """Takes the earlier attempts' `rolled_spans` (a resumed run); a record that does not
        read as one is logged and left out (it only keeps steps from being counted twice)."""
        try:
            earlier = {
                (int(m), int(p)): [(int(a), int(b)) for a, b in pieces]
                for m, by_fragment in spans.items()
                for p, pieces in by_fragment.items()
            }
        except (ValueError, TypeError, AttributeError) as e:
            logging.warning("attempts.jsonl's rolled_spans do not read (%s): steps an earlier "
                            "syncer restore rolled back may be counted again", e)  # fmt: skip
            earlier = {}
        with self._lock:
            self._earlier = earlier

    def not_rolled_back(self, m: int, spans: dict) -> int:
        """Of learner m's step spans {fragment: [(lo, hi], ...]} that Θ lacks (a crash's or
        a cut's), the most steps any fragment lacks that no rolled-back merge held: those a
        syncer restore took back, in this attempt or an earlier one, are counted in
        `syncer_lost_steps` already."""
        with self._lock:
            most = 0
            for p, pieces in spans.items():
                key = (m, int(p))
                rolled = [*self._rolled.get(key, ()), *self._earlier.get(key, ())]
                left = [piece for lo, hi in pieces for piece in spans_minus(lo, hi, rolled)]
                most = max(most, span_steps(left))
            return most

    def rewound(self, m: int, step: int) -> None:
        """Learner m goes on from `step` (a checkpoint, or where Θ holds its work): the spans
        rolled back past it were another timeline's, which its new steps do not repeat."""
        with self._lock:
            for rolled in (self._rolled, self._earlier):
                for (mm, p), spans in rolled.items():
                    if mm == m:
                        rolled[mm, p] = [(lo, min(hi, step)) for lo, hi in spans if lo < step]

    def row(self, rec: dict) -> None:
        """A learner's metrics row: the merge delay of the merges it applied since its
        previous row (`merge_delay_steps`, the mean over `merges_held`)."""
        n = rec.get("merges_held", 0)
        if n:
            with self._lock:
                self.delay_steps += rec["merge_delay_steps"] * n
                self.delayed_merges += n

    def is_down(self, who) -> bool:
        with self._lock:
            return who in self._down

    def learners_down(self) -> list[int]:
        """The learners failed and not restarted, in order."""
        with self._lock:
            return sorted(w for w in self._down if not isinstance(w, tuple))

    def failure(self, who, now: float, counted: bool = True) -> None:
        """`who`: a learner index or ("syncer", shard), down from `now`; `counted`: False for
        an outage an earlier attempt of the run began and counted."""
        with self._lock:
            if counted:
                self.syncer_failures += isinstance(who, tuple)
                self.failures += 1
            self._down.setdefault(who, now)

    def restart(self, who, now: float) -> None:
        with self._lock:
            self.restarts += 1
            if who in self._down:
                self.outages.append((who, self._down.pop(who), now))

    def finish(self, m: int, now: float) -> None:
        """Learner m's allocation ends at `now` (the first call wins: a runtime reports the
        end of training before its tail of final offers and checkpoint)."""
        with self._lock:
            if not math.isnan(self.finished[m]):
                return
            self.finished[m] = now
            left = self._away.pop(m, None)
            if left is not None:  # out of the membership at the end: allocated until it left
                self.away_seconds[m] += max(now - left, 0.0)
            if m in self._down:  # the run ended during its outage
                self.last_step = max(self.last_step, now)

    def uptime(self, wall: float) -> tuple[float, float]:
        """(uptime fraction, downtime seconds) of the horizon (module docstring)."""
        if not self.advances:
            if not any(self.step_times) and not self._down and not self.outages:
                return 1.0, 0.0  # nothing trained, nothing down: no horizon (a resume at the end)
            return 0.0, wall
        start = min(self.advances)
        if len(self.first_merge) == self.fragments:  # started up: every fragment merged
            start = max(self.first_merge.values())
        end = min(wall, self.last_step) if math.isfinite(self.last_step) else wall
        if end <= start:
            return 1.0, 0.0
        with self._lock:
            outages = self.outages + [(w, t, math.inf) for w, t in self._down.items()]
            gaps = down_gaps(self.advances, self.step_times, outages, (start, end), self.tolerance)
        down = sum(b - a for a, b in gaps)
        return 1.0 - down / (end - start), down

    def accounting(self, wall: float, uses_syncer: bool, learner_steps: list[int],
                   start_steps: list[int] | None = None) -> dict:  # fmt: skip
        """Goodput, uptime and downtime of `summary` (an interrupted attempt's record)."""
        out = self.summary(wall, uses_syncer, learner_steps, start_steps)
        return {k: out[k] for k in ("goodput", "uptime", "global_downtime_seconds")}

    def summary(self, wall: float, uses_syncer: bool, learner_steps: list[int],
                start_steps: list[int] | None = None) -> dict:  # fmt: skip
        """`learner_steps`: each learner's final step, `start_steps` the step this attempt
        began at (its checkpoint's; default 0): a run without a syncer counts the steps
        between them, those that survive to the end, as useful (not every step this attempt
        took: a resumed attempt's redone steps after a restore are lost)."""
        useful = allocated = 0.0
        start_steps = start_steps or [0] * len(learner_steps)
        for m, final_step in enumerate(learner_steps):
            if self.steps[m] == 0:
                continue
            per_step = self.step_seconds[m] / self.steps[m]
            steps = self.useful_steps[m] if uses_syncer else final_step - start_steps[m]
            useful += min(steps, self.steps[m]) * per_step
            end = self.finished[m] if not math.isnan(self.finished[m]) else wall
            off = self.idle_seconds[m] + self.away_seconds[m]
            allocated += max(end - self.started[m] - off, 1e-9)
        uptime, downtime = self.uptime(wall)
        return {
            "merges": self.merges,
            "rolled_back_merges": self.rolled_back_merges,  # merges a syncer restore undid
            "mean_learners_per_merge": self.merged_learners / self.merges if self.merges else 0.0,
            # H when every offer leaves on schedule; more when offers waited for a late merge
            # of their fragment (one offer per fragment in flight, diloco/learner.py).
            "mean_offer_steps": self.merged_steps / self.merged_learners
            if self.merged_learners
            else 0.0,
            # Seconds from an offer's making to its merge: the first half of a round trip.
            "mean_offer_seconds": self.offer_seconds / self.merged_learners
            if self.merged_learners
            else 0.0,
            # Steps from an offer to the boundary applying the merge holding it: τ when
            # merges come back in time, more when they are late (learners' metrics rows).
            "mean_merge_delay_steps": self.delay_steps / self.delayed_merges
            if self.delayed_merges
            else 0.0,
            "goodput": min(useful / allocated, 1.0) if allocated else 0.0,
            "attempt_learner_steps": sum(self.steps),  # steps this process trained
            "uptime": uptime,
            "global_downtime_seconds": downtime,
            "downtime_gap_steps": self.tolerance,
            "failures": self.failures,
            "restarts": self.restarts,
            "resume_lost_steps": self.resume_lost_steps,
            "crash_lost_steps": self.crash_lost_steps,
            "syncer_lost_steps": self.syncer_lost_steps,
            "rejected_offers": self.rejected_offers,
            "dropped_offers": self.dropped_offers,
        }


def spans_minus(lo: int, hi: int, spans) -> list[tuple[int, int]]:
    """The steps (lo, hi] not in any of `spans` (each (a, b]), as disjoint spans."""
    out, at = [], lo
    for a, b in fault_steps.merge_windows(spans):
        if b <= at or a >= hi:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out


def span_steps(spans) -> int:
    return sum(b - a for a, b in spans)
