"""The syncer's learner registry: who is in the run, in which life, and who is alive.

Liveness comes from messages: a learner silent for longer than `heartbeat_timeout` seconds
is dead until it speaks again. The roster, which merge weights are normalised by
(`merge.weigh`), holds the live learners and those that finished their step budget.
"""

import dataclasses

import numpy as np

from decoupled_diloco.diloco import merge


@dataclasses.dataclass
class LearnerInfo:
    incarnation: int = 0
    last_seen: float = 0.0
    joined: bool = False
    step: int = 0  # the highest step the learner reported (join, heartbeats, offers)
    tokens_per_step: int = 0  # 0 = unknown
    finished: bool = False  # left after its step budget: still in the weights' roster


class Registry:
    def __init__(self, num_learners: int, heartbeat_timeout: float):
        self.num_learners, self.timeout = num_learners, heartbeat_timeout
        self.learners: dict[int, LearnerInfo] = {}

    def get(self, m) -> LearnerInfo | None:
        ok = isinstance(m, int | np.integer) and not isinstance(m, bool)
        return self.learners.get(int(m)) if ok else None

    def register(self, m: int, incarnation: int, joined: bool, now: float, step: int = 0,
                 tokens_per_step: int = 0, finished: bool = False) -> None:  # fmt: skip
        """Restores an entry (after the syncer itself was restored)."""
        self.learners[m] = LearnerInfo(
            int(incarnation), now, bool(joined), int(step), int(tokens_per_step), bool(finished)
        )

    def touch(self, m: int, now: float) -> LearnerInfo:
        info = self.learners.setdefault(m, LearnerInfo())
        info.last_seen = max(info.last_seen, now)
        return info

    def join(self, m: int, incarnation: int, step: int, tokens_per_step: int, now: float) -> str:
        """Admits a (re)joining learner; returns why not ("" if admitted)."""
        if not 0 <= m < self.num_learners:
            return f"join from unknown learner {m}"
        known = self.learners.get(m)
        if known is not None and incarnation < known.incarnation:
            # A delayed Join of an earlier life must not roll the registry back.
            return f"join from old incarnation {incarnation}"
        info = self.touch(m, now)
        info.incarnation, info.joined, info.finished = incarnation, True, False
        info.step = max(info.step, int(step))
        info.tokens_per_step = int(tokens_per_step) or info.tokens_per_step
        return ""

    def leave(self, m: int, incarnation: int, finished: bool) -> bool:
        """A learner stops training; False if the message is not of its current life."""
        info = self.learners.get(m)
        if info is None or info.incarnation != incarnation:
            return False
        info.joined, info.finished = False, bool(finished)
        return True

    def heartbeat(self, m: int, incarnation: int, step: int, now: float) -> str:
        """ "join": a life this registry never saw (it comes from an older checkpoint), to
        be treated as that life's join; "ok": recorded; "": ignored (old life, unknown)."""
        info = self.learners.get(m)
        if (info is None or incarnation > info.incarnation) and 0 <= m < self.num_learners:
            return "join"
        if info is None or info.incarnation != incarnation:
            return ""
        self.touch(m, now)
        info.step = max(info.step, int(step))
        return "ok"

    def live(self, now: float) -> list[int]:
        return sorted(
            m
            for m, info in self.learners.items()
            if info.joined and now - info.last_seen <= self.timeout
        )

    def dead(self, now: float) -> set[int]:
        """Joined learners silent for longer than the heartbeat timeout."""
        return {
            m
            for m, info in self.learners.items()
            if info.joined and now - info.last_seen > self.timeout
        }

    def roster(self, now: float) -> list[int]:
        """Learners whose work merge weights are normalised by: the live ones, and those
        that finished their step budget (their last work was done alongside the others')."""
        finished = [m for m, info in self.learners.items() if info.finished]
        return sorted(set(self.live(now)) | set(finished))

    def others_weight(self, merged: set[int], default_tokens: float, mode: str, now: float):
        """q of the roster's learners with no offer in a merge (`merge.learner_weight`)."""
        return [
            merge.learner_weight(self.learners[m].tokens_per_step or default_tokens, mode)
            for m in self.roster(now)
            if m not in merged
        ]
