"""Why the syncer must not merge an offer: its envelope, its versions and counters, its payload.

Pure functions of the offer and the syncer's view of its learner; each returns a `Reason`
(None if good), which the syncer logs with the rejection and counts by its `kind`:
"envelope" (a field of the wrong type), "sender" (unknown learner, fragment not owned),
"incarnation", "base_version" (negative, or from the future), "stale", "counters" (c_steps
or c_tokens out of range), "tokens_per_step", "step" (past the run's steps, or further
ahead of the learner's reports than `SLOT_WINDOW` slots), "merged_work", "payload"
(undecodable, leaves, shapes, dtypes), "non_finite", "duplicate" (a merged offer delivered
again: dropped, its learner not told); `offer_scale.py` adds "norm".

What is plausible comes from the run's config (`RunBounds`) and from what the learner
reported: its join and heartbeats (`registry.LearnerInfo.step`) and its merged offers.
"""

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from decoupled_diloco.diloco import compression, merge


class Reason(NamedTuple):
    """Why a message is not acted on: `kind` is counted (summary.json), `text` is logged."""

    kind: str
    text: str


INTEGER_FIELDS = (
    "learner",
    "incarnation",
    "fragment",
    "step",
    "c_steps",
    "c_tokens",
    "base_version",
    "epoch",
    "nbytes",
)
MAX_TOKENS = 2**53  # c_tokens² must stay a finite float64 (a ceiling when no bound is known)
MAX_STEP = 2**53  # the step ceiling when the run's step count is not known
# Schedule slots an offer's step may be ahead of the last step its learner reported. A
# learner's messages arrive in order, and at each due step of any fragment it sends an
# offer or a heartbeat (heartbeats also go every `heartbeat_every` s), so an honest offer
# is at most about one slot (H steps) ahead; the window leaves room for a few messages
# rejected or dropped in between. An offer further ahead would push the fragment's covered
# slot forward and leave the other learners' offers without a round (K = 1 would wait for
# everyone) for as many slots.
SLOT_WINDOW = 4


@dataclasses.dataclass(frozen=True)
class RunBounds:
    """What the run's config makes plausible for any learner; 0 = not known (a syncer built
    without the run config: only the ceilings above apply)."""

    tokens_per_step: int = 0  # train.batch_size × data.seq_len: tokens in one learner step
    max_step: int = 0  # train.steps: no learner reports a step past it

    @property
    def step_ceiling(self) -> int:
        return self.max_step or MAX_STEP

    @property
    def tokens_ceiling(self) -> int:
        return self.tokens_per_step or MAX_TOKENS


def has_kind(v, kind: str) -> bool:
    """`v` is a "bool", an "int" (never a bool) or a "real" (a finite number, not a bool);
    numpy scalars count (the syncer keeps them as Python ones: messages.plain)."""
    if kind == "bool":
        return isinstance(v, bool | np.bool_)
    if isinstance(v, bool | np.bool_):
        return False
    if kind == "int":
        return isinstance(v, int | np.integer)
    return isinstance(v, int | float | np.integer | np.floating) and math.isfinite(v)


def check_envelope(offer) -> Reason | None:
    """The offer's integer fields, time and size are of their kinds."""
    for field in INTEGER_FIELDS:
        v = getattr(offer, field, None)
        if not has_kind(v, "int"):
            return Reason("envelope", f"{field} must be an integer, got {v!r}")
    t = getattr(offer, "time", None)  # (a string here failed the merge after Θ had moved)
    if not has_kind(t, "real"):
        return Reason("envelope", f"time must be a finite number, got {t!r}")
    if offer.nbytes < 0:
        return Reason("envelope", f"nbytes must be >= 0, got {offer.nbytes}")
    return None


def check_sender(offer, info, num_learners: int, owned) -> Reason | None:
    """The offer's envelope, learner, life and fragment (`info`: the registry entry or None).
    A learner that left may still offer: its final offers carry work its earlier offers did
    not."""
    reason = check_envelope(offer)
    if reason:
        return reason
    if not 0 <= offer.learner < num_learners or info is None:
        return Reason("sender", f"unknown learner {offer.learner}")
    if offer.incarnation != info.incarnation:
        why = f"incarnation {offer.incarnation} != current {info.incarnation}"
        return Reason("incarnation", why)
    if offer.fragment not in owned:
        return Reason("sender", f"fragment {offer.fragment} is not owned by this syncer")
    return None


