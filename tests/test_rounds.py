"""The syncer's schedule-slot rounds (which offers a merge holds) and the goodput ledger's
allocation rules. Pure Syncer / Ledger tests under a fake clock."""

import dataclasses

import numpy as np
import pytest

from decoupled_diloco import report
from decoupled_diloco.diloco import compression
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragments import make_fragment_plan
from decoupled_diloco.diloco.messages import Dropped, Heartbeat, Join, Leave, Merged, Offer
from decoupled_diloco.diloco.syncer import Syncer
from decoupled_diloco.runtime.accounting import Ledger

SHAPES = {"embedder/input_embedding": (16, 8), "block_0/w": (8, 8)}


def syncer(rounds="scheduled", quorum=1, learners=3, **kw):
    plan = make_fragment_plan(SHAPES, 1, "balanced", sync_every=4)
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    cfg = DilocoConfig(learners=learners, sync_every=4, quorum=quorum, grace_gamma=0.0,
                       rounds=rounds, **kw)  # fmt: skip
    s = Syncer(cfg, plan, params)
    for m in range(learners):
        s.handle(Join(m, 0, 0.0), 0.0)
    return s


def offer(learner: int, step: int, base: int = 0, c_steps: int = 4) -> Offer:
    grads = {k: np.full(s, 0.01 * (learner + 1), np.float32) for k, s in SHAPES.items()}
    return Offer(learner, 0, 0, step, c_steps, 64 * c_steps, base, 0.0,
                 compression.encode(grads, "none"))  # fmt: skip


def merged(out) -> list[Merged]:
    return [msg for _, msg in out if isinstance(msg, Merged)][:1]


def test_late_offers_wait_for_the_next_round_instead_of_merging_alone():
    s = syncer()
    assert merged(s.handle(offer(0, step=4), 1.0))  # slot 1 closes at once (K = 1)
    # Learner 1 is behind: its slot-1 offer arrives after the round closed. It waits...
    assert not merged(s.handle(offer(1, step=4), 2.0))
    assert s.version[0] == 1
    # ...and rides along with the next round, opened by a fresh slot-2 offer.
    (m,) = merged(s.handle(offer(0, step=8, base=1), 3.0))
    assert m.learners == (0, 1) and m.steps == (8, 4) and m.version == 2
    assert m.merged == {0: (0, 8), 1: (0, 4)}  # the fragment's vector clock


def test_eager_rounds_merge_every_late_offer_on_its_own():
    s = syncer(rounds="eager")
    assert merged(s.handle(offer(0, step=4), 1.0))
    (m,) = merged(s.handle(offer(1, step=4), 2.0))
    assert m.learners == (1,) and s.version[0] == 2


def test_late_offers_merge_when_every_live_learner_has_offered():
    s = syncer(learners=2)
    s.handle(offer(0, step=4), 1.0)
    s.handle(Join(0, 1, 1.5), 1.5)  # learner 0 restarts: drops out of the next round
    s.learners[0].joined = False  # ...and is not live yet
    # Learner 1's late offer is all there is to wait for: it merges below quorum.
    (m,) = merged(s.handle(offer(1, step=4), 2.0))
    assert m.learners == (1,)


def test_an_offer_repeating_merged_work_is_rejected_and_its_learner_told():
    s = syncer(learners=2)
    s.handle(offer(0, step=4), 1.0)  # merged into version 1
    # Learner 0's next offer made before it applied version 1 (base 0 < 1) would hold the
    # merged steps again.
    out = s.handle(offer(0, step=8, base=0), 2.0)
    assert s.version[0] == 1
    (notice,) = [msg for m, msg in out if isinstance(msg, Dropped)]
    assert (notice.learner, notice.step) == (0, 8) and "already merged" in notice.reason


