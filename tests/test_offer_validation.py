"""Offer validation: bad offers are rejected with a reason, counted, and never merged.

Pure Syncer unit tests under a fake clock (no devices, no threads): learners join, send
offers built by hand, and the global fragments must stay bit-identical and finite after
every bad offer, while a good offer afterwards still merges.
"""

import dataclasses
import json

import numpy as np
import pytest

from decoupled_diloco.diloco import compression, syncer_state
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragments import make_fragment_plan
from decoupled_diloco.diloco.messages import Dropped, Heartbeat, Join, Merged, Offer, Snapshot
from decoupled_diloco.diloco.offer_checks import SLOT_WINDOW
from decoupled_diloco.diloco.syncer import Syncer

SHAPES = {
    "embedder/input_embedding": (16, 8),
    "block_0/attn/q": (8, 8),
    "block_0/ffw/up": (8, 12),
    "final_norm/scale": (8,),
}
P = 2  # fragment 0 = the embedding, fragment 1 = everything else
CFG = DilocoConfig(learners=2, sync_every=4, fragments=P, quorum=1, grace_gamma=0.0,
                   max_staleness=1)  # fmt: skip


class Harness:
    """A syncer with learners 0 and 1 joined, its event log, and a fake clock."""

    def __init__(self, cfg: DilocoConfig = CFG, num_learners: int = 2):
        rng = np.random.default_rng(0)
        self.params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        self.plan = make_fragment_plan(SHAPES, P, "balanced", sync_every=4)
        self.log: list[dict] = []
        cfg = dataclasses.replace(cfg, learners=num_learners)
        self.syncer = Syncer(cfg, self.plan, self.params, record=self.log.append)
        self.now = 0.0
        self.offers_made = 0
        for m in range(num_learners):
            out = self.send(Join(m, 0, self.now))
            assert isinstance(out[0][1], Snapshot)

    def send(self, msg) -> list:
        self.now += 0.1
        return self.syncer.handle(msg, self.now)

    def outer_grad(self, p: int, scale: float = 0.01, seed: int = 1) -> dict:
        rng = np.random.default_rng(seed)
        return {
            k: (scale * rng.standard_normal(SHAPES[k])).astype(np.float32)
            for k in self.plan.names[p]
        }

    def offer(self, p: int = 1, learner: int = 0, payload=None, **kw) -> Offer:
        # Every offer at a step of the next schedule slot (H = 4), so each can open a round.
        self.offers_made += 1
        step = 4 * self.offers_made
        fields = dict(
            learner=learner,
            incarnation=0,
            fragment=p,
            step=step,
            c_steps=4,
            c_tokens=4 * 64,
            base_version=self.syncer.version.get(p, 0),
            time=self.now,
        )
        fields.update(kw)
        info = self.syncer.learners.get(learner) if isinstance(learner, int) else None
        if info is not None and info.incarnation == fields["incarnation"]:
            # As a learner's heartbeats do: the syncer knows its step before this offer.
            self.send(Heartbeat(learner, info.incarnation, step - 4, 0.1, self.now))
        if payload is None:
            payload = compression.encode(self.outer_grad(p), "none")
        return Offer(payload=payload, **{"nbytes": 1, **fields})

    def global_copy(self) -> dict:
        return {k: v.copy() for k, v in self.syncer.global_params().items()}

    def rejections(self) -> list[dict]:
        return [r for r in self.log if r.get("event") == "reject"]


def merges(out) -> list[Merged]:
    return [msg for _, msg in out if isinstance(msg, Merged)]


def notices(out) -> list[Dropped]:
    return [msg for _, msg in out if isinstance(msg, Dropped)]


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert np.isfinite(a[k]).all(), k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def encoded(arrays: dict, dtype=np.float32) -> compression.Encoded:
    """A hand-made "none" payload, so tests can put any dtype on the wire."""
    tensors = {
        k: (tuple(v.shape), np.asarray(v, dtype).reshape(-1), np.zeros(0, np.float32))
        for k, v in arrays.items()
    }
    return compression.Encoded("none", tensors)


def nan_payload(h: Harness) -> compression.Encoded:
    grad = h.outer_grad(1)
    grad["block_0/attn/q"][2, 3] = np.nan
    return compression.encode(grad, "none")


def inf_payload(h: Harness) -> compression.Encoded:
    grad = h.outer_grad(1)
    grad["block_0/ffw/up"][0, 0] = -np.inf
    return compression.encode(grad, "none")


def wrong_shape_payload(h: Harness) -> compression.Encoded:
    grad = h.outer_grad(1)
    grad["block_0/attn/q"] = np.zeros((8, 7), np.float32)
    return compression.encode(grad, "none")


