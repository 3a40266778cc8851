"""The learner protocol without devices: how merges, drops and late versions are applied.

One protocol driven by hand: the test plays the syncer, writing `Merged` replies with their
vector clocks (tests/test_work_conservation.py runs many learners against a real syncer).
"""

import json

import numpy as np
import pytest
from protocol_sim import (
    SHAPES,
    NumpyReplica,
    initial_params,
    linear_update,
)

from decoupled_diloco.diloco import compression
from decoupled_diloco.diloco import learner as learner_mod
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragments import make_fragment_plan
from decoupled_diloco.diloco.learner import Learner, materialize
from decoupled_diloco.diloco.messages import Dropped, Heartbeat, Leave, Merged, Snapshot
from decoupled_diloco.runtime.boundary import HANDOVER_S, apply_updates, finish, step_boundary

H = 2


# --- one learner, the test plays the syncer --------------------------------------------
class Scripted:
    """Learner 0 with one fragment due every H = 2 steps; offers are materialised at once."""

    def __init__(self, **cfg):
        cfg = DilocoConfig(**{"learners": 1, "sync_every": H, "final_sync": False, **cfg})
        self.plan = make_fragment_plan(SHAPES, 1, "balanced", H)
        self.clock = {"t": 0.0}
        self.proto = Learner(0, cfg, self.plan, 64, lambda: self.clock["t"])
        self.theta0 = initial_params()
        self.replica = NumpyReplica(0, linear_update())
        self.replica.init_from_host(self.proto.start([Snapshot({0: 0}, self.theta0, 0.0)]))
        self.offers = []

    def step(self, inbox=()) -> None:
        self.replica.step()
        self.proto.stepped()
        for ticket in self.proto.due_offers():
            copies = self.replica.fragment_copies(self.plan.names[0])
            self.offers.append(materialize(ticket, copies))
        apply_updates(self.replica, self.proto.handle(list(inbox)))
        apply_updates(self.replica, self.proto.apply_due())

    def params(self) -> dict:
        return self.replica.host_params()


def reply(theta, version, held_step=None, method="none") -> Merged:
    """Version `version` of fragment 0; `held_step`: the step of our offer it holds."""
    clock = {} if held_step is None else {0: (0, held_step)}
    payload = compression.encode(theta, method)
    return Merged(0, version, payload, (), 0.0, merged=clock)


