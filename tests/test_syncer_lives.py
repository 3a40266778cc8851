"""A learner's lives and the rounds' pace: a restarted learner resumes its checkpoint, behind
where its previous life got, and the rounds must go on at the pace of the K-th fastest live
learner. Pure Syncer tests under a fake clock."""

import dataclasses
import json

import numpy as np

from decoupled_diloco.diloco import compression
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragments import make_fragment_plan
from decoupled_diloco.diloco.messages import Dropped, Heartbeat, Join, Merged, Offer
from decoupled_diloco.diloco.syncer import Syncer

SHAPES = {"embedder/input_embedding": (16, 8), "block_0/w": (8, 8)}
H = 4


def make_syncer(learners: int, quorum: int) -> Syncer:
    plan = make_fragment_plan(SHAPES, 1, "balanced", sync_every=H)
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    cfg = DilocoConfig(learners=learners, sync_every=H, quorum=quorum, grace_gamma=0.0)
    s = Syncer(cfg, plan, params)
    for m in range(learners):
        s.handle(Join(m, 0, 0.0), 0.0)
    return s


def offer(m: int, step: int, base: int, incarnation: int = 0) -> Offer:
    grads = {k: np.full(s, 0.01 * (m + 1), np.float32) for k, s in SHAPES.items()}
    return Offer(m, incarnation, 0, step, H, 64 * H, base, 0.0, compression.encode(grads, "none"))


def merges(out) -> list[Merged]:
    return [msg for _, msg in out if isinstance(msg, Merged)][:1]


def restored(s: Syncer, now: float) -> Syncer:
    """A new syncer from `s`'s checkpoint (its JSON part through JSON, as written)."""
    new = make_syncer(s.num_learners, s.cfg.quorum)
    meta = json.loads(json.dumps(s.meta_dict()))
    new.load_state_dict(s.state_dict(), meta, now)
    return new


def test_a_learner_restarted_behind_its_earlier_life_paces_rounds_from_where_it_is():
    """K = 1 of 3. Learner 2 runs ahead alone to slot 3 (step 12, reported step 13), crashes
    and restarts from its step-4 checkpoint as life 1. Its new life's offers stand for the
    slots of their own steps, and each passes the last one it (and no other live learner)
    reached: each merges at once, as K = 1 wants. (Before, the registry kept its earlier
    life's step 13, so its step-8 offer stood for slot 3, and the slot its earlier life
    reached held the rounds' pace there: nothing merged until every learner had an offer
    in, a K = M round.) A checkpoint taken after the rejoin restores the same pace."""
    for restore in (False, True):
        s = make_syncer(learners=3, quorum=1)
        for version, step in enumerate((4, 8, 12)):
            assert merges(s.handle(offer(2, step, base=version), 1.0 + version))
        s.handle(Heartbeat(2, 0, 13, 0.1, 4.0), 4.0)
        assert s.last_slot[0] == 3
        s.handle(Join(2, 1, 5.0, 4), 5.0)  # resumes its step-4 checkpoint
        assert s.registry.learners[2].step == 4
        if restore:
            s = restored(s, 5.5)
            s.handle(Heartbeat(2, 1, 4, 0.1, 5.6), 5.6)
            for m in (0, 1):
                s.handle(Heartbeat(m, 0, 4, 0.1, 5.6), 5.6)
        (m,) = merges(s.handle(offer(2, 8, base=3, incarnation=1), 6.0))
        assert m.learners == (2,) and m.steps == (8,) and s.last_slot[0] == 2
        (m,) = merges(s.handle(offer(2, 12, base=4, incarnation=1), 7.0))
        assert m.learners == (2,) and s.last_slot[0] == 3


def test_a_life_rejoining_at_its_own_step_keeps_its_reported_step():
    """The registry's step of a life is that life's: a Join of the same life again (a
    heartbeat after the syncer's restore, taken as its join) does not lower it."""
    s = make_syncer(learners=2, quorum=1)
    s.handle(Heartbeat(0, 0, 13, 0.1, 1.0), 1.0)
    s.registry.join(0, 0, 5, 64, 2.0, counted=True)
    assert s.registry.learners[0].step == 13
    s.registry.join(0, 1, 5, 64, 3.0, counted=True)  # a new life, from a step-5 checkpoint
    assert s.registry.learners[0].step == 5
    late = dataclasses.replace(offer(0, 8, base=0, incarnation=1), c_steps=3)
    assert s.slot(late) == 2  # its own step's slot, not that of step 13


def test_a_join_of_the_current_life_again_keeps_its_pending_offer():
    """K = M = 2. Learner 0's Join delivered again (a link retrying it) while its offer is
    pending: the offer is of this life, not an earlier one, so it stays and merges with
    learner 1's (voided unannounced, the learner would keep it in flight for good, never
    offer the fragment again, and every round would wait for it), and the life stays in
    the weights' roster. A new life's Join still voids the earlier life's offer."""
    s = make_syncer(learners=2, quorum=2)
    for m in (0, 1):
        s.handle(offer(m, 4, base=0), 1.0)
    assert s.version[0] == 1
    s.handle(offer(0, 8, base=1), 2.0)
    s.handle(Join(0, 0, 0.0, 0), 2.5)
    assert s.registry.learners[0].counted and 0 in s.registry.roster(2.5)
    (m,) = merges(s.handle(offer(1, 8, base=1), 3.0))
    assert m.learners == (0, 1) and m.steps == (8, 8)
    s.handle(offer(0, 12, base=2), 4.0)
    s.handle(Join(0, 1, 4.5, 12), 4.5)
    assert 0 not in s.pending[0]


def test_an_offer_a_new_life_voids_is_logged_as_dropped():
    """Learner 0's pending offer of life 0 is void once life 1 joins: it is never merged,
    and like every offer that will not be merged it is logged and counted with its reason
    (before, it vanished without a record: its steps were neither merged nor refused), and
    its learner, whose life is over, is not told."""
    s = make_syncer(learners=2, quorum=2)
    records = []
    s._emit = records.append
    s.handle(offer(0, 4, base=0), 1.0)
    out = s.handle(Join(0, 1, 1.5, 4), 1.5)
    assert not any(isinstance(msg, Dropped) for _, msg in out)
    (drop,) = [r for r in records if r["event"] == "drop_offer"]
    assert [drop[k] for k in ("learner", "step", "incarnation", "kind")] == [0, 4, 0, "new_life"]
    assert s.stats["drop_offer:new_life"] == 1 and s.stats["dropped_offers"] == 1
    # Life 1 began at slot 1's due step: the round does not wait for it.
    (m,) = merges(s.handle(offer(1, 4, base=0), 2.0))
    assert m.learners == (1,)
