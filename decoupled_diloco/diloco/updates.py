"""What a learner applies to its fragment leaves: `Update`s, the versions they come from
(`Decoded`, decoded lazily) and the rebase arithmetic (`rebase_delta`).

Numpy only. The learner protocol (learner.py) builds updates; a runtime computes their
arrays wherever it likes (the `MergeStager`'s thread, runtime/boundary.py) and applies them
on the replica.
"""

import threading

import numpy as np

from decoupled_diloco.diloco import compression


class Decoded:
    """G_p as a received version's payload, decoded on first use (on whichever thread needs
    it first: the update's, the outbox's), once."""

    def __init__(self, payload):
        self._payload, self._arrays, self._lock = payload, None, threading.Lock()

    def get(self) -> dict:
        with self._lock:
            if self._arrays is None:
                self._arrays = compression.decode(self._payload)
            return self._arrays


class Update:
    """A change of fragment leaves for the replica: θ ← θ + x ("add") or
    θ ← α·θ + (1 − α)·x ("mix"; α = 0 sets θ = x).

    x is computed on first use of `arrays` (host math: decode, differences), so a runtime
    can compute and place it on the devices ahead of the boundary that applies it: `key`
    names the computation (equal keys, equal x), see `Learner.upcoming`."""

    def __init__(self, kind: str, compute, alpha: float = 0.0, key: tuple | None = None):
        self.kind, self.alpha, self.key = kind, alpha, key  # kind: "add" | "mix"
        self._compute = compute if callable(compute) else (lambda: compute)
        self._arrays = None

    @property
    def arrays(self) -> dict:
        """Leaf name -> float32 host array."""
        if self._arrays is None:
            self._arrays = self._compute()
        return self._arrays


def resolve(anchor) -> dict:
    return anchor.get() if isinstance(anchor, Decoded) else anchor


def rebase_delta(anchor: dict, theta: dict, sent: dict | None) -> dict:
    """δ with θ ← θ + δ moving W onto `theta`; minus our offer's work (`sent`, v̂_s) if
    `theta` holds it.

    θ_s = G − v̂_s in the current frame (shifts since the offer moved G and θ alike), so
    Θ_new + (θ − θ_s) = θ + (Θ_new − G + v̂_s).
    """
    delta = {k: np.subtract(theta[k], anchor[k], dtype=np.float32) for k in theta}
    if sent is not None:
        for k, v in sent.items():
            delta[k] += v
    return delta