def moved(theta0: dict, seed: int, scale: float = 1e-2) -> dict:
    """A stand-in Θ_new: Θ_0 moved by other learners' work."""
    rng = np.random.default_rng(seed)
    return {k: (v + scale * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in theta0.items()}  # fmt: skip


def assert_close(a: dict, b: dict, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=atol, rtol=1e-6, err_msg=k)


def test_a_version_without_our_offer_rebases_and_keeps_all_local_work():
    s = Scripted()
    s.step()
    s.step()  # step 2: offers θ_2 (in flight)
    s.step()
    before, counters = s.params(), s.proto.unmerged_steps()
    theta1 = moved(s.theta0, seed=1)
    s.proto.handle([reply(theta1, 1)])  # someone else's merge: applied at once
    apply_updates(s.replica, s.proto.apply_due())
    assert_close(s.params(), {k: before[k] + theta1[k] - s.theta0[k] for k in before})
    assert s.proto.unmerged_steps() == counters == [3]
    assert s.proto.frags[0].version == 1
    assert s.proto.frags[0].in_flight is not None  # our offer is still on its way


def test_a_merge_of_our_offer_keeps_the_steps_taken_since_it():
    s = Scripted(overlap=1)
    s.step()
    s.step()  # step 2: offers θ_2
    theta_s = s.params()
    s.step()  # step 3: its merge may land now (s + τ)
    before = s.params()
    theta1 = moved(s.theta0, seed=2)
    s.proto.handle([reply(theta1, 1, held_step=2)])
    apply_updates(s.replica, s.proto.apply_due())
    assert_close(s.params(), {k: theta1[k] + before[k] - theta_s[k] for k in before})
    assert s.proto.unmerged_steps() == [1]  # step 3 is not in Θ_1 yet


def test_a_merge_of_our_offer_waits_for_the_overlap_steps():
    s = Scripted(overlap=1)
    s.step()
    theta1 = moved(s.theta0, seed=7)
    before = s.params()
    s.step(inbox=[])  # step 2: offers
    s.proto.handle([reply(theta1, 1, held_step=2)])
    assert s.proto.apply_due() == []  # step 2 < 2 + τ
    s.step()
    assert s.proto.frags[0].version == 1 and s.proto.unmerged_steps() == [1]
    del before


def test_merge_delay_counts_the_steps_from_each_offer_to_the_merge_applying_it():
    s = Scripted(overlap=1)
    s.step()
    s.step()  # step 2: offers
    s.step()  # step 3
    s.proto.handle([reply(moved(s.theta0, seed=3), 1, held_step=2)])
    apply_updates(s.replica, s.proto.apply_due())  # applied at step 3: 1 step after it
    assert (s.proto.delay_steps, s.proto.delays) == (1, 1)
    s.step()  # step 4: offers again
    s.proto.handle([reply(moved(s.theta0, seed=4), 2)])  # someone else's: not a round trip
    apply_updates(s.replica, s.proto.apply_due())
    assert (s.proto.delay_steps, s.proto.delays) == (1, 1)
    for _ in range(4):
        s.step()  # step 8: the reply to step 4's offer comes late
    s.proto.handle([reply(moved(s.theta0, seed=5), 3, held_step=4)])
    apply_updates(s.replica, s.proto.apply_due())
    assert (s.proto.delay_steps, s.proto.delays) == (1 + 4, 2)


def test_overwrite_mode_replaces_the_fragment():
    s = Scripted(apply="overwrite")
    for _ in range(3):
        s.step()
    theta1 = moved(s.theta0, seed=3)
    s.proto.handle([reply(theta1, 1, held_step=2)])
    apply_updates(s.replica, s.proto.apply_due())
    np.testing.assert_equal(s.params(), theta1)
    assert s.proto.unmerged_steps() == [0]


def test_tau_zero_merge_of_our_offer_is_an_exact_overwrite():
    s = Scripted()
    s.step()
    s.replica.step()  # step 2 by hand: offer, then its merge arrives before the boundary ends
    s.proto.stepped()
    (ticket,) = s.proto.due_offers()
    materialize(ticket, s.replica.fragment_copies(s.plan.names[0]))
    theta1 = moved(s.theta0, seed=4)
    s.proto.handle([reply(theta1, 1, held_step=2)])
    apply_updates(s.replica, s.proto.apply_due())
    np.testing.assert_equal(s.params(), theta1)
    assert s.proto.unmerged_steps() == [0]


def test_lossy_offers_keep_what_the_syncer_did_not_receive():
    # Error feedback: after a merge of a 1-bit offer, θ − Θ_new = v̂ − v.
    s = Scripted(compression="int1")
    s.step()
    s.step()  # offers v = Θ_0 − θ_2, int1-compressed
    theta_s = s.params()
    v = {k: s.theta0[k] - theta_s[k] for k in s.theta0}
    v_hat = compression.decode(s.offers[-1].payload)
    theta1 = moved(s.theta0, seed=5)
    s.proto.handle([reply(theta1, 1, held_step=2)])
    apply_updates(s.replica, s.proto.apply_due())
    after = s.params()
    assert_close({k: theta1[k] - after[k] for k in after}, {k: v[k] - v_hat[k] for k in v})
    assert max(float(np.abs(v[k] - v_hat[k]).max()) for k in v) > 1e-4  # int1 really is lossy


def test_one_offer_in_flight_a_due_fragment_waits_for_its_resolution():
    s = Scripted()
    s.step()
    s.step()  # step 2: offer in flight
    s.step()
    s.step()  # step 4: due again, but step 2's offer is unresolved
    assert len(s.offers) == 1
    s.proto.handle([Dropped(0, 0, 0, 2, "stale", 0.0)])  # the syncer will not merge it
    s.step()  # step 5: offered at once, with all 5 steps
    assert [o.step for o in s.offers] == [2, 5] and s.offers[-1].c_steps == 5


def test_older_versions_arriving_late_are_ignored():
    s = Scripted()
    s.step()
    s.step()
    theta1, theta2 = moved(s.theta0, seed=8), moved(s.theta0, seed=9)
    s.proto.handle([reply(theta2, 2, held_step=2), reply(theta1, 1)])  # out of order
    apply_updates(s.replica, s.proto.apply_due())
    assert s.proto.frags[0].version == 2
    np.testing.assert_equal(s.params(), theta2)  # v2 holds our step-2 offer (τ = 0)


def test_a_late_join_reply_of_the_same_syncer_life_is_a_version_not_a_new_life():
    # A learner's link retried its Join across a syncer restore: it started from the restored
    # syncer's announcement, offered, then the answer to its Join arrives (same epoch). It
    # must not forget its offer in flight: the next version holds it (chaos run: the
    # learner offered those steps again, was refused as merged work at every later offer).
    s = Scripted(overlap=1)
    s.step()
    s.step()  # step 2: offers θ_2 (in flight)
    theta_s = s.params()
    theta1, theta2 = moved(s.theta0, seed=11), moved(s.theta0, seed=12)
    s.proto.handle([Snapshot({0: 1}, theta1, 0.0, merged={0: {}})])  # epoch 0, like ours
    s.step()  # step 3: version 1 (without our offer) is applied, the offer is still ours
    assert s.proto.frags[0].version == 1 and s.proto.frags[0].in_flight is not None
    assert s.proto.unmerged_steps() == [3]
    before = s.params()
    s.proto.handle([reply(theta2, 2, held_step=2)])
    apply_updates(s.replica, s.proto.apply_due())
    assert s.proto.unmerged_steps() == [1]  # steps 1-2 are in version 2, step 3 is not
    assert_close(s.params(), {k: theta2[k] + before[k] - theta_s[k] - theta1[k]
                              + s.theta0[k] for k in before})  # fmt: skip
    # A reply to an even older Join: not newer than what we have, ignored.
    kept = s.params()
    apply_updates(s.replica, s.proto.handle([Snapshot({0: 1}, theta1, 0.0, merged={0: {}})]))
    apply_updates(s.replica, s.proto.apply_due())
    assert s.proto.frags[0].version == 2
    np.testing.assert_equal(s.params(), kept)


def test_a_drop_of_an_offer_to_a_lost_syncer_life_spares_its_re_offer():
    # The restored syncer drops our offer to its lost life (epoch 0) after we took its
    # snapshot and offered that work again at the same step (the final sync's step does not
    # advance): the drop is not about the new offer.
    s = Scripted()
    s.step()
    s.step()  # step 2: offer to epoch 0 in flight
    s.proto.handle([Snapshot({0: 0}, moved(s.theta0, seed=13), 0.0, epoch=1, merged={0: {}})])
    (again,) = s.proto.due_offers(final=True)
    assert (again.step, again.envelope.epoch) == (2, 1)
    s.proto.handle([Dropped(0, 0, 0, 2, "epoch 0: made before the syncer restore", 0.0, 0)])
    assert s.proto.frags[0].in_flight is again and s.proto.frags[0].refused == 0
    s.proto.handle([Dropped(0, 0, 0, 2, "off-scale", 0.0, 1)])  # a drop of the new one counts
    assert s.proto.frags[0].in_flight is None and s.proto.frags[0].refused == 1


def test_a_drop_of_an_offer_an_arrived_version_holds_does_not_offer_it_again():
    """A version holding our offer arrived (applied at s + τ); then a drop of that offer (a
    retrying link or a router refusing a copy the syncer merged). Taken as a refusal, the
    offer's steps stayed in W and were offered and merged a second time."""
    c = DilocoConfig(learners=1, sync_every=4, fragments=1, overlap=2)
    proto = Learner(0, c, make_fragment_plan(SHAPES, 1, "balanced", 4), 64, lambda: 0.0)
    theta0 = initial_params()
    proto.start([Snapshot({0: 0}, theta0, 0.0, epoch=0, merged={0: {}})])
    for _ in range(4):
        proto.stepped()
    (offer,) = proto.due_offers()  # step 4
    materialize(offer, {k: v + 1 for k, v in theta0.items()})
    proto.stepped()  # step 5 < 4 + τ: the version waits
    held = Merged(0, 1, compression.encode(theta0, "none"), (0,), 0.0, epoch=0,
                  merged={0: (0, 4)})  # fmt: skip
    proto.handle([held, Dropped(0, 0, 0, 4, "a copy refused", 0.0, epoch=0)])
    proto.stepped()  # step 6 = 4 + τ
    (update,) = proto.apply_due()
    assert update.rebase.sent is not None  # its work leaves W with the version
    assert proto.unmerged_steps() == [2] and proto.frags[0].refused == 0


def test_a_crash_after_a_syncer_restore_does_not_count_the_rolled_back_steps_again():
    """Learner 0's offers of steps 2 and 4 were merged and applied; the syncer restored
    version 1 (its clock holds step 2), rolling back the merge of step 4, whose steps 3-4
    `syncer_lost_steps` counts; the learner crashed at step 5, before any new merge. Its
    crash lost step 5 alone: it counted steps 3-5, going by the restored clock only."""
    from decoupled_diloco.runtime.learner_loop import LearnerLoop

    s = Scripted()
    theta1, theta2 = moved(s.theta0, seed=21), moved(s.theta0, seed=22)
    s.step()
    s.step()  # step 2: offers
    s.step(inbox=[reply(theta1, 1, held_step=2)])
    s.step(inbox=[])  # step 4: offers
    s.step(inbox=[reply(theta2, 2, held_step=4)])
    assert s.proto.frags[0].version == 2 and s.proto.merged_through() == [4]
    restored = Snapshot({0: 1}, theta1, 0.0, epoch=1, merged={0: {0: (0, 2)}})
    apply_updates(s.replica, s.proto.handle([restored]))
    assert s.proto.frags[0].version == 1
    assert s.proto.merged_through() == [4]  # a rollback does not lower it

    loop = LearnerLoop.__new__(LearnerLoop)  # only what a crash and its rejoin's cut touch
    loop.m, loop.step, loop.proto, loop.replica = 0, s.proto.step, s.proto, s.replica
    loop.outbox = loop.stager = loop.lives = loop.restored = loop.ckpt = None
    loop.incarnation, loop._counted, loop._crash_lost, loop.host = 0, {}, None, 0
    s.replica.drop = lambda: None
    loop._crash("crash")
    assert loop.proto is None and loop.away == "crash"
    assert loop._counted == {0: [(2, 4)]}  # the restore's
    loop._cut([restored])  # the rejoin meets Θ at the same restored version
    assert loop._crash_lost == (1, {"0": [[4, 5]]})
    assert loop._counted == {0: [(2, 5)]}


def test_a_resume_does_not_count_the_steps_an_earlier_crash_counted(tmp_path):
    """Learner 0 crashed at step 3 (its rejoin counted steps 1-3 lost) and at step 26,
    after its checkpoint of step 24 (counting 23-26); the run was killed and resumes that
    checkpoint against a syncer that holds none of its work (it had no checkpoint). The
    resume lost steps 4-22 (25-26 are trained again): it counted 1-24."""
    import types

    from decoupled_diloco import checkpoint
    from decoupled_diloco.runtime.learner_loop import LearnerLoop

    ckpt = checkpoint.Checkpointer(str(tmp_path / "learner_0"))
    data = {"host_index": 0, "position": 24}
    checkpoint.save_learner(ckpt, {"w": np.ones(3, np.float32)}, data, 24, 1)
    checkpoint.save_counted(ckpt, {0: [(0, 3), (22, 26)]})  # as the crashes counted
    loop = LearnerLoop.__new__(LearnerLoop)  # only what a restore and its cut touch
    events, positions = [], []
    loop.m, loop.step, loop.incarnation, loop.ckpt, loop.away = 0, 0, 0, ckpt, "start"
    loop.host = 0
    loop._counted, loop._crash_lost, loop.proto = {}, None, None
    loop.replica = types.SimpleNamespace(abstract_state=lambda: None)
    loop.sink = types.SimpleNamespace(event=events.append)
    loop.data = types.SimpleNamespace(set_state=positions.append)
    loop.clock = lambda: 0.0
    assert loop.restore(params_too=False)
    assert (loop.step, loop.incarnation, positions) == (24, 2, [data])
    assert loop._counted == {0: [(0, 3), (22, 24)]} == checkpoint.load_counted(ckpt)
    loop.restored = None
    loop._cut([Snapshot({0: 0}, initial_params(), 0.0, epoch=1, merged={0: {}})])
    (cut,) = events
    assert cut["event"] == "resume_cut" and cut["lost_steps"] == 19
    assert cut["lost_spans"] == {"0": [[3, 22]]}
    assert checkpoint.load_counted(ckpt) == {0: [(0, 24)]}  # kept for the next resume
    ckpt.close()


def test_a_member_rejoining_after_a_restore_does_not_count_its_rolled_back_steps(tmp_path):
    """Learner 0 left its membership at step 8, its offers merged; a syncer restore (which
    the learner, gone, never saw) rolled those merges back: `syncer_lost_steps` has steps
    1-8. Back in its window, its cut finds Θ lacking steps 1-8: it counted them again, as
    a resume's loss in a run that was never resumed."""
    from decoupled_diloco.runtime.accounting import Ledger
    from decoupled_diloco.runtime.learner_loop import LearnerLoop
    from decoupled_diloco.runtime.records import RunLog

    log = RunLog(str(tmp_path), Ledger(1, sync_every=H, fragments=1))
    s = Scripted()
    for version in range(1, 5):
        s.step()
        s.step()  # step 2k: offers; the syncer merges it, the learner applies it
        log.record({"event": "merge", "fragment": 0, "version": version, "learners": [0],
                    "c_steps": [2], "steps": [2 * version], "share": 1.0, "time": 1.0})  # fmt: skip
        s.proto.handle([reply(moved(s.theta0, seed=30 + version), version, held_step=2 * version)])
        apply_updates(s.replica, s.proto.apply_due(final=True))
    assert s.proto.merged_through() == [8] and s.proto.unmerged_steps() == [0]
    loop = LearnerLoop.__new__(LearnerLoop)
    loop.m, loop.step, loop.proto, loop.replica = 0, 8, s.proto, s.replica
    loop.outbox = loop.stager = loop.lives = loop.restored = loop.ckpt = None
    loop.incarnation, loop._counted, loop._crash_lost, loop.host = 0, {}, None, 0
    loop.sink, loop.clock = log, lambda: 2.0
    s.replica.drop = lambda: None
    loop._crash("leave")
    log.event({"event": "syncer_restore", "shard": 0, "versions": {"0": 0},
               "after_failure": True, "time": 1.5})  # fmt: skip
    loop._cut([Snapshot({0: 0}, s.theta0, 0.0, epoch=1, merged={0: {}})])
    assert log.ledger.syncer_lost_steps == 8
    assert log.ledger.resume_lost_steps == 0
    log.close()
    (cut,) = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()][1:]
    assert (cut["event"], cut["lost_steps"], cut["rolled_back_steps"]) == ("resume_cut", 0, 8)