def test_a_late_offer_does_not_open_a_round_or_eat_the_grace_window():
    plan = make_fragment_plan(SHAPES, 1, "balanced", sync_every=4)
    params = {k: np.zeros(v, np.float32) for k, v in SHAPES.items()}
    cfg = DilocoConfig(learners=3, sync_every=4, quorum=1, grace_gamma=1.0, max_grace=10.0,
                       overlap=2)  # fmt: skip
    s = Syncer(cfg, plan, params)
    for m in range(3):
        s.handle(Join(m, 0, 0.0), 0.0)
        s.handle(Heartbeat(m, 0, 1, 1.0, 0.0), 0.0)  # 1 s steps: grace budget τ·ξ = 2 s
    assert not merged(s.handle(offer(0, step=4), 1.0))  # quorum; grace runs until t = 3
    assert not merged(s.handle(offer(1, step=5), 1.5))
    (m,) = merged(s.tick(3.1))
    assert m.learners == (0, 1)
    # Learner 2's offer of the covered slot is late: it opens no round and adds no time to
    # quorum, but as the only offer the round missed it merges at once (a catch-up).
    (m,) = merged(s.handle(offer(2, step=4), 5.0))
    assert m.learners == (2,) and s.round_open[0] is None and s.last_slot[0] == 1
    assert not merged(s.handle(offer(0, step=8, base=1), 20.0))  # fresh: quorum at once
    assert s.grace_window() == pytest.approx(2.0, rel=0.2)  # no 15 s "time to quorum"
    (m,) = merged(s.tick(22.5))
    assert m.learners == (0,)


def test_late_offers_catch_up_once_every_learner_the_round_missed_is_in():
    s = syncer(learners=4)
    assert merged(s.handle(offer(0, step=4), 1.0))  # K = 1: learner 0 alone covers slot 1
    assert not merged(s.handle(offer(1, step=4), 1.1))  # late; learners 2, 3 still to come
    assert not merged(s.handle(offer(2, step=4), 1.2))
    (m,) = merged(s.handle(offer(3, step=4), 1.3))  # the last one: catch-up round
    assert m.learners == (1, 2, 3) and s.version[0] == 2


def test_a_lockstep_runs_final_offers_merge_as_one_round():
    """K = M: the final offers (steps after the last due step, in the slot just covered) are
    not a catch-up of a missed round: they wait until every live learner has offered."""
    s = syncer(learners=3, quorum=3)
    s.handle(offer(0, step=4), 1.0)
    s.handle(offer(1, step=4), 1.1)
    assert merged(s.handle(offer(2, step=4), 1.2))  # the last regular round, everyone in
    for m, t in ((2, 2.0), (0, 2.1)):  # each offers its last 2 steps, then leaves
        assert not merged(s.handle(offer(m, step=6, base=1, c_steps=2), t))
        assert not merged(s.handle(Leave(m, 0, t, finished=True), t))
    (m,) = merged(s.handle(offer(1, step=6, base=1, c_steps=2), 2.2))
    assert m.learners == (0, 1, 2) and s.version[0] == 2


def test_a_round_does_not_wait_for_a_life_that_began_at_its_slots_due_step():
    """K = M, learners waiting for every merge. Learner 0 crashes at step 8, where slot 2
    was due, with its slot-2 offer lost, and rejoins there: its first offer of the new life
    is slot 3's. The others' slot-2 offers merge without it (they waited for it, and it for
    them at its next due step: a synchronous run held forever). A life that began before
    the due step offers that slot: the round waits for it."""
    s = syncer(learners=3, quorum=3)
    for m in range(3):
        s.handle(offer(m, step=4), 1.0)
    assert s.version[0] == 1
    s.handle(Leave(0, 0, 2.0), 2.0)  # its runtime saw it fail
    s.handle(Join(0, 1, 2.5, 8), 2.5)
    assert not merged(s.handle(offer(1, step=8, base=1), 3.0))  # learner 2 is still to come
    (m,) = merged(s.handle(offer(2, step=8, base=1), 3.1))
    assert m.learners == (1, 2) and s.version[0] == 2
    # A life that began at step 7 offers slot 2 at step 8: its round waits for it.
    s = syncer(learners=3, quorum=3)
    for m in range(3):
        s.handle(offer(m, step=4), 1.0)
    s.handle(Leave(0, 0, 2.0), 2.0)
    s.handle(Join(0, 1, 2.5, 7), 2.5)
    for m in (1, 2):
        assert not merged(s.handle(offer(m, step=8, base=1), 3.0 + m))
    assert s.waits_for(0, set(s.live(4.0))) == {0}
    # Offers of several slots pending: a life that began between their due steps offers
    # the highest one, and is waited for. K = 2 of 4: B and C covered slot 1; A's slot-1
    # offer is late (D has not offered: no catch-up); B restarts at step 6; C's slot-2 and
    # D's late slot-1 offer are in: the round waits for B's slot-2 offer.
    s = syncer(learners=4, quorum=2)
    for m in (1, 2):
        s.handle(offer(m, step=4), 1.0)
    assert s.version[0] == 1
    assert not merged(s.handle(offer(0, step=4), 1.5))
    s.handle(Leave(1, 0, 2.0), 2.0)
    s.handle(Join(1, 1, 2.5, 6), 2.5)
    assert not merged(s.handle(offer(2, step=8, base=1), 3.0))
    assert not merged(s.handle(offer(3, step=4), 3.1))
    restarted = dataclasses.replace(offer(1, step=8, base=1, c_steps=2), incarnation=1)
    (m,) = merged(s.handle(restarted, 3.2))
    assert m.learners == (0, 1, 2, 3)
    # Slot 0 of a fragment at offset 0 has no due step (only final offers stand for it,
    # in a run shorter than H): every founding learner offers it, one round merges them.
    s = syncer(learners=3, quorum=3)
    for m, t in ((0, 1.0), (1, 1.1)):
        assert not merged(s.handle(offer(m, step=3, c_steps=3), t))
    (m,) = merged(s.handle(offer(2, step=3, c_steps=3), 1.2))
    assert m.learners == (0, 1, 2)
    # A life admitted from a heartbeat (its Join missed) may have begun before the slot.
    s = syncer(learners=3, quorum=3)
    s.handle(Leave(0, 0, 1.0), 1.0)
    s.handle(Heartbeat(0, 1, 8, 0.1, 2.0), 2.0)
    info = s.registry.learners[0]
    assert (info.incarnation, info.joined, info.joined_at) == (1, True, -1)


