"""The syncer's learner registry: who is in the run, in which life, and who is alive.

Liveness comes from messages: a learner silent for longer than `heartbeat_timeout` seconds
is dead until it speaks again; an entry restored from the syncer's checkpoint, which no
message of its life has confirmed yet, after `confirm_timeout` seconds (a learner that left
before the restore may never speak again, and its Leave may be lost with the syncer). The
roster, which merge weights are normalised by (`merge.weigh`), holds the learners whose work
reaches Θ, live or finished with their step budget. A learner's work reaches Θ from its
first accepted offer of a life: one that joins a running run (a scavenged learner, a
restarted one) counts from that offer, not from its Join, since between the two it compiles
and takes its first H steps while the others' merges would be normalised by its absent work
(Θ moved a half or a quarter as far per round while 4 or 12 learners joined 4 running ones:
experiments/README.md, section 8). The learners that join before the run's first merge
count from their Join: they start together, and the first rounds are theirs. (With syncer
shards, each shard's registry decides this by its own fragments' first merge.)

Lives. A learner's new life starts with a Join. A heartbeat of a life the registry never saw
also counts as that life's join when the registry may have missed its Join (it is restored
from a checkpoint older than the join, or the learner is unknown or silent past the
timeout); from a learner live in a life the registry has heard from, it is dropped, so a
stray heartbeat cannot lock the learner's real life out. No message may claim a life more
than `MAX_INCARNATION_LEAD` ahead of the registered one: lives are restarts.
"""

import dataclasses

import numpy as np

from decoupled_diloco.diloco import merge
from decoupled_diloco.diloco.offer_checks import Reason

# Lives a Join or heartbeat may claim beyond the registered life (or beyond 0 for a learner
# the registry does not know): restarts since the syncer's last checkpoint, or of a
# learner whose checkpoint outlived the syncer's, are far fewer.
MAX_INCARNATION_LEAD = 1024


@dataclasses.dataclass
class LearnerInfo:
    incarnation: int = 0
    last_seen: float = 0.0
    joined: bool = False
    step: int = 0  # the highest step the learner reported (join, heartbeats, offers)
    tokens_per_step: int = 0  # 0 = unknown
    finished: bool = False  # left after its step budget: still in the weights' roster
    # False for an entry restored from a checkpoint until a message of that life arrives
    confirmed: bool = True
    # In the roster: an offer of this life was accepted, or it joined before the first merge
    counted: bool = True
    # The step this life joined at (its Join's), -1 unknown: a life that joined at a
    # fragment's due step or after it never offers that slot (Syncer.waits_for)
    joined_at: int = -1