def test_a_learner_leaving_without_offering_waits_for_its_offers_in_flight():
    """A learner whose last steps diverged offers nothing more, but its offer in flight may
    still be refused (its parameters were already NaN): it waits for the answer, so the
    steps that offer held are known to be unmerged (they were left out of the count)."""
    s = Scripted(final_sync=True, final_wait=60.0)
    for _ in range(3):
        s.step()  # step 2: offers (in flight); step 3
    (offer,) = s.offers
    replies = [[], [], [Dropped(0, 0, 0, 2, "not finite", 0.0, offer.epoch)]]

    class Link:
        sent = []

        def send(self, msg):
            self.sent.append(msg)

        def flush(self, timeout=0.0, deliver_timeout=None):
            return True

    def receive(timeout):
        s.clock["t"] += timeout
        return replies.pop(0) if replies else []

    finish(s.proto, s.replica, Link(), receive, lambda: s.clock["t"], offer_work=False)
    assert s.proto.in_flight() == [] and s.proto.unmerged_steps() == [3]
    assert all(isinstance(m, Heartbeat | Leave) for m in Link.sent)  # no offer made
    assert s.clock["t"] < 5.0


def test_step_time_estimate_leaves_out_the_compiling_first_step():
    """The heartbeat's step time (the syncer's grace window is built on it) must not carry
    the first step's compilation."""
    s = Scripted()
    s.proto.stepped()  # its interval to the next step holds the compilation
    s.clock["t"] += 30.0
    for _ in range(5):
        s.proto.stepped()
        s.clock["t"] += 0.5
    s.proto.stepped()
    assert s.proto.step_seconds == pytest.approx(0.5)


