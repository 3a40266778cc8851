"""Why the syncer must not merge an offer: its envelope, its versions and counters, its payload.

Pure functions of the offer and the syncer's view of its learner; each returns the reason
("" if good), which the syncer logs with the rejection.
"""

import math

import numpy as np

from decoupled_diloco.diloco import compression, merge

INTEGER_FIELDS = (
    "learner",
    "incarnation",
    "fragment",
    "step",
    "c_steps",
    "c_tokens",
    "base_version",
    "epoch",
)
MAX_TOKENS = 2**53  # c_tokens² must stay a finite float64
# Schedule slots an offer may be ahead of the last step its learner reported (join,
# heartbeats every ~0.5 s, offers): far more than a healthy learner gets ahead.
MAX_SLOT_LEAD = 64


def check_sender(offer, info, num_learners: int, owned) -> str:
    """The offer's learner, life and fragment (`info`: the registry entry or None). A learner
    that left may still offer: its final offers carry work its earlier offers did not."""
    for field in INTEGER_FIELDS:
        v = getattr(offer, field, None)
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            return f"{field} must be an integer, got {v!r}"
    if not 0 <= offer.learner < num_learners or info is None:
        return f"unknown learner {offer.learner}"
    if offer.incarnation != info.incarnation:
        return f"incarnation {offer.incarnation} != current {info.incarnation}"
    if offer.fragment not in owned:
        return f"fragment {offer.fragment} is not owned by this syncer"
    return ""


def check_counters(offer, info, version: int, max_staleness: int, sync_every: int, merged) -> str:
    """Versions, counters and step. `merged`: (incarnation, step, version) of this learner's
    latest merged offer of the fragment, or None."""
    if offer.base_version > version:
        return f"base version {offer.base_version} is from the future (now {version})"
    if version - offer.base_version > max_staleness:
        return f"stale: base {offer.base_version}, now {version}"
    if not 1 <= offer.c_steps <= offer.step or not 0 <= offer.c_tokens <= MAX_TOKENS:
        return (
            f"counters out of range: c_steps={offer.c_steps} (step {offer.step}), "
            f"c_tokens={offer.c_tokens}"
        )
    # A step far beyond what the learner last reported would push the fragment's
    # schedule slot ahead and starve later rounds of fresh offers.
    if offer.step > info.step + sync_every * MAX_SLOT_LEAD:
        return f"step {offer.step} is from the future (learner reported {info.step})"
    # A learner offers again only after applying the version that holds its last merged
    # offer: anything else holds work Θ already has (it would count twice).
    same_life = merged is not None and merged[0] == offer.incarnation
    if same_life and (offer.step <= merged[1] or offer.base_version < merged[2]):
        return (
            f"holds work already merged (offer at step {merged[1]} is in version "
            f"{merged[2]}; this one: step {offer.step}, base {offer.base_version})"
        )
    return ""


def check_payload(offer, expected: dict) -> tuple[str, tuple[dict, dict] | None]:
    """Decodes the payload against the fragment's leaves: (reason, (arrays, ‖v‖² per leaf))."""
    try:
        arrays = compression.decode(offer.payload)
    except Exception as e:  # a malformed payload is a rejection, never a crash
        return f"undecodable payload: {e!r}", None
    if set(arrays) != set(expected):
        return f"leaf names {sorted(arrays)[:3]}... do not match fragment", None
    for k, v in arrays.items():
        if v.shape != expected[k].shape:
            return f"{k}: shape {v.shape} != {expected[k].shape}", None
        if v.dtype != np.float32:
            return f"{k}: dtype {v.dtype} != float32", None
    # ‖v‖² per leaf is the finiteness check (NaN/inf propagate into it; so does a float32
    # overflow of values > ~1e19, which RDA could not merge either) and, kept with the
    # offer, spares the merge one of RDA's read passes over the offers.
    sq_norms = merge.offer_sq_norms(arrays)
    for k, q in sq_norms.items():
        if not math.isfinite(q):
            return f"{k}: non-finite values", None
    return "", (arrays, sq_norms)