def check_counters(
    offer, info, version: int, max_staleness: int, sync_every: int, merged, bounds: RunBounds
) -> Reason | None:
    """Versions, counters and step. `merged`: (incarnation, step, version) of this learner's
    latest merged offer of the fragment, or None."""
    if merged is not None and (merged[0], merged[1]) == (offer.incarnation, offer.step):
        # The offer it merged, delivered again (a link retrying a call that had reached
        # this syncer): nothing new in it, and nothing to tell its learner, whom the version
        # holding it tells. (A retry that reaches a restored syncer is of a lost epoch.)
        return Reason("duplicate", f"delivered again: its offer at step {offer.step} is in "
                      f"version {merged[2]}")  # fmt: skip
    base = offer.base_version
    if base < 0:
        return Reason("base_version", f"negative base version {base} (versions start at 0)")
    if base > version:
        return Reason("base_version", f"base version {base} is from the future (now {version})")
    if version - base > max_staleness:
        return Reason("stale", f"stale: base {base}, now {version}")
    # An offer holds at least one step of work and every step some tokens (a token-weighted
    # merge of offers without tokens has no weight to normalise).
    if not 1 <= offer.c_steps <= offer.step or not 1 <= offer.c_tokens <= MAX_TOKENS:
        return Reason(
            "counters",
            f"counters out of range: c_steps={offer.c_steps} (step {offer.step}; an offer holds "
            f"at least one step of work), c_tokens={offer.c_tokens} (at least one token)",
        )
    # Its weight in merges grows with tokens per step: no more than a step's batch can hold.
    # (Python ints: a numpy counter times a large ceiling would overflow.)
    if int(offer.c_tokens) > int(offer.c_steps) * bounds.tokens_ceiling:
        return Reason(
            "tokens_per_step",
            f"c_tokens={offer.c_tokens} in c_steps={offer.c_steps} is more than "
            f"{bounds.tokens_ceiling} tokens per step (train.batch_size x data.seq_len)",
        )
    if offer.step > bounds.step_ceiling:
        return Reason("step", f"step {offer.step} is past the run's {bounds.step_ceiling} steps")
    lead = sync_every * SLOT_WINDOW
    if offer.step > info.step + lead:
        return Reason(
            "step",
            f"step {offer.step} is from the future (learner reported {info.step}; an offer may "
            f"lead its learner's reports by {SLOT_WINDOW} slots, {lead} steps)",
        )
    # A learner offers again only after applying the version that holds its last merged
    # offer: anything else holds work Θ already has (it would count twice).
    same_life = merged is not None and merged[0] == offer.incarnation
    if same_life and (offer.step <= merged[1] or base < merged[2]):
        return Reason(
            "merged_work",
            f"holds work already merged (offer at step {merged[1]} is in version "
            f"{merged[2]}; this one: step {offer.step}, base {base})",
        )
    # ...so its work is the steps since that offer.
    if same_life and offer.c_steps > offer.step - merged[1]:
        return Reason(
            "counters",
            f"counters out of range: c_steps={offer.c_steps} at step {offer.step}, but its "
            f"offer at step {merged[1]} is merged already",
        )
    return None


def check_payload(offer, expected: dict) -> tuple[Reason | None, tuple[dict, dict] | None]:
    """Decodes the payload against the fragment's leaves: (reason, (arrays, ‖v‖² per leaf))."""
    try:
        arrays = compression.decode(offer.payload)
    except Exception as e:  # a malformed payload is a rejection, never a crash
        return Reason("payload", f"undecodable payload: {e!r}"), None
    if set(arrays) != set(expected):
        return Reason("payload", f"leaf names {sorted(arrays)[:3]}... do not match fragment"), None
    for k, v in arrays.items():
        if v.shape != expected[k].shape:
            return Reason("payload", f"{k}: shape {v.shape} != {expected[k].shape}"), None
        if v.dtype != np.float32:
            return Reason("payload", f"{k}: dtype {v.dtype} != float32"), None
    # ‖v‖² per leaf is the finiteness check (NaN/inf propagate into it; so does a float32
    # overflow, which RDA could not merge either: `chunks.sq_norm` dots rows of 4096 values
    # in float32, so a value above ~1.8e19 or a row of RMS above ~2.9e17) and, kept with
    # the offer, spares the merge one of RDA's read passes over the offers.
    sq_norms = merge.offer_sq_norms(arrays)
    for k, q in sq_norms.items():
        if not math.isfinite(q):
            return Reason("non_finite", f"{k}: non-finite values"), None
    return None, (arrays, sq_norms)