# --- refused offers: retries back off -----------------------------------------------------
def _drop_last(s: Scripted) -> None:
    o = s.offers[-1]
    s.proto.handle([Dropped(0, o.incarnation, o.fragment, o.step, "off-scale", 0.0)])


def test_offers_refused_in_a_row_are_retried_after_doubling_waits():
    """After the k-th refusal in a row a fragment sits out 2^(k-2) boundaries (at most H = 2
    here), telling the syncer its step at each; a merge of its offer resets the count."""
    s = Scripted()
    beats = []

    def step():
        s.step()
        beats.append(s.proto.heartbeat() is not None)

    step()
    step()  # step 2: offered (and the first heartbeat went out)
    _drop_last(s)  # first refusal: retried at the next boundary
    step()
    assert [o.step for o in s.offers] == [2, 3]
    _drop_last(s)  # second in a row: sits out 1 boundary
    step()
    assert len(s.offers) == 2 and beats[-1]  # its step still reaches the syncer
    step()
    assert [o.step for o in s.offers] == [2, 3, 5] and s.offers[-1].c_steps == 5
    _drop_last(s)  # third: 2 boundaries
    step()
    step()
    assert len(s.offers) == 3 and beats[-2:] == [True, True]
    step()
    assert s.offers[-1].step == 8
    _drop_last(s)  # fourth: 4, capped at H = 2 (the fragment's own schedule)
    for _ in range(2):
        step()
    step()
    assert s.offers[-1].step == 11
    # A merge of the offer ends the run of refusals: the next refusal is retried at once.
    s.proto.handle([reply(moved(s.theta0, seed=3), 1, held_step=11)])
    apply_updates(s.replica, s.proto.apply_due())
    step()  # step 12: due
    _drop_last(s)
    step()
    assert [o.step for o in s.offers][-2:] == [12, 13]


