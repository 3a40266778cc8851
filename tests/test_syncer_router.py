"""Syncer merge records: MoE router divergence and ‖Δ‖; in-place merges leak into nothing.

Pure Syncer under a fake clock: learners join, offers are built by hand, records are read
from the syncer's event log.
"""

import dataclasses

import numpy as np
import pytest

from decoupled_diloco.diloco import compression
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragments import make_fragment_plan
from decoupled_diloco.diloco.messages import Join, Merged, Offer
from decoupled_diloco.diloco.syncer import Syncer

SHAPES = {
    "embedder/input_embedding": (16, 8),
    "block_0/attn/q": (8, 8),
    "block_0/moe/router": (8, 4),
    "block_0/moe/up": (4, 8, 6),
    "block_1/moe/router": (8, 4),
    "final_norm/scale": (8,),
}
P = 2  # fragment 0 = the embedding, fragment 1 = everything else (both routers)
CFG = DilocoConfig(learners=2, sync_every=4, fragments=P, quorum=2, grace_gamma=0.0,
                   weights="uniform")  # fmt: skip


class Harness:
    def __init__(self, cfg: DilocoConfig = CFG, num_learners: int = 2):
        rng = np.random.default_rng(0)
        self.params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        self.plan = make_fragment_plan(SHAPES, P, "balanced", sync_every=4)
        self.log: list[dict] = []
        cfg = dataclasses.replace(cfg, learners=num_learners)
        self.syncer = Syncer(cfg, self.plan, self.params, record=self.log.append)
        self.now = 0.0
        self.steps = [0] * num_learners
        for m in range(num_learners):
            self.send(Join(m, 0, self.now))

    def send(self, msg) -> list:
        self.now += 0.1
        return self.syncer.handle(msg, self.now)

    def outer_grad(self, p: int, seed: int, scale: float = 0.01) -> dict:
        rng = np.random.default_rng(seed)
        return {
            k: (scale * rng.standard_normal(SHAPES[k])).astype(np.float32)
            for k in self.plan.names[p]
        }

    def offer(self, v: dict, p: int = 1, learner: int = 0) -> Offer:
        self.steps[learner] += 4  # each offer holds the learner's next 4 steps
        return Offer(
            learner=learner,
            incarnation=0,
            fragment=p,
            step=self.steps[learner],
            c_steps=4,
            c_tokens=256,
            base_version=self.syncer.version[p],
            time=self.now,
            payload=compression.encode(v, "none"),
            nbytes=1,
        )

    def merge_round(self, vs: list[dict], p: int = 1) -> dict:
        """Offers vs[m] from learner m; returns the merge record."""
        for m, v in enumerate(vs):
            self.send(self.offer(v, p, m))
        (record,) = [r for r in self.log if r["event"] == "merge"][-1:]
        assert record["fragment"] == p and record["learners"] == list(range(len(vs)))
        return record


def test_router_leaves_are_in_the_merged_fragment():
    h = Harness()
    routers = [k for k in h.plan.names[1] if k.endswith("moe/router")]
    assert len(routers) == 2 and not any(k.endswith("router") for k in h.plan.names[0])


def test_identical_offers_have_zero_router_divergence():
    h = Harness()
    v = h.outer_grad(1, seed=1)
    record = h.merge_round([v, v])
    assert record["router_divergence"] == pytest.approx(0.0, abs=1e-9)


def test_different_offers_have_positive_router_divergence_relative_to_theta():
    h = Harness()
    v = h.outer_grad(1, seed=1)
    theta = {k: h.syncer.global_params()[k].copy() for k in h.plan.names[1]}
    record = h.merge_round([v, {k: -x for k, x in v.items()}])  # ±v: spread ‖v‖ per leaf
    routers = [k for k in theta if k.endswith("moe/router")]
    want = np.mean([np.linalg.norm(v[k]) / np.linalg.norm(theta[k]) for k in routers])
    assert record["router_divergence"] > 0
    assert record["router_divergence"] == pytest.approx(want, rel=1e-5)
    # Offers further apart diverge more.
    far = h.merge_round([v, h.outer_grad(1, seed=2, scale=0.1)])
    near = h.merge_round([v, h.outer_grad(1, seed=2, scale=0.001)])
    assert far["router_divergence"] > near["router_divergence"] > 0


def test_router_divergence_is_omitted_without_routers_or_a_second_learner():
    h = Harness()
    embedding = h.merge_round([h.outer_grad(0, seed=1), h.outer_grad(0, seed=2)], p=0)
    assert "router_divergence" not in embedding
    solo = Harness(dataclasses.replace(CFG, quorum=1), num_learners=1)
    assert "router_divergence" not in solo.merge_round([solo.outer_grad(1, seed=1)])


@pytest.mark.parametrize("merge_rule", ["rda", "mean"])
def test_delta_norm_and_in_place_merges(merge_rule):
    h = Harness(dataclasses.replace(CFG, merge=merge_rule))
    theta = {k: v.copy() for k, v in h.syncer.global_params().items()}
    held_state = h.syncer.state_dict()["theta"]["1"]
    snapshot = h.syncer.snapshot(h.now)
    held_snapshot = {k: v.copy() for k, v in snapshot.params.items()}
    out = []
    for m, seed in enumerate((1, 2)):
        out += h.send(h.offer(h.outer_grad(1, seed), learner=m))
    record = [r for r in h.log if r["event"] == "merge"][-1]
    # First merge from zero momentum, Nesterov: Θ' = Θ − lr·(1 + μ)·Δ.
    after = h.syncer.global_params()
    moved = np.sqrt(sum(np.sum((theta[k] - after[k]) ** 2.0) for k in h.plan.names[1]))
    lr, mu = CFG.outer_lr, CFG.outer_momentum
    assert record["delta_norm"] > 0
    assert moved == pytest.approx(lr * (1 + mu) * record["delta_norm"], rel=1e-4)
    # Θ moved in place (live state_dict arrays follow), but a snapshot taken before and the
    # reply already sent keep their values when the next merge runs.
    assert any(not np.array_equal(held_state[k], theta[k]) for k in h.plan.names[1])
    (reply,) = {id(msg): msg for _, msg in out if isinstance(msg, Merged)}.values()
    sent = {k: x.copy() for k, x in compression.decode(reply.payload).items()}
    for m, seed in enumerate((3, 4)):
        h.send(h.offer(h.outer_grad(1, seed), learner=m))
    assert h.syncer.version[1] == 2
    for k, x in compression.decode(reply.payload).items():
        np.testing.assert_array_equal(x, sent[k])
    for k, x in snapshot.params.items():
        np.testing.assert_array_equal(x, held_snapshot[k])


def test_restored_syncer_does_not_share_arrays_with_its_source():
    a, b = Harness(), Harness()
    b.syncer.load_state_dict(a.syncer.state_dict(), a.syncer.meta_dict(), b.now)
    before = {k: v.copy() for k, v in a.syncer.global_params().items()}
    b.merge_round([b.outer_grad(1, seed=1), b.outer_grad(1, seed=2)])
    for k, v in a.syncer.global_params().items():
        np.testing.assert_array_equal(v, before[k])