def missing_leaf_payload(h: Harness) -> compression.Encoded:
    grad = h.outer_grad(1)
    grad.pop("final_norm/scale")
    return compression.encode(grad, "none")


def other_fragment_payload(h: Harness) -> compression.Encoded:
    return compression.encode(h.outer_grad(0), "none")  # fragment 0's leaves, offered as 1


# (case, offer fields, payload builder, expected reason fragment)
BAD = [
    ("nan", {}, nan_payload, "non-finite"),
    ("inf", {}, inf_payload, "non-finite"),
    ("wrong shape", {}, wrong_shape_payload, "shape"),
    ("wrong dtype", {}, lambda h: encoded(h.outer_grad(1), np.float64), "dtype"),
    ("int dtype", {}, lambda h: encoded(h.outer_grad(1), np.int32), "dtype"),
    ("missing leaf", {}, missing_leaf_payload, "leaf names"),
    ("leaves of another fragment", {}, other_fragment_payload, "leaf names"),
    ("future version", {"base_version": 3}, None, "future"),
    ("unknown learner", {"learner": 7}, None, "unknown learner"),
    ("negative learner", {"learner": -1}, None, "unknown learner"),
    ("unknown fragment", {"fragment": 5}, None, "fragment 5"),
    ("old incarnation", {"incarnation": -1}, None, "incarnation"),
    ("negative counters", {"c_steps": -1}, None, "counters"),
    ("more steps than the learner took", {"c_steps": 10**6}, None, "counters"),
    ("absurd token count", {"c_tokens": 2**60}, None, "counters"),
    ("no work", {"c_steps": 0}, None, "counters"),
    ("steps without tokens", {"c_tokens": 0}, None, "counters"),
    ("nan counter", {"c_tokens": float("nan")}, None, "c_tokens must be an integer"),
    ("float counter", {"c_steps": 4.0}, None, "c_steps must be an integer"),
    ("string learner", {"learner": "0"}, None, "learner must be an integer"),
    ("bool fragment", {"fragment": True}, None, "fragment must be an integer"),
    ("none version", {"base_version": None}, None, "base_version must be an integer"),
    ("step from the future", {"step": 10**9}, None, "step 1000000000 is from the future"),
    # unchecked until 2026-11-30: a string time failed the merge after Θ had moved
    ("string time", {"time": "x"}, None, "time must be a finite number"),
    ("no time", {"time": None}, None, "time must be a finite number"),
    ("nan time", {"time": float("nan")}, None, "time must be a finite number"),
    ("negative bytes", {"nbytes": -(10**18)}, None, "nbytes must be >= 0"),
    ("payload is not encoded", {}, lambda h: {"block_0/attn/q": np.zeros((8, 8))}, "payload"),
    ("payload is a string", {}, lambda h: "garbage", "payload"),
    ("bad method", {}, lambda h: compression.Encoded("zip", {}), "payload"),
    (
        "truncated payload",
        {},
        lambda h: compression.Encoded(
            "none",
            {
                k: (SHAPES[k], np.zeros(3, np.float32), np.zeros(0, np.float32))
                for k in h.plan.names[1]
            },
        ),
        "payload",
    ),
]


def test_numpy_integer_counters_are_read_as_numbers():
    # A syncer without run bounds checks tokens per step against 2**53: an int32 c_steps
    # times that must not overflow (numpy keeps the int32 type).
    # They are kept as Python ints: the merge's record and the checkpoint are JSON (an
    # np.int32 failed the record after Θ had moved, an np.int64 Join the checkpoint).
    h = Harness()
    out = h.send(h.offer(c_steps=np.int32(4), c_tokens=np.int64(4 * 64)))
    assert [type(msg) for _, msg in out] == [Merged, Merged]
    assert h.syncer.stats["rejected_offers"] == 0
    h.send(Join(np.int64(1), np.int64(1), np.float32(h.now + 1), np.int32(3)))
    h.send(h.offer(learner=1, incarnation=np.int64(1), c_steps=np.int64(4)))
    json.dumps(h.log)
    json.dumps(syncer_state.shared_meta(h.syncer))