def test_a_refusal_streak_does_not_overflow_the_wait():
    s = Scripted()
    s.step()
    s.step()
    for _ in range(3000):  # hours of steady refusal: the wait stays capped
        f = s.proto.frags[0]
        f.sit_out = 0
        s.proto.due_offers(final=True)
        _drop_last_ticket(s)
    assert s.proto.frags[0].sit_out == H


def _drop_last_ticket(s: Scripted) -> None:
    t = s.proto.frags[0].in_flight
    s.proto.handle([Dropped(0, 0, 0, t.step, "off-scale", 0.0)])


class _RefusingSyncer:
    """Plays the syncer for `finish`: refuses the first `refusals` offers (all if None) at
    once, then merges the next one (a version holding it). Virtual clock: every receive
    costs 1 ms, or its whole timeout when nothing arrives."""

    def __init__(self, s: Scripted, refusals=None):
        self.s, self.refusals, self.inbox, self.offers = s, refusals, [], []
        self.link = self  # Outbox's link

    # outbox side
    def offer(self, ticket, copies) -> None:
        offer = materialize(ticket, copies)
        self.offers.append(offer)
        if self.refusals is None or len(self.offers) <= self.refusals:
            self.inbox.append(Dropped(0, offer.incarnation, offer.fragment, offer.step, "x", 0))
        else:
            theta = moved(self.s.theta0, seed=len(self.offers))
            self.inbox.append(reply(theta, len(self.offers), held_step=offer.step))

    def send(self, msg) -> None:
        pass

    def flush(self, timeout: float = 0.0, deliver_timeout: float | None = None) -> bool:
        return True

    def receive(self, timeout: float) -> list:
        out, self.inbox = self.inbox, []
        self.s.clock["t"] += 1e-3 if out else timeout
        return out