def test_a_round_covers_the_slot_the_kth_fastest_reached():
    """With K = 2 a learner two slots ahead must not make the others' next offers stale."""
    s = syncer(learners=3, quorum=2)
    s.handle(offer(0, step=12), 1.0)  # learner 0 is far ahead: slot 3
    (m,) = merged(s.handle(offer(1, step=4), 2.0))  # K = 2 fresh offers: slots 3 and 1
    assert s.last_slot[0] == 1
    s.handle(offer(2, step=8), 3.0)  # slot 2 is fresh: quorum needs one more
    (m,) = merged(s.handle(offer(1, step=8, base=1), 4.0))
    assert set(m.learners) == {1, 2}


def test_when_the_learner_that_paced_the_rounds_leaves_the_others_pace_them():
    """K = 1, three learners. Learner 0 runs ahead to slot 3 and leaves (it finished its
    steps, or crashed): no offer of the others can pass its slot. They must pace the rounds
    themselves from then on, an offer past their own merged slots merging at once, not
    wait in catch-up rounds, which wait for every live learner (the run's end at the
    slowest learner's pace, and while a fast learner was down)."""
    s = syncer(learners=3)
    assert merged(s.handle(offer(0, step=4), 1.0))  # slot 1, learner 0 alone
    assert not merged(s.handle(offer(1, step=4), 1.1))
    (m,) = merged(s.handle(offer(2, step=4), 1.2))  # catch-up: both late ones in
    assert m.learners == (1, 2)
    for step, t in ((8, 2.0), (12, 3.0)):  # learner 0 alone covers slots 2 and 3
        assert merged(s.handle(offer(0, step=step, base=s.version[0]), t))
    assert not merged(s.handle(Leave(0, 0, 3.5, finished=True), 3.5))
    (m,) = merged(s.handle(offer(1, step=8, base=s.version[0]), 4.0))  # slot 2: fresh again
    assert m.learners == (1,)
    # Learner 2's slot-2 offer missed that round: it catches up at once (learner 1 was in
    # the last round, no other live learner is missing).
    (m,) = merged(s.handle(offer(2, step=8, base=s.version[0]), 4.1))
    assert m.learners == (2,)