class Registry:
    def __init__(self, num_learners: int, heartbeat_timeout: float, confirm_timeout: float):
        self.num_learners, self.timeout = num_learners, heartbeat_timeout
        self.confirm_timeout = confirm_timeout
        self.learners: dict[int, LearnerInfo] = {}

    def get(self, m) -> LearnerInfo | None:
        ok = isinstance(m, int | np.integer) and not isinstance(m, bool)
        return self.learners.get(int(m)) if ok else None

    def register(self, m: int, incarnation: int, joined: bool, now: float, step: int = 0,
                 tokens_per_step: int = 0, finished: bool = False, counted: bool = True,
                 joined_at: int = -1) -> None:  # fmt: skip
        """Restores an entry (after the syncer itself was restored): unconfirmed."""
        self.learners[m] = LearnerInfo(
            int(incarnation), now, bool(joined), int(step), int(tokens_per_step), bool(finished),
            confirmed=False, counted=bool(counted), joined_at=int(joined_at),
        )  # fmt: skip

    def touch(self, m: int, now: float) -> LearnerInfo:
        info = self.learners.setdefault(m, LearnerInfo())
        info.last_seen = max(info.last_seen, now)
        return info

    def _too_far(self, m: int, incarnation: int) -> Reason | None:
        known = self.learners.get(m)
        limit = (known.incarnation if known is not None else 0) + MAX_INCARNATION_LEAD
        if incarnation > limit:
            return Reason("implausible", f"incarnation {incarnation} of learner {m} is more than "
                          f"{MAX_INCARNATION_LEAD} lives ahead of its registered one")  # fmt: skip
        return None

    def join(self, m: int, incarnation: int, step: int, tokens_per_step: int, now: float,
             counted: bool, joined_at: int = -1):  # fmt: skip
        """Admits a (re)joining learner (fields validated: message_checks.py); returns why
        not (None if admitted). `counted`: in the roster at once (it joined before the
        run's first merge), else from its first accepted offer (the syncer sets it).
        `joined_at`: the step the life began at (-1: unknown, a life admitted from a
        heartbeat, which may have begun steps earlier)."""
        known = self.learners.get(m)
        if known is not None and incarnation < known.incarnation:
            # A delayed Join of an earlier life must not roll the registry back.
            return Reason("old_incarnation", f"join from old incarnation {incarnation}")
        reason = self._too_far(m, incarnation)
        if reason:
            return reason
        info = self.touch(m, now)
        # A new life reports its own steps: a restarted process resumes its last checkpoint,
        # steps behind where its previous life got. Kept at that life's highest step, its
        # offers would stand for slots it has not reached (rounds.offer_slot), and be late
        # in rounds its own next offers should pace.
        new_life = known is None or incarnation != known.incarnation
        info.step = int(step) if new_life else max(info.step, int(step))
        info.incarnation, info.joined, info.finished = incarnation, True, False
        # (Its Join again keeps a life in the roster that its accepted offers put there.)
        info.counted = bool(counted) or (not new_life and info.counted)
        info.confirmed, info.joined_at = True, int(joined_at)
        info.tokens_per_step = int(tokens_per_step) or info.tokens_per_step
        return None

    def leave(self, m: int, incarnation: int, finished: bool) -> Reason | str | None:
        """A learner stops training; why not, if the message is of an earlier life (or an
        implausible one); "again" if that life has left already (a restarted process
        announces the life its predecessor died in, which a driver may have announced too):
        nothing changes but a `finished` that becomes true. A later life's Leave ends the
        registered life (below)."""
        info = self.learners.get(m)
        if info is not None and incarnation > info.incarnation:
            # A life this registry never saw join (a restarted process announces the last
            # life its predecessor took, which it may have died before joining). Lives are
            # taken one after another, so the registered one is over too.
            too_far = self._too_far(m, incarnation)
            if too_far:
                return too_far
            if not info.joined:
                return "again"
            info.joined, info.confirmed = False, True
            return None
        if info is None or info.incarnation != incarnation:
            return self._other_life(m, incarnation, info)
        if not info.joined and (info.finished or not finished):
            info.confirmed = True
            return "again"
        info.joined, info.finished, info.confirmed = False, bool(finished), True
        return None

    def heartbeat(self, m: int, incarnation: int, step: int, now: float) -> str | Reason:
        """ "join": a life the registry may have missed the Join of (module docstring), to
        be treated as that life's join; "ok": recorded; else why it was dropped."""
        info = self.learners.get(m)
        if info is None or incarnation > info.incarnation:
            too_far = self._too_far(m, incarnation)
            if too_far:
                return too_far
            if info is not None and info.confirmed and m in self.live(now):
                why = (f"heartbeat of incarnation {incarnation} without a join: learner {m} "
                       f"is live in incarnation {info.incarnation}")  # fmt: skip
                return Reason("new_incarnation", why)
            return "join"
        if info.incarnation != incarnation:
            return self._other_life(m, incarnation, info)
        self.touch(m, now)
        info.step, info.confirmed = max(info.step, int(step)), True
        return "ok"

    @staticmethod
    def _other_life(m: int, incarnation: int, info) -> Reason:
        current = "none" if info is None else info.incarnation
        return Reason("old_incarnation", f"learner {m} incarnation {incarnation} is not its "
                      f"current one ({current})")  # fmt: skip

    def _silent(self, info: LearnerInfo, now: float) -> bool:
        limit = self.timeout if info.confirmed else min(self.timeout, self.confirm_timeout)
        return now - info.last_seen > limit

    def live(self, now: float) -> list[int]:
        return sorted(
            m for m, info in self.learners.items() if info.joined and not self._silent(info, now)
        )

    def dead(self, now: float) -> set[int]:
        """Joined learners silent for longer than the heartbeat (or confirm) timeout."""
        return {m for m, info in self.learners.items() if info.joined and self._silent(info, now)}

    def roster(self, now: float) -> list[int]:
        """Learners whose work merge weights are normalised by: those whose work reaches Θ
        (module docstring) that are live or finished their step budget (their last work was
        done alongside the others')."""
        live = set(self.live(now))
        return sorted(
            m for m, info in self.learners.items()
            if info.counted and (info.finished or m in live)
        )  # fmt: skip

    def others_weight(self, merged: set[int], default_tokens: float, mode: str, now: float):
        """q of the roster's learners with no offer in a merge (`merge.learner_weight`)."""
        return [
            merge.learner_weight(self.learners[m].tokens_per_step or default_tokens, mode)
            for m in self.roster(now)
            if m not in merged
        ]