def _finish(refusals, final_wait: float) -> tuple[Scripted, _RefusingSyncer]:
    s = Scripted(final_sync=True, final_wait=final_wait)
    for _ in range(3):
        s.step()  # step 2's offer goes unanswered; step 3's work is unoffered
    syncer = _RefusingSyncer(s, refusals)
    s.proto.frags[0].in_flight = None  # the scripted offer was lost: only the finish counts
    s.proto.frags[0].wanted = True
    clock = lambda: s.clock["t"]  # noqa: E731
    finish(s.proto, s.replica, syncer, syncer.receive, clock)
    return s, syncer


def test_a_learner_whose_offers_are_always_refused_does_not_flood_the_final_sync():
    s, syncer = _finish(refusals=None, final_wait=60.0)
    # Each retry sits out up to H = 2 rounds of the final loop, each a 0.2 s wait for
    # replies: at most one offer per 0.4 s (the unbounded loop re-offered once per receive,
    # ~60k times in these 60 virtual seconds).
    assert len(syncer.offers) <= 5 + 60 / (0.2 * H)
    assert s.proto.unmerged_steps() == [3]  # its work is still its own


def test_the_final_sync_outlasts_refusals_until_its_work_is_merged():
    s, syncer = _finish(refusals=4, final_wait=60.0)
    assert len(syncer.offers) == 5
    assert s.proto.unmerged_steps() == [0]  # the fifth offer was merged: Θ holds all 3 steps
    assert s.clock["t"] < 2.0  # retries sat out 0, 1, 2, 2 rounds of 0.2 s, not final_wait