def test_a_life_announced_twice_leaves_once_and_a_finished_one_stays_finished():
    """A restarted Ray process announces the life its predecessor died in, which the driver
    may have announced already (a scheduled crash), or which had finished: the repeat
    changes nothing and records nothing; only `finished` can still become true."""
    events = []
    s = syncer(learners=3)
    s._emit = events.append
    for m, finished in ((0, False), (0, False), (1, True), (1, False)):
        s.handle(Leave(m, 0, 1.0, finished=finished), 1.0)
    assert [(e["event"], e["learner"], e["finished"]) for e in events] == [
        ("leave", 0, False), ("leave", 1, True)]  # fmt: skip
    assert s.registry.live(1.0) == [2] and s.registry.learners[1].finished
    s.handle(Leave(0, 0, 2.0, finished=True), 2.0)  # it finished after all: recorded
    assert events[-1]["finished"] and s.registry.learners[0].finished
    # A later life's Leave (one that died before its Join arrived) ends the registered
    # life too; once more, or for a life the registry does not hold, nothing happens.
    n = len(events)
    for msg in (Leave(2, 3, 3.0), Leave(2, 4, 3.0), Leave(2, 1, 3.0), Leave(0, 7, 3.0)):
        s.handle(msg, 3.0)
    assert [(e["event"], e["learner"]) for e in events[n:]] == [("leave", 2)]
    assert s.registry.live(3.0) == [] and s.registry.learners[2].incarnation == 0


def test_the_rounds_pace_is_unchanged_while_the_learner_that_set_it_is_live():
    """Learner 0's slot-1 offer stands for slot 2 (it has reported step 9: its next offer
    waits for this one), so its round covers slot 2; learner 1's slot-2 offer is then late
    and waits, as it would without the rule for departed pacers (merged offers' slots are
    taken as they stood, not from their steps)."""
    s = syncer(learners=3)
    s.handle(Heartbeat(0, 0, 9, 0.1, 0.9), 0.9)
    assert merged(s.handle(offer(0, step=4), 1.0)) and s.last_slot[0] == 2
    assert not merged(s.handle(offer(1, step=8), 2.0))
    assert s.version[0] == 1


