"""What a learner applies to its fragment leaves: `Update`s, the versions they come from
(`Decoded`, decoded lazily) and the rebase arithmetic (`rebase_delta`).

Numpy only. The learner protocol (learner.py) builds updates; a runtime computes their
arrays wherever it likes (the `MergeStager`'s thread, runtime/boundary.py) and applies them
on the replica.
"""

import threading

import numpy as np

from decoupled_diloco.diloco import chunks, compression


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


class Rebase:
    """The inputs of a rebase's x = Θ_new − G + v̂ (`rebase_delta`), for a runtime that
    computes it where θ lives: `new` Θ_new's payload, `anchor` G (a `Decoded` or a dict),
    `sent` v̂ (None: the version does not hold our offer). `anchor_key` names G,
    `after_key` the anchor applying this update makes (Θ_new): fragment, learner
    incarnation, syncer life (epoch), anchor count, version. A runtime that keeps the Θ_new
    it placed under `after_key` finds it as the next update's G under its `anchor_key`,
    and need not move G again."""

    def __init__(self, new, anchor, sent: dict | None, anchor_key: tuple, after_key: tuple):
        self.new, self.anchor, self.sent = new, anchor, sent
        self.anchor_key, self.after_key = anchor_key, after_key

    def new_arrays(self) -> dict:
        return compression.decode(self.new)

    def anchor_arrays(self) -> dict:
        return resolve(self.anchor)


class Update:
    """A change of fragment leaves for the replica: θ ← θ + (1 − α)·x ("add") or
    θ ← α·θ + (1 − α)·x ("mix"; α = 0 sets θ = x). Both are a mix of θ with its target
    (θ + x, or x) at weight α. A "land" (always a rebase: x = Θ_new − G + v̂) moves θ as
    the mix with Θ_new would, and sets aside what the add would have kept on top
    (`Replica.land`): θ + R after it equals θ + R after the add.

    x is computed on first use of `arrays` (host math: decode, differences), so a runtime
    can compute and place it on the devices ahead of the boundary that applies it: `key`
    names the computation (equal keys, equal x), see `Learner.upcoming`."""

    def __init__(self, kind: str, compute, alpha: float = 0.0, key: tuple | None = None,
                 rebase: Rebase | None = None):  # fmt: skip
        self.kind, self.alpha, self.key = kind, alpha, key  # "add" | "mix" | "land"
        self._compute = compute if callable(compute) else (lambda: compute)
        self._arrays = None
        # An "add" that is a rebase: its inputs, for a runtime that computes x on the
        # devices instead (`Rebase`); `arrays` stays the host computation of the same x.
        self.rebase = rebase

    @property
    def arrays(self) -> dict:
        """Leaf name -> float32 host array."""
        if self._arrays is None:
            self._arrays = self._compute()
        return self._arrays


def resolve(anchor) -> dict:
    return anchor.get() if isinstance(anchor, Decoded) else anchor


def rebase_delta(anchor: dict, theta: dict, sent: dict | None, threads: int | None = 1) -> dict:
    """δ with θ ← θ + δ moving W onto `theta`; minus our offer's work (`sent`, v̂_s) if
    `theta` holds it.

    θ_s = G − v̂_s in the current frame (shifts since the offer moved G and θ alike), so
    Θ_new + (θ − θ_s) = θ + (Θ_new − G + v̂_s).

    One pass per leaf, in chunks split over `threads` threads (None/0: the host's cores,
    `diloco.merge_threads`): a `mid` fragment's update is ~23 MB of memory-bound math that
    a learner applies every few steps. Same float32 operations, same bits, for any count.
    """
    delta = {}
    for k, new in theta.items():
        t, a = chunks.flat(new), chunks.flat(anchor[k])
        v = chunks.flat(sent[k]) if sent is not None else None
        d = np.empty(t.size, np.float32)

        def span(lo, hi, t=t, a=a, v=v, d=d):
            for c in chunks.slices(hi, lo):
                np.subtract(t[c], a[c], out=d[c], dtype=np.float32)
                if v is not None:
                    np.add(d[c], v[c], out=d[c])
            return []

        chunks.map_spans(span, t.size, threads)
        delta[k] = d.reshape(np.shape(new))
    return delta