class _SlowLink(_RefusingSyncer):
    """Its replies never come and its flush never completes: a link too slow for the
    offers; records the timeout each flush was given."""

    def __init__(self, s: Scripted):
        super().__init__(s, refusals=0)
        self.flushes = []

    def offer(self, ticket, copies) -> None:
        self.offers.append(materialize(ticket, copies))

    def flush(self, timeout: float = 600.0, deliver_timeout: float | None = None) -> bool:
        self.flushes.append(deliver_timeout)
        return False


@pytest.mark.parametrize("final_wait", [0.0, 3.0])
def test_final_wait_also_bounds_the_wait_for_a_slow_link_to_deliver(final_wait):
    s = Scripted(final_sync=True, final_wait=final_wait)
    for _ in range(3):
        s.step()
    link = _SlowLink(s)
    clock = lambda: s.clock["t"]  # noqa: E731
    t0 = clock()
    assert finish(s.proto, s.replica, link, link.receive, clock) is False
    # The final sync waited out final_wait for replies, then gave the link the hand-over
    # time only (the unbounded flush gave it 600 s, and the link's own 600 s after that).
    assert clock() - t0 == pytest.approx(final_wait, abs=0.25)
    assert link.flushes == [HANDOVER_S]
    assert s.proto.unmerged_steps() == [3]
    # A learner leaving the membership (its outbox is dropped next) waits for the link.
    s.clock["t"] = t0
    finish(s.proto, s.replica, link, link.receive, clock, finished=False, bounded=False)
    assert link.flushes[-1] is None


class _SilentSyncer(_RefusingSyncer):
    """A syncer whose round never closes: no reply comes; records what the learner sends."""

    def __init__(self, s: Scripted):
        super().__init__(s, refusals=0)
        self.sent = []

    def offer(self, ticket, copies) -> None:
        self.offers.append(materialize(ticket, copies))

    def send(self, msg) -> None:
        self.sent.append(msg)

    def receive(self, timeout: float) -> list:
        assert self.s.clock["t"] < 100.0, "the wait never ended"
        self.s.clock["t"] += timeout
        return []


def test_a_learner_waiting_for_a_round_heartbeats_and_a_stop_ends_the_wait():
    """A synchronous learner (max_wait -1) whose merge does not come keeps heartbeating (it
    went silent, and after heartbeat_timeout the syncer dropped its offers as a dead
    learner's though it was waiting for them), and a stop (Ctrl-C) ends the wait with its
    offer still in flight (the first Ctrl-C could not stop a learner waiting forever)."""
    s = Scripted(max_wait=-1.0, heartbeat_every=1.0)
    syncer = _SilentSyncer(s)
    clock = lambda: s.clock["t"]  # noqa: E731
    for _ in range(2):
        s.replica.step()
        s.proto.stepped()
    waited = step_boundary(s.proto, s.replica, syncer, syncer.receive, clock,
                           stopping=lambda: clock() >= 10.0)  # fmt: skip
    assert len(syncer.offers) == 1 and s.proto.unresolved() == [0]
    assert waited == pytest.approx(10.0)
    beats = [msg.time for msg in syncer.sent if isinstance(msg, Heartbeat)]
    assert len(beats) >= 10 and max(np.diff(beats)) <= 1.0, beats


