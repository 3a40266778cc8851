"""How large an offer's outer gradient may be: a robust running scale per fragment.

Finite poison (an offer of 1e15s) passes every type and finiteness check and would move Θ,
and every learner with it, by as much. So the syncer compares each offer's size with that
of the offers it recently accepted for the same fragment, and rejects one that is more
than `diloco.max_offer_norm_ratio` times larger (0 turns the check off).

Size: r = ‖v‖ / (√n · c_steps), the outer gradient's RMS per parameter (n in the fragment)
per step of work it holds. Per step, because an offer holds all of its learner's unmerged
work: by the triangle inequality one holding k rounds of work (a late learner, one whose
earlier offers were dropped) is at most k times as long as one round, so its r is no larger
than a single step's RMS. Scale: the median r of the last `HISTORY` offers accepted for
the fragment; a handful of off-scale offers cannot move it.

Honest r varies far less than the default ratio allows: AdamW moves each parameter by
about lr per step; a learner that restarted with fresh AdamW moments takes steps up to a
few times larger; an offer of a single step (a final offer) is up to √H times the per-step
RMS of an H-step offer whose steps partly cancel; the learning-rate warmup changes r by
the lr's growth over the few rounds the history spans. Measured: at most 3.5x the median
over configs/tiny_decoupled.py (300 steps, warmup included) and 4.3x in tests/test_chaos.py
(a learner crashes and rejoins with fresh moments, the syncer restores).

Before `MIN_HISTORY` offers of a fragment were accepted (a fresh syncer; the history is
checkpointed, so a restored one keeps it) there is no scale yet: an offer is then bounded
by ratio · max(RMS(Θ_p), 1) per step, a step as large as the parameters themselves times
the ratio, which no optimizer step comes near (so absurd values are still rejected).
"""

import collections
import math

import numpy as np

from decoupled_diloco.diloco.chunks import sq_norm
from decoupled_diloco.diloco.offer_checks import Reason

HISTORY = 16  # accepted offers per fragment whose median is the scale
MIN_HISTORY = 4  # offers before the median is trusted (the bootstrap bound until then)


class OfferScale:
    """The recent offers' sizes of every owned fragment; `ratio` 0 = off."""

    def __init__(self, ratio: float, fragments):
        self.ratio = ratio
        self.recent = {p: collections.deque(maxlen=HISTORY) for p in fragments}

    @staticmethod
    def size(sq_norms: dict, c_steps: int, n: int) -> float:
        """r: RMS per parameter and step of an offer with per-leaf ‖v‖² `sq_norms`."""
        return math.sqrt(sum(sq_norms.values()) / max(n, 1)) / max(c_steps, 1)

    def check(self, p: int, r: float, theta: dict) -> Reason | None:
        """Why an offer of size r is off fragment p's scale (None if it is not)."""
        if self.ratio <= 0:
            return None
        recent = self.recent[p]
        scale = float(np.median(recent)) if len(recent) >= MIN_HISTORY else 0.0
        if scale > 0:
            bound = self.ratio * scale
            against = f"the median of the last {len(recent)} accepted offers ({scale:.3g})"
        else:  # no scale yet (or only all-zero offers): bound by Θ's own size
            n = sum(v.size for v in theta.values())
            rms = math.sqrt(sum(sq_norm(v) for v in theta.values()) / max(n, 1))
            bound = self.ratio * max(rms, 1.0)
            against = f"max(RMS of the fragment {rms:.3g}, 1) (no scale of offers yet)"
        if not r <= bound:
            return Reason(
                "norm",
                f"outer gradient RMS per step {r:.3g} is more than "
                f"diloco.max_offer_norm_ratio={self.ratio:g} x {against}",
            )
        return None

    def add(self, p: int, r: float) -> None:
        """Records an accepted offer's size."""
        self.recent[p].append(float(r))

    # --- checkpoints (diloco/syncer_state.py) ------------------------------------------
    def to_json(self) -> dict:
        return {str(p): list(v) for p, v in self.recent.items()}

    def load_json(self, saved: dict) -> None:
        for p in self.recent:
            self.recent[p].clear()
            self.recent[p].extend(float(x) for x in saved.get(str(p), []))