def test_partial_merges_move_theta_by_their_share_of_the_roster():
    rng = np.random.default_rng(1)
    v = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    moved = {}
    for normalize in ("roster", "merged"):
        s = syncer(learners=4, normalize=normalize, merge="mean", embedding_merge="mean",
                   outer_lr=1.0, outer_momentum=0.0)  # fmt: skip
        before = {k: x.copy() for k, x in s.global_params().items()}
        o = Offer(0, 0, 0, 4, 4, 256, 0, 0.0, compression.encode(v, "none"))
        s.handle(o, 1.0)
        moved[normalize] = {k: before[k] - s.global_params()[k] for k in v}
    for k in v:  # one learner of four: a quarter of its outer gradient, or all of it
        np.testing.assert_allclose(moved["roster"][k], v[k] / 4, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(moved["merged"][k], v[k], rtol=1e-5, atol=1e-6)


def test_a_learner_joining_a_running_run_counts_in_the_roster_from_its_first_offer():
    """Learners 0 and 1 found the run; learner 2 joins after the first merge. Until its
    first offer its work is not reaching Θ, so learner 0's merges move Θ by half its outer
    gradient (a third if the joiner counted from its Join); after it, by a third. The same
    holds across a syncer restore, and a rejoin after the first merge starts uncounted."""
    plan = make_fragment_plan(SHAPES, 1, "balanced", sync_every=4)
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    cfg = DilocoConfig(learners=3, sync_every=4, quorum=1, grace_gamma=0.0, merge="mean",
                       embedding_merge="mean", weights="uniform", outer_lr=1.0,
                       outer_momentum=0.0)  # fmt: skip
    s = Syncer(cfg, plan, params)
    for m in (0, 1):
        s.handle(Join(m, 0, 0.0), 0.0)

    def moved(o: Offer, now: float) -> float:  # in units of learner 0's outer gradient
        before = s.global_params()["block_0/w"].copy()
        assert merged(s.handle(o, now))
        return float((before - s.global_params()["block_0/w"]).mean()) / 0.01

    assert moved(offer(0, step=4), 1.0) == pytest.approx(1 / 2)
    s.handle(Join(2, 0, 2.0), 2.0)
    assert s.registry.roster(2.5) == [0, 1]
    assert moved(offer(0, step=8, base=1), 3.0) == pytest.approx(1 / 2)
    s.handle(offer(2, step=4, base=2), 4.0)  # slot 1: rides along with the next round
    assert s.registry.roster(4.0) == [0, 1, 2]
    assert moved(offer(0, step=12, base=2), 5.0) == pytest.approx((1 + 3) / 3)
    assert moved(offer(0, step=16, base=3), 6.0) == pytest.approx(1 / 3)

    restored = Syncer(cfg, plan, params)  # the roster survives a syncer checkpoint
    restored.load_state_dict(s.state_dict(), s.meta_dict(), 6.0)
    assert restored.registry.roster(6.0) == [0, 1, 2]
    s.handle(Join(2, 1, 7.0), 7.0)  # a restarted learner: counted again from its offer
    assert s.registry.roster(7.0) == [0, 1]
    restored.load_state_dict(s.state_dict(), s.meta_dict(), 7.0)
    assert restored.registry.roster(7.0) == [0, 1]
    s.handle(Leave(2, 1, 7.5, finished=True), 7.5)  # finished with no work offered
    assert s.registry.roster(8.0) == [0, 1]


def test_time_spent_evaluating_is_not_allocated_training_time():
    def goodput(idle: float) -> float:
        ledger = Ledger(1)
        for i in range(10):
            ledger.step(0, 1.0, now=1.0 + i + (idle if i >= 5 else 0.0))
        ledger.idle(0, idle)
        ledger.finish(0, 10.0 + idle)
        return ledger.summary(10.0 + idle, uses_syncer=False, learner_steps=[10])["goodput"]

    assert goodput(0.0) == pytest.approx(1.0)
    assert goodput(4.0) == pytest.approx(1.0)  # a 4 s evaluation mid-run costs no goodput


def test_allocation_ends_when_training_ends_not_after_the_tail():
    ledger = Ledger(1)
    for i in range(10):
        ledger.step(0, 1.0, now=1.0 + i)
    ledger.finish(0, 10.0)  # last step done: final offers and checkpoint follow
    ledger.finish(0, 13.0)  # the runtime's final report after its 3 s tail
    summary = ledger.summary(13.0, uses_syncer=False, learner_steps=[10])
    assert summary["goodput"] == pytest.approx(1.0)


def test_mean_offer_steps_is_the_work_per_merged_offer():
    ledger = Ledger(2, sync_every=4)
    base = {"fragment": 0, "share": 1.0}
    ledger.merge({**base, "learners": [0, 1], "c_steps": [4, 4], "time": 1.0,
                  "offer_seconds": [0.5, 0.25]})  # fmt: skip
    ledger.merge({**base, "learners": [1], "c_steps": [10], "time": 2.0,  # waited twice
                  "offer_seconds": [1.5]})  # fmt: skip
    summary = ledger.summary(3.0, uses_syncer=True, learner_steps=[4, 14])
    assert summary["mean_offer_steps"] == 6
    assert summary["mean_offer_seconds"] == pytest.approx(0.75)


def test_mean_merge_delay_weights_each_row_by_the_merges_it_covers():
    ledger = Ledger(2, sync_every=4)
    ledger.row({"learner": 0, "step": 10, "merge_delay_steps": 2.0, "merges_held": 3})
    ledger.row({"learner": 1, "step": 10, "merge_delay_steps": 10.0, "merges_held": 1})
    ledger.row({"learner": 1, "step": 20, "loss": 1.0})  # no merge held an offer
    summary = ledger.summary(3.0, uses_syncer=True, learner_steps=[10, 20])
    assert summary["mean_merge_delay_steps"] == pytest.approx(4.0)  # (3·2 + 10) / 4
    rows = [{"merge_delay_steps": 2.0, "merges_held": 3}, {"merge_delay_steps": 10.0,
            "merges_held": 1}, {"loss": 1.0}]  # fmt: skip
    assert report.mean_merge_delay(rows) == pytest.approx(4.0)
    assert report.mean_merge_delay([{"loss": 1.0}]) is None


def test_a_round_opened_by_a_waiting_offer_turning_fresh_has_no_negative_quorum_wait():
    """A late offer waits; once its learner reports a later slot it counts for that slot,
    reaches the quorum and opens the round then. An offer arriving during the grace window
    does not reopen it (that made quorum_wait negative in merge records)."""
    plan = make_fragment_plan(SHAPES, 1, "balanced", sync_every=4)
    params = {k: np.zeros(v, np.float32) for k, v in SHAPES.items()}
    cfg = DilocoConfig(learners=4, sync_every=4, quorum=1, grace_gamma=1.0, max_grace=10.0,
                       overlap=2)  # fmt: skip
    records = []
    s = Syncer(cfg, plan, params, record=records.append)
    for m in range(4):
        s.handle(Join(m, 0, 0.0), 0.0)
        s.handle(Heartbeat(m, 0, 1, 1.0, 0.0), 0.0)  # 1 s steps: grace budget τ·ξ = 2 s
    s.handle(offer(0, step=4), 1.0)
    assert merged(s.tick(3.1))  # slot 1: learner 0 alone
    assert not merged(s.handle(offer(1, step=4), 4.0))  # late for slot 1: waits
    s.handle(Heartbeat(1, 0, 8, 1.0, 5.0), 5.0)  # learner 1 reached slot 2
    s.tick(5.0)  # its waiting offer is fresh now: quorum, the round opens
    assert not merged(s.handle(offer(0, step=8, base=1), 6.0))  # within the grace window
    (m,) = merged(s.tick(7.5))
    assert m.learners == (0, 1)
    rec = [r for r in records if r.get("event") == "merge"][-1]
    assert rec["quorum_wait"] == pytest.approx(0.0) and rec["grace"] == pytest.approx(2.5)


def test_merge_records_say_how_long_each_offer_took_to_merge():
    """`offer_seconds`: from each offer's making (its `time`) to the merge holding it."""
    plan = make_fragment_plan(SHAPES, 1, "balanced", sync_every=4)
    params = {k: np.zeros(v, np.float32) for k, v in SHAPES.items()}
    records = []
    s = Syncer(DilocoConfig(learners=2, sync_every=4, quorum=2), plan, params,
               record=records.append)  # fmt: skip
    for m in range(2):
        s.handle(Join(m, 0, 0.0), 0.0)
    s.handle(dataclasses.replace(offer(0, step=4), time=0.25), 0.5)
    (m,) = merged(s.handle(dataclasses.replace(offer(1, step=4), time=0.5), 1.0))
    (rec,) = [r for r in records if r.get("event") == "merge"]
    assert m.learners == (0, 1) and rec["offer_seconds"] == pytest.approx([0.75, 0.5])


def test_offers_that_queued_together_merge_in_one_round():
    """The syncer loop hands a batch of messages to `handle_batch`: every offer in it is
    accepted before rounds close, so offers that queued while the syncer was busy join one
    merge per fragment instead of each closing a round of its own (as `handle` one message
    at a time would, with K = 1 and no grace)."""
    one_by_one = syncer()
    out = [
        m for o in (offer(0, step=4), offer(1, step=4)) for m in merged(one_by_one.handle(o, 1.0))
    ]
    assert [m.learners for m in out] == [(0,)] and one_by_one.version[0] == 1  # 1 waits
    batched = syncer()
    clock = iter([1.0, 1.0, 1.0])
    (m,) = merged(batched.handle_batch([offer(0, step=4), offer(1, step=4)], lambda: next(clock)))
    assert m.learners == (0, 1) and batched.version[0] == 1
    # Only closing rounds waits for the batch's end: a Join in it is answered at once.
    s = syncer(learners=4)
    later = iter([2.0] * 3)
    out = s.handle_batch([offer(0, step=4), Join(3, 1, 2.0)], lambda: next(later))
    assert [type(msg).__name__ for _, msg in out].count("Snapshot") == 1
    assert merged(out) and s.version[0] == 1


def test_a_round_whose_offers_are_void_starts_afresh():
    """A Join of a new life voids the learner's pending offer; when that was the round's
    only offer, the round is gone: the next offer's quorum wait starts at that offer, not at
    the void one (else the grace window's quorum estimate takes the gap as a wait)."""
    s = syncer(learners=2, overlap=1, max_grace=5.0)
    s.grace.gamma = 1.0
    s.grace.step.update(1.0)
    s.handle_batch([offer(0, step=4), Join(0, 1, 10.0)], lambda: 10.0)
    assert s.round_open[0] is None and s.quorum_at[0] is None and s.next_deadline() is None
    window = s.grace_window()
    s.handle(offer(1, step=4), 110.0)
    assert s.grace.quorum.value < 1.0 and s.grace_window() == pytest.approx(window)


def test_a_round_that_loses_its_quorum_waits_its_grace_again_once_it_is_regained():
    """K = 2 of 3: learners 0 and 1 offer (quorum), then learner 0's new life (restored at
    step 2, before the slot's due step: the round still waits for it) voids its offer. The
    round kept its quorum time: its deadline stayed in the past (the syncer's loop, which
    waits on its inbox until the next deadline, spun) and, regained, it merged at once."""
    s = syncer(learners=3, quorum=2, overlap=2, max_grace=5.0)
    s.grace.gamma = 1.0
    s.grace.step.update(1.0)  # 1 s steps: a grace window of τ·1 s = 2 s
    assert not merged(s.handle_batch([offer(0, step=4), offer(1, step=4)], lambda: 1.0))
    assert s.quorum_at[0] == 1.0 and s.next_deadline() == pytest.approx(3.0)
    assert not merged(s.handle_batch([Join(0, 1, 2.0, 2)], lambda: 2.0))
    assert s.quorum_at[0] is None and s.next_deadline() is None
    assert not merged(s.tick(5.0)) and s.next_deadline() is None
    assert not merged(s.handle(offer(2, step=4), 10.0))  # regained: grace until t = 12
    assert s.next_deadline() == pytest.approx(12.0, abs=0.1)
    assert not merged(s.tick(11.8))
    (m,) = merged(s.tick(12.2))
    assert m.learners == (1, 2)


def test_an_offer_arriving_after_the_newer_one_of_its_life_does_not_replace_it():
    """A newer offer of a life holds the older one's work; delivered the other way round
    (a retried call), the older one replaced it and the steps between were lost."""
    s = syncer(quorum=2)
    s.handle(offer(0, step=8, c_steps=8), 1.0)
    out = s.handle(offer(0, step=4), 2.0)
    assert s.pending[0][0][0].step == 8 and not [m for m in out if isinstance(m[1], Dropped)]
    assert s.refusals.stats["drop_offer:duplicate"] == 1
    (m,) = merged(s.handle(offer(1, step=8, c_steps=8), 3.0))
    assert m.steps == (8, 8)


def test_what_theta_holds_of_a_learners_earlier_life_survives_its_rejoin_and_a_restore():
    """After learner 1's crash and rejoin, until its new life's first merge, Θ still holds
    its earlier life's steps: the fragment's clock (and so every snapshot and checkpoint)
    says so. A restore in that window must not report that work lost (or have it trained
    again by a learner resumed from an older checkpoint)."""
    s = syncer(quorum=1, learners=2)
    assert merged(s.handle(offer(1, step=4), 1.0))
    assert s.clock(0)[1] == (0, 4)
    (_, snap), *_ = s.handle(Join(1, 1, 2.0), 2.0)  # a new life of learner 1
    assert snap.merged[0][1] == (0, 4)
    restored = syncer(quorum=1, learners=2)
    restored.load_state_dict(s.state_dict(), s.meta_dict(), 3.0)
    assert restored.clock(0)[1] == (0, 4)
    assert restored.snapshot(3.0).merged[0][1] == (0, 4)


def test_a_waiting_learners_heartbeats_do_not_weigh_the_grace_step_time():
    """A learner that waits (for a merge, its data, the final sync) repeats its last step
    time in every heartbeat; only a heartbeat after new steps is a new measurement."""
    s = syncer(learners=2)
    s.handle(Heartbeat(0, 0, 5, 1.0, 0.0), 0.0)  # learner 0: 1 s steps
    s.handle(Heartbeat(1, 0, 5, 3.0, 0.0), 0.0)  # learner 1: 3 s steps
    before = s.grace.step.get()
    for t in range(1, 20):  # learner 1 waits at step 5 and keeps beating
        s.handle(Heartbeat(1, 0, 5, 3.0, float(t)), float(t))
    assert s.grace.step.get() == before
    s.handle(Heartbeat(1, 0, 6, 3.0, 20.0), 20.0)  # it stepped: a new measurement
    assert s.grace.step.get() > before
    moved = s.grace.step.get()
    s.handle(Join(1, 1, 21.0, 5), 21.0)  # a new life, restored at step 5, is timed anew
    s.handle(Heartbeat(1, 1, 5, 2.0, 22.0), 22.0)
    assert s.grace.step.get() != moved