class _RestoredSyncer(_RefusingSyncer):
    """Plays a syncer that dies with the first final offer unmerged: its restored life
    announces itself (epoch 1, a snapshot without that offer), then merges the next one."""

    def __init__(self, s: Scripted):
        super().__init__(s)
        self.sent = []

    def offer(self, ticket, copies) -> None:
        offer = materialize(ticket, copies)
        self.offers.append(offer)
        self.sent.append("offer")
        theta = moved(self.s.theta0, seed=len(self.offers))
        if len(self.offers) == 1:
            self.inbox.append(Snapshot({0: 4}, theta, 0.0, epoch=1, merged={0: {}}))
        else:
            payload = compression.encode(theta, "none")
            clock = {0: (0, offer.step)}
            self.inbox.append(Merged(0, 5, payload, (0,), 0.0, epoch=1, merged=clock))

    def send(self, msg) -> None:
        self.sent.append(type(msg).__name__)


def test_the_final_sync_leaves_a_restored_syncer_again():
    # The restored syncer's checkpoint may not hold our Leave; the offer we make it would
    # confirm us live, and rounds that wait for everyone would wait for us (300 s).
    s = Scripted(final_sync=True, final_wait=60.0)
    for _ in range(3):
        s.step()
    syncer = _RestoredSyncer(s)
    s.proto.frags[0].in_flight, s.proto.frags[0].wanted = None, True
    finish(s.proto, s.replica, syncer, syncer.receive, lambda: s.clock["t"])
    assert syncer.sent == ["offer", "Leave", "Heartbeat", "Leave", "offer"]
    assert s.proto.unmerged_steps() == [0] and s.proto.resyncs == 1


def test_a_rebase_not_ready_is_deferred_a_bounded_number_of_boundaries():
    s = Scripted(overlap=0)
    s.step()
    s.step()  # step 2: offered
    s.proto.handle([reply(moved(s.theta0, seed=4), 1)])  # a version without our offer
    asked = []

    def not_ready(key):
        asked.append(key)
        return False

    for _ in range(learner_mod.DEFER_LIMIT):
        assert s.proto.apply_due(ready=not_ready) == []
    assert len(set(asked)) == 1  # the same update every time
    (update,) = s.proto.apply_due(ready=not_ready)  # the limit: applied (the caller waits)
    assert update.key == asked[0] and s.proto.frags[0].deferred == 0
    assert s.proto.apply_due(ready=not_ready) == []  # nothing left
    # Overwrites and the final boundary are never deferred.
    o = Scripted(apply="overwrite")
    o.step()
    o.step()
    o.proto.handle([reply(moved(o.theta0, seed=5), 1, held_step=2)])
    assert len(o.proto.apply_due(ready=not_ready)) == 1
    f = Scripted()
    f.step()
    f.proto.handle([reply(moved(f.theta0, seed=6), 1)])
    assert len(f.proto.apply_due(final=True, ready=not_ready)) == 1


def test_the_final_sync_applies_a_deferred_merge_before_its_final_offers():
    """A merge holding our offer was deferred at the last boundary (not placed yet): the
    final sync applies it first, so even with final_wait = 0 the steps after that offer are
    offered (else its offer looks in flight and they are never sent)."""
    s = Scripted(final_sync=True, final_wait=0.0, overlap=1)
    s.step()
    s.step()  # step 2: offered
    s.proto.handle([reply(moved(s.theta0, seed=7), 1, held_step=2)])
    s.replica.step()
    s.proto.stepped()  # step 3: the merge is due (τ = 1) but not placed yet
    assert s.proto.apply_due(ready=lambda key: False) == []
    syncer = _RefusingSyncer(s, refusals=0)
    finish(s.proto, s.replica, syncer, syncer.receive, lambda: s.clock["t"])
    assert [(o.step, o.c_steps) for o in syncer.offers] == [(3, 1)]
