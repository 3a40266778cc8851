"""Scheduled rounds (diloco.rounds = "scheduled"): which schedule slot an offer stands for,
when offers that missed a round catch up, and which slot a closed round covers. Pure
functions of the syncer's bookkeeping (diloco/syncer.py calls them)."""

from decoupled_diloco.diloco.fragments import FragmentPlan


def offer_slot(plan: FragmentPlan, offer, reported: tuple[int, int] | None) -> int:
    """The slot an offer stands for: that of its step, or, if its learner has since reported
    (`reported`: its (incarnation, step)) a step past its next due step (its next offer waits
    for this one to be merged: one offer in flight per fragment), that later slot."""
    step = offer.step
    if reported is not None and reported[0] == offer.incarnation:
        step = max(step, reported[1])
    return plan.slot(offer.fragment, step)


def current(plan: FragmentPlan, p: int, merged_into: dict, last_slot: int) -> set[int]:
    """Learners whose latest merged offer of fragment p is in the slot the last round covered
    (`merged_into`: learner -> (incarnation, step, version))."""
    return {m for m, (_, step, _) in merged_into.items() if plan.slot(p, step) >= last_slot}


def catch_up(pending: set[int], live: set[int], current_: set[int]) -> bool:
    """Whether pending offers, none fresh, merge now instead of a slot later: some are from
    learners that missed the last round, and every live learner is either pending or was in
    it. Offers of learners that were in it (final offers: the steps after their last due
    step) wait for a round, so that a lockstep run's final sync is one merge."""
    return bool(pending - current_) and live <= pending | current_


def covered_slot(slots: list[int], last_slot: int, quorum: int, eager: bool) -> int:
    """The slot a round holding offers of `slots` covers: the K-th highest fresh slot (the
    lowest if the round closed with fewer fresh offers, every live learner being in); eager
    rounds: the highest."""
    if eager:
        return max([last_slot, *slots])
    fresh = sorted((s for s in slots if s > last_slot), reverse=True)
    if not fresh:
        return last_slot
    return fresh[quorum - 1] if len(fresh) >= quorum else fresh[-1]
