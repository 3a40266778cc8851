"""The adaptive grace window: how long a round whose quorum is met waits for more offers.

grace = clamp(γ·(τ·ξ_step − ξ_quorum − ξ_merge), 0, max_grace) seconds, with ξ exponential
moving averages (decay `diloco.ema_decay`) of the learners' step time (their heartbeats),
the time from a round's first fresh offer to its quorum, and the merge time: a round may
use the τ overlap steps' time that quorum and merge leave over, without slowing anyone.
"""


class Ema:
    def __init__(self, decay: float):
        self.decay, self.value = decay, None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x

    def get(self) -> float:
        return 0.0 if self.value is None else self.value


class GraceWindow:
    def __init__(self, gamma: float, max_grace: float, overlap: int, ema_decay: float):
        self.gamma, self.max_grace, self.overlap = gamma, max_grace, overlap
        self.step, self.quorum, self.merge = (Ema(ema_decay) for _ in range(3))

    def seconds(self) -> float:
        budget = self.overlap * self.step.get() - self.quorum.get() - self.merge.get()
        return float(min(max(self.gamma * budget, 0.0), self.max_grace))