@pytest.mark.parametrize("case,fields,make_payload,reason", BAD, ids=[b[0] for b in BAD])
def test_bad_offer_is_rejected_with_reason_and_never_merged(case, fields, make_payload, reason):
    h = Harness()
    before, versions = h.global_copy(), dict(h.syncer.version)
    payload = make_payload(h) if make_payload else None
    out = h.send(h.offer(payload=payload, **fields))

    assert not merges(out), case  # no merge was sent to anyone
    learner = fields.get("learner", 0)
    if isinstance(learner, int) and 0 <= learner < 2 and "learner" not in case:
        (notice,) = notices(out)  # its learner is told: the work stays its own
        assert reason in notice.reason
    assert h.syncer.stats["rejected_offers"] == 1
    assert h.syncer.stats["merges"] == 0
    (rej,) = h.rejections()
    assert reason in rej["reason"], rej
    assert rej["fragment"] == fields.get("fragment", 1)
    assert rej["learner"] == fields.get("learner", 0)
    assert all(not pending for pending in h.syncer.pending.values())
    assert h.syncer.version == versions
    assert_same(h.syncer.global_params(), before)

    # The syncer is unharmed: a good offer afterwards merges and moves only its fragment.
    out = h.send(h.offer())
    assert [type(msg) for _, msg in out] == [Merged, Merged]  # to both live learners
    assert h.syncer.version == {0: 0, 1: 1}
    after = h.syncer.global_params()
    assert all(np.isfinite(v).all() for v in after.values())
    assert any(not np.array_equal(after[k], before[k]) for k in h.plan.names[1])
    for k in h.plan.names[0]:
        np.testing.assert_array_equal(after[k], before[k])


def test_stale_offer_is_rejected_once_the_fragment_moved_past_the_bound():
    h = Harness()  # max_staleness = 1
    for _ in range(2):  # learner 0 moves fragment 1 to version 2
        assert h.send(h.offer(learner=0))
    assert h.syncer.version[1] == 2
    before = h.global_copy()
    assert not merges(h.send(h.offer(learner=1, base_version=0)))
    assert "stale" in h.rejections()[-1]["reason"]
    assert h.syncer.stats["rejected_offers"] == 1
    assert_same(h.syncer.global_params(), before)
    # Within the bound (one version behind) the same learner's offer merges.
    assert h.send(h.offer(learner=1, base_version=1))
    assert h.syncer.version[1] == 3


def test_offers_of_a_crashed_incarnation_are_void_after_its_rejoin():
    cfg = dataclasses.replace(CFG, quorum=2)  # keep offers pending
    h = Harness(cfg)
    assert h.send(h.offer(learner=1, incarnation=0)) == []
    assert 1 in h.syncer.pending[1]
    h.send(Join(1, 1, h.now))  # learner 1 crashed and came back as incarnation 1
    assert 1 not in h.syncer.pending[1]  # its pre-crash offer is dropped...
    before = h.global_copy()
    assert not merges(h.send(h.offer(learner=1, incarnation=0)))  # ...late ones rejected
    assert "incarnation" in h.rejections()[-1]["reason"]
    assert_same(h.syncer.global_params(), before)
    # The new incarnation plus learner 0 reach the quorum of 2 and merge.
    h.send(h.offer(learner=1, incarnation=1))
    out = h.send(h.offer(learner=0))
    assert out and out[0][1].learners == (0, 1)


def test_offer_before_join_is_rejected():
    h = Harness(num_learners=3)  # learner 2 exists in the config but has not joined...
    h.syncer.learners.pop(2)  # ...as when the syncer was restored before its rejoin
    assert not merges(h.send(h.offer(learner=2)))
    assert "unknown learner" in h.rejections()[-1]["reason"]


def test_rejections_accumulate_and_good_offers_between_them_merge():
    h = Harness()
    bad = [
        h.offer(payload=nan_payload(h)),
        h.offer(payload=wrong_shape_payload(h)),
        h.offer(learner=9),
    ]
    merged = 0
    for i, o in enumerate(bad):
        h.send(o)
        merged += bool(merges(h.send(h.offer(learner=i % 2))))
    assert h.syncer.stats["rejected_offers"] == 3
    assert h.syncer.stats["merges"] == merged == 3
    assert len(h.rejections()) == 3
    assert all(np.isfinite(v).all() for v in h.syncer.global_params().values())


def test_a_restored_learner_that_never_speaks_stops_holding_up_rounds():
    # Learner 1 left before the syncer's crash, its Leave lost with it: the checkpoint
    # restores it as joined. A K = M round waits for it only `confirm_timeout` seconds (not
    # the heartbeat timeout); a restored learner that speaks is live as before.
    cfg = dataclasses.replace(CFG, quorum=2, confirm_timeout=5.0)
    h = Harness(cfg)
    h.syncer.register(1, 0, True, h.now)  # as a checkpoint restores it: unconfirmed
    assert h.send(h.offer(learner=0)) == []  # waits for learner 1 (K = 2)
    assert h.syncer.live(h.now) == [0, 1]
    h.now += 5.0
    out = h.syncer.tick(h.now)
    assert [m.learners for m in merges(out)] == [(0,)]
    assert h.syncer.live(h.now) == [0]
    # A message of its life confirms it: the heartbeat timeout applies again.
    h.send(Heartbeat(1, 0, 4, 0.1, h.now))
    h.now += 10.0
    assert h.syncer.live(h.now) == [0, 1]


def test_restored_syncer_readmits_learners_that_rejoined_after_its_checkpoint():
    h = Harness(num_learners=3)
    # Restored registry: learner 0 in incarnation 0, learner 1 still in its old life 0,
    # learner 2 unknown (it joined after the checkpoint was written).
    h.syncer.register(1, 0, True, h.now)  # as a checkpoint restores it: unconfirmed
    h.syncer.learners.pop(2)
    assert not merges(h.send(h.offer(learner=1, incarnation=1)))  # newer life: not admitted
    assert "incarnation" in h.rejections()[-1]["reason"]
    # Heartbeats of the newer lives act as joins: each gets the global state to re-anchor on.
    for m, inc in ((1, 1), (2, 0)):
        out = h.send(Heartbeat(m, inc, step=2, step_seconds=0.1, time=h.now))
        assert [(to, type(msg)) for to, msg in out] == [(m, Snapshot)]
        assert h.syncer.learners[m].incarnation == inc and h.syncer.learners[m].joined
    assert merges(h.send(h.offer(learner=1, incarnation=1)))  # K = 1: merges at once
    assert merges(h.send(h.offer(learner=2, incarnation=0)))
    # Heartbeats of older lives or of learners outside the run change nothing (logged).
    assert h.send(Heartbeat(1, 0, step=10, step_seconds=0.1, time=h.now)) == []
    assert h.send(Heartbeat(7, 0, step=10, step_seconds=0.1, time=h.now)) == []
    assert 7 not in h.syncer.learners
    drops = [r["kind"] for r in h.log if r["event"] == "drop_message"]
    assert drops == ["old_incarnation", "unknown_learner"]
    # Learner 1's new life is confirmed now: a heartbeat of yet another life without a Join
    # is not its join (it would lock the live learner's real life out).
    assert h.send(Heartbeat(1, 5, step=10, step_seconds=0.1, time=h.now)) == []
    assert h.syncer.learners[1].incarnation == 1
    assert merges(h.send(h.offer(learner=1, incarnation=1)))


def test_a_far_future_step_cannot_starve_later_rounds():
    """A learner's own reported step bounds its offers: a bogus slot far ahead is rejected,
    so it cannot mark the fragment's later slots as merged already."""
    h = Harness()
    h.send(Heartbeat(0, 0, step=400, step_seconds=0.1, time=h.now))
    assert merges(h.send(h.offer(step=400 + 4 * SLOT_WINDOW)))  # within the window
    assert not merges(h.send(h.offer(step=400 + 4 * SLOT_WINDOW + 4 * (SLOT_WINDOW + 1))))
    assert "from the future" in h.rejections()[-1]["reason"]


def test_offers_of_a_lost_syncer_life_are_dropped_not_rejected():
    """After a restore, versions are re-created: an offer anchored on the lost life's
    version (other epoch) is dropped and logged, and does not count as a bad offer."""
    h = Harness()
    h.syncer.epoch = 7  # this life's epoch; learners learn it from the snapshot
    before = h.global_copy()
    assert not merges(h.send(h.offer(epoch=3)))
    drop = [r for r in h.log if r.get("event") == "drop_offer"][-1]
    assert "before the syncer restore" in drop["reason"]
    assert h.syncer.stats["rejected_offers"] == 0
    assert_same(h.syncer.global_params(), before)
    out = h.send(h.offer(epoch=7))
    assert out and all(msg.epoch == 7 for _, msg in out)
    assert h.syncer.snapshot(h.now).epoch == 7


def test_a_delayed_join_of_an_older_life_does_not_roll_the_registry_back():
    h = Harness()
    h.send(Join(1, 2, h.now))  # learner 1 restarted twice
    assert h.send(Join(1, 1, h.now)) == []  # its second life's Join, delivered late
    assert h.syncer.learners[1].incarnation == 2
    (drop,) = [r for r in h.log if r["event"] == "drop_message"]
    assert "old incarnation" in drop["reason"] and drop["message"] == "Join"
    assert h.syncer.stats["rejected_offers"] == 0  # a join is not an offer
    assert h.syncer.stats["dropped_messages"] == 1
    assert merges(h.send(h.offer(learner=1, incarnation=2)))
