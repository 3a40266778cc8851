"""Every step of work reaches Θ exactly once, whatever the delays; rounds keep going; the
synchronous special case is DiLoCo; a syncer restore replays nothing.

The real protocol, step boundary and syncer run in `protocol_sim.Sim` (no devices, a virtual
clock, programmable delays). With `linear_update` an inner step adds a fixed vector per
(learner, step), so Θ's value tells exactly which steps it holds and with which coefficient.
"""

import copy
import dataclasses
import heapq
import math

import numpy as np
import pytest
from protocol_sim import (
    SHAPES,
    TOKENS_PER_STEP,
    NumpyReplica,
    Sim,
    _rng,
    initial_params,
    linear_update,
    work_sum,
)

from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragments import make_fragment_plan
from decoupled_diloco.diloco.learner import Learner, materialize
from decoupled_diloco.diloco.messages import Leave, Offer
from decoupled_diloco.diloco.syncer import Syncer
from decoupled_diloco.runtime.boundary import apply_and_beat, finish, offer_and_receive


def cfg(**kw) -> DilocoConfig:
    base = dict(learners=3, sync_every=4, fragments=3, overlap=1, quorum=1, grace_gamma=0.0,
                weights="uniform", merge="mean", embedding_merge="mean", outer_lr=1.0,
                outer_momentum=0.0, final_wait=1e6, heartbeat_every=1e9)  # fmt: skip
    return DilocoConfig(**{**base, **kw})


def expected_theta(sim: Sim, steps: int) -> dict:
    """Θ_0 + Σ_m work_m / M: every step merged once, with the roster's coefficient 1/M."""
    M = sim.cfg.learners
    out = {k: v.astype(np.float64) for k, v in sim.theta0.items()}
    for m in range(M):
        for k, v in work_sum(sim.update, m, steps).items():
            out[k] += v / M
    return out


def assert_every_step_merged_once(sim: Sim, steps: int) -> None:
    merged = sim.merged_steps()
    for m in range(sim.cfg.learners):
        for p in range(sim.plan.num_fragments):
            assert merged.get((m, p), 0) == steps, (m, p, merged)
    theta = sim.syncer.global_params()
    want = expected_theta(sim, steps)
    for k in theta:
        np.testing.assert_allclose(theta[k], want[k], atol=2e-5, err_msg=k)


@pytest.mark.parametrize("apply", ["rebase", "land"])
@pytest.mark.parametrize("lag_steps", [0, 1.5 * 4, 5 * 4])  # none, > H, > 4·H
def test_delayed_replies_lose_and_repeat_no_work(lag_steps, apply):
    steps = 40
    sim = Sim(cfg(apply=apply), steps, down_delay=lambda m, msg: lag_steps * (1.0 + 0.3 * m))
    sim.run()
    assert_every_step_merged_once(sim, steps)


@pytest.mark.parametrize("apply", ["rebase", "land"])
@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_replies_arriving_out_of_order_lose_and_repeat_no_work(alpha, apply):
    """A learner may receive a fragment's versions in another order than the syncer sent
    them (the Ray learner actor takes messages on several threads): here odd versions
    arrive long after the even one that follows them. A stale version is ignored (the newer
    one holds its work), so every step still reaches Θ once. (With the mixing α > 0, Θ is
    not the plain sum of the work: learners offer back part of each merge's move.)"""
    from decoupled_diloco.diloco.messages import Merged

    steps = 40

    def down(m, msg):
        return 9.0 + m if isinstance(msg, Merged) and msg.version % 2 else 0.5

    sim = Sim(cfg(alpha=alpha, apply=apply), steps, step_time=[1.0, 1.3, 0.8], down_delay=down)
    arrivals: dict = {}
    for lr in sim.learners:

        def arrive(msg, proto=lr.proto, plain=lr.proto._arrive):
            arrivals.setdefault((proto.id, msg.fragment), []).append(msg.version)
            plain(msg)

        lr.proto._arrive = arrive
    sim.run()
    late = [v for vs in arrivals.values() for a, v in zip(vs[:-1], vs[1:], strict=True) if v < a]
    assert len(late) >= 10, arrivals  # the order really was broken, many times
    if alpha == 0:
        assert_every_step_merged_once(sim, steps)
    else:
        for (m, p), n in sim.merged_steps().items():
            assert n == steps, (m, p, n)
        assert len(sim.merged_steps()) == 3 * sim.plan.num_fragments


@pytest.mark.parametrize("apply", ["rebase", "land"])
def test_slow_uplinks_and_uneven_learners_lose_and_repeat_no_work(apply):
    steps = 36
    sim = Sim(cfg(learners=4, quorum=2, apply=apply), steps, step_time=[1.0, 1.3, 2.0, 0.7],
              up_delay=lambda m, msg: 3.0 * m, down_delay=lambda m, msg: 2.5)  # fmt: skip
    sim.run()
    assert_every_step_merged_once(sim, steps)


def test_overwrite_with_max_wait_zero_never_merges_a_step_twice():
    steps = 24
    sim = Sim(cfg(apply="overwrite", overlap=2), steps, down_delay=lambda m, msg: 6.0)
    sim.run()
    for (m, p), n in sim.merged_steps().items():
        assert n <= steps, (m, p, n)


def test_work_is_conserved_at_every_step():
    """At any moment a learner's steps are either in its unmerged counters or merged, and
    Θ never holds a step twice."""
    steps = 30

    def check(sim):
        merged = sim.merged_steps()
        for lr in sim.learners:
            m = lr.proto.id
            for p, f in enumerate(lr.proto.frags):
                consumed = lr.proto.step - f.c_steps  # steps the learner knows are in Θ
                in_theta = merged.get((m, p), 0)
                in_flight = f.in_flight.c_steps if f.in_flight is not None else 0
                assert consumed <= in_theta <= consumed + in_flight, (m, p)

    sim = Sim(cfg(learners=3), steps, step_time=[1.0, 1.7, 0.6],
              down_delay=lambda m, msg: 5.0 + m)  # fmt: skip
    sim.run(on_step=check)
    assert_every_step_merged_once(sim, steps)


def test_rounds_with_1_lt_k_lt_m_go_at_the_pace_of_the_kth_fastest():
    # Learners at 1x, 2x, 4x, 4x the step time; K = 2: rounds close when the second
    # fastest reaches a new slot, so a fragment merges about once per H of ITS steps.
    steps = 48
    c = cfg(learners=4, quorum=2, fragments=1, sync_every=4, overlap=0)
    sim = Sim(c, steps, step_time=[1.0, 2.0, 4.0, 4.0])
    slots_of_second = (steps - 1) // 4  # slots the 2x learner completes during its run
    sim.run()
    rounds = [r for r in sim.merges() if r["time"] <= steps * 2.0]
    assert len(rounds) >= slots_of_second - 1, len(rounds)


def test_a_synchronous_run_goes_on_when_a_learner_restarts_at_a_due_step():
    """Synchronous Streaming DiLoCo (K = M, learners wait for every merge). Learner 0
    crashes right after offering fragment 1 at its due step 8, the offer lost with it, and
    rejoins at step 8: its new life offers fragment 1 first at step 14. The others' step-8
    offers must merge without it; waiting for it held them at step 9 and it at its next
    offer (fragment 2, step 10), whose round waited for them: every learner waited and
    nothing was on its way. Every step of the others, and of learner 0's new life, merges
    once."""
    steps = 24
    c = cfg(learners=3, fragments=3, sync_every=6, quorum=3, max_wait=-1.0)
    sim = Sim(c, steps)
    assert 1 in sim.plan.due(8)
    crashed = []

    def crash_at_8(sim):
        lr = sim.learners[0]
        if crashed or lr.proto.step != 8:
            return
        crashed.append(True)
        lost = [e for e in sim._events if e[2] == "up" and e[3] == 0 and isinstance(e[4], Offer)]
        assert [e[4].fragment for e in lost] == [1]
        sim._events = [e for e in sim._events if e not in lost]
        heapq.heapify(sim._events)
        sim._deliver(sim.syncer.handle(Leave(0, 0, sim.t), sim.t))  # its runtime saw it fail
        lr.link.reset()
        lr.proto = Learner(0, c, sim.plan, TOKENS_PER_STEP, lambda: sim.t, incarnation=1, step=8)
        snaps = [msg for _, msg in sim.syncer.handle(lr.proto.join(), sim.t)]
        lr.replica.init_from_host(lr.proto.start(snaps), 8)
        lr.blocked = False

    sim.run(on_step=crash_at_8)
    assert crashed
    merged: dict = {}
    for r in sim.merges():
        for m, inc, n in zip(r["learners"], r["incarnations"], r["c_steps"], strict=True):
            merged[(m, inc, r["fragment"])] = merged.get((m, inc, r["fragment"]), 0) + n
    for p in range(3):
        assert merged[(1, 0, p)] == merged[(2, 0, p)] == steps, merged
        assert merged[(0, 1, p)] == steps - 8, merged
    assert merged[(0, 0, 1)] == 2  # its fragment-1 steps 3-8 were lost with the offer


def test_k1_rounds_go_on_when_the_fastest_learner_stops():
    """The fastest learner sets the covered slot and then stalls (a crash the syncer has not
    noticed yet). The others' offers are late for that slot, and each has one in flight:
    the rounds must go on as they step past their next due steps (heartbeats tell)."""
    steps = 40
    c = cfg(learners=3, quorum=1, heartbeat_every=1.0)
    stall = lambda m, step: (1e4 if step >= 12 else 0.5) if m == 0 else 1.0
    sim = Sim(c, steps, step_time=stall)
    sim.run()
    busy = [r for r in sim.merges() if 20.0 < r["time"] < 40.0]  # learner 0 is stalled
    assert len(busy) >= 8, len(busy)
    assert all(0 not in r["learners"] for r in busy)


def reference_diloco(theta0, update, M, H, rounds, lr, mu, nesterov=True) -> dict:
    """Synchronous DiLoCo in float64, written independently of the project's code: every
    learner starts each round from Θ, takes H inner steps, Θ takes one outer step on the
    mean outer gradient."""
    theta = {k: v.astype(np.float64) for k, v in theta0.items()}
    buf = {k: np.zeros_like(v) for k, v in theta.items()}
    for r in range(rounds):
        locals_ = []
        for m in range(M):
            x = {k: v.copy() for k, v in theta.items()}
            for t in range(H):
                d = update({k: v.astype(np.float32) for k, v in x.items()}, m, r * H + t)
                x = {k: x[k] + d[k] for k in x}
            locals_.append(x)
        delta = {k: np.mean([theta[k] - x[k] for x in locals_], axis=0) for k in theta}
        for k in theta:
            buf[k] = mu * buf[k] + delta[k]
            step = delta[k] + mu * buf[k] if nesterov else buf[k]
            theta[k] = theta[k] - lr * step
    return theta


def quadratic_update(eta=0.1, seed=3):
    """SGD on a learner-specific quadratic: the step depends on θ, so learners that do not
    start each round from Θ end somewhere else."""
    rng = np.random.default_rng(seed)
    targets = {m: {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
               for m in range(4)}  # fmt: skip

    def update(params, m, step):
        return {k: (-eta * (v - targets[m][k])
                    + 1e-3 * _rng(seed, m, step, k).standard_normal(np.shape(v)))
                .astype(np.float32) for k, v in params.items()}  # fmt: skip

    return update


@pytest.mark.parametrize("M", [1, 3])
def test_synchronous_diloco_matches_an_independent_float64_reference(M):
    H, rounds = 5, 6
    update = quadratic_update()
    c = cfg(learners=M, quorum=M, fragments=1, sync_every=H, overlap=0, max_wait=-1,
            outer_lr=0.7, outer_momentum=0.9, momentum_clock="work")  # fmt: skip
    sim = Sim(c, H * rounds, update=update)
    sim.run()
    want = reference_diloco(sim.theta0, update, M, H, rounds, 0.7, 0.9)
    theta = sim.syncer.global_params()
    for k in theta:
        np.testing.assert_allclose(theta[k], want[k], rtol=2e-5, atol=2e-5, err_msg=k)


def reference_streaming(theta0, fragments, offsets, update, M, H, tau, T, lr, mu,
                        land=False) -> dict:  # fmt: skip
    """Synchronous Streaming DiLoCo with overlap in float64, written independently of the
    project's code. Fragment p (leaf names `fragments[p]`) is offered after inner step t
    when (t − offsets[p]) % H == 0: Δ = mean over learners of (anchor − θ_m); Θ_p takes an
    outer Nesterov step clocked by work (c = the interval's steps / H: buf ← μ^c·buf + Δ,
    Θ ← Θ − lr·(Δ + μ(1 − μ^c)/(1 − μ)·buf)). After step t + τ every learner rebases:
    θ_p ← Θ_p + (θ_p(t + τ) − θ_p(t)), and Θ_p becomes its anchor. At the end, pending
    merges are applied and every fragment offers what it holds since its last offer.
    `land`: every learner instead sets θ_p ← Θ_p and keeps R_p = θ_p(t + τ) − θ_p(t)
    aside: its offers are anchor − (θ + R), and R_p is replaced at its next landing."""
    theta = {k: v.astype(np.float64) for k, v in theta0.items()}
    buf = {k: np.zeros_like(v) for k, v in theta.items()}
    x = [{k: v.copy() for k, v in theta.items()} for _ in range(M)]
    aside = [{k: np.zeros_like(v) for k, v in theta.items()} for _ in range(M)]
    anchor = [{k: v.copy() for k, v in theta.items()} for _ in range(M)]
    last = [0] * len(fragments)
    pending = []  # (apply after step, leaf names, merged Θ_p, each learner's θ_p(t))

    def outer(p, t):
        c, last[p] = (t - last[p]) / H, t
        decay, look = mu**c, mu * (1 - mu**c) / (1 - mu)
        for k in fragments[p]:
            delta = np.mean([anchor[m][k] - (x[m][k] + aside[m][k]) for m in range(M)], axis=0)
            buf[k] = decay * buf[k] + delta
            theta[k] = theta[k] - lr * (delta + look * buf[k])
        snaps = [{k: x[m][k].copy() for k in fragments[p]} for m in range(M)]
        pending.append((t + tau, fragments[p], {k: theta[k].copy() for k in fragments[p]}, snaps))

    def rebase(names, merged, snaps):
        for m in range(M):
            for k in names:
                if land:
                    aside[m][k] = x[m][k] - snaps[m][k]
                    x[m][k] = merged[k].copy()
                else:
                    x[m][k] = merged[k] + (x[m][k] - snaps[m][k])
                anchor[m][k] = merged[k].copy()

    for t in range(1, T + 1):
        for m in range(M):
            d = update({k: v.astype(np.float32) for k, v in x[m].items()}, m, t - 1)
            x[m] = {k: x[m][k] + d[k] for k in x[m]}
        for p in range(len(fragments)):
            if (t - offsets[p]) % H == 0:
                outer(p, t)
        for item in [u for u in pending if u[0] == t]:
            rebase(*item[1:])
        pending = [u for u in pending if u[0] != t]
    for item in pending:
        rebase(*item[1:])
    for p in range(len(fragments)):
        if last[p] < T:
            outer(p, T)
    return theta


@pytest.mark.parametrize("tau,apply", [(0, "rebase"), (2, "rebase"), (2, "land")])
def test_synchronous_streaming_with_overlap_matches_an_independent_float64_reference(tau, apply):
    """M = 3 learners, P = 3 staggered fragments, K = M, learners wait, outer Nesterov
    (0.7, 0.9), steps that depend on θ: Θ is Streaming DiLoCo's, with the overlap's steps
    taken where the learners were and carried across each merge (rebase), or set aside for
    the next offer while the learners train on from the merge (land)."""
    M, H, T = 3, 6, 60
    update = quadratic_update()
    c = cfg(learners=M, quorum=M, fragments=3, sync_every=H, overlap=tau, max_wait=-1,
            outer_lr=0.7, outer_momentum=0.9, momentum_clock="work", apply=apply)  # fmt: skip
    sim = Sim(c, T, update=update)
    sim.run()
    fragments = [sorted(part) for part in sim.plan.split(sim.theta0)]
    assert [len(f) for f in fragments] == [1, 2, 2] and sim.plan.offsets == (0, 2, 4)
    want = reference_streaming(sim.theta0, fragments, sim.plan.offsets, update, M, H, tau, T,
                               0.7, 0.9, land=apply == "land")  # fmt: skip
    theta = sim.syncer.global_params()
    for k in theta:
        np.testing.assert_allclose(theta[k], want[k], rtol=2e-5, atol=2e-5, err_msg=k)


def test_the_overlap_changes_only_where_steps_are_taken():
    """Synchronous streaming (K = M, learners wait) under outer Nesterov (0.7, 0.9): with
    steps that ignore θ, merges applied τ = 2 steps after their offers give the same Θ as
    merges applied at once; the overlap's steps reach the next merge, once, with the same
    coefficient."""
    thetas = []
    for tau in (0, 2):
        c = cfg(learners=4, quorum=4, fragments=3, sync_every=6, overlap=tau, max_wait=-1,
                outer_lr=0.7, outer_momentum=0.9)  # fmt: skip
        sim = Sim(c, 60, update=linear_update())
        sim.run()
        merged = sim.merged_steps()
        assert set(merged.values()) == {60} and len(merged) == 4 * 3, merged
        thetas.append(sim.syncer.global_params())
    for k in thetas[0]:
        np.testing.assert_allclose(thetas[1][k], thetas[0][k], atol=2e-5, err_msg=k)


def test_the_reference_equivalence_needs_learners_to_apply_merges(monkeypatch):
    """The equivalence above must fail if learners never apply merges (M = 1 included)."""
    monkeypatch.setattr(Learner, "apply_due", lambda self, final=False, ready=None: [])
    H, rounds = 5, 4
    update = quadratic_update()
    c = cfg(learners=1, quorum=1, fragments=1, sync_every=H, overlap=0, max_wait=0,
            outer_lr=0.7, outer_momentum=0.9)  # fmt: skip
    sim = Sim(c, H * rounds, update=update)
    sim.run()
    want = reference_diloco(sim.theta0, update, 1, H, rounds, 0.7, 0.9)
    theta = sim.syncer.global_params()
    assert max(float(np.abs(theta[k] - want[k]).max()) for k in theta) > 1e-3


@pytest.mark.parametrize("restore_at", [20, 32])
def test_syncer_restore_replays_no_lost_progress(monkeypatch, restore_at):
    """A syncer restored from an older checkpoint loses the merges made since. Learners
    rebase on the restored Θ: the lost progress leaves them too, and only their own work
    that no version they applied held is offered again, once. (Re-offering Θ_restored − θ,
    as before, replayed the lost progress as fresh outer gradients: with outer momentum
    0.9, about 7 times.) `restore_at` 32: the faster learner has finished its steps and
    waits in its final sync; it admits the restored life and leaves again (finish())."""
    steps = 32
    c = cfg(learners=2, fragments=1, sync_every=4, overlap=0)
    sim = Sim(c, steps, step_time=[1.0, 1.3])
    saved, consumed = {}, {}
    resync = Learner._resync

    def recording_resync(self, snap):
        out = resync(self, snap)
        consumed[self.id] = self.step - self.frags[0].c_steps  # steps a version held
        return out

    monkeypatch.setattr(Learner, "_resync", recording_resync)

    def crash_and_restore(sim):
        lead = max(lr.proto.step for lr in sim.learners)
        if lead == 10 and "state" not in saved:
            saved["state"] = copy.deepcopy(sim.syncer.state_dict())
            saved["meta"] = copy.deepcopy(sim.syncer.meta_dict())
        if lead >= restore_at and "theta" not in saved:  # the syncer dies; a new life restores
            syncer = type(sim.syncer)(c, sim.plan, sim.theta0, record=sim.records.append, epoch=7)
            syncer.load_state_dict(saved["state"], saved["meta"], sim.t)
            saved["theta"] = {k: v.astype(np.float64) for k, v in syncer.global_params().items()}
            sim.syncer = syncer
            sim._deliver([(m, syncer.snapshot(sim.t)) for m in range(c.learners)])

    sim.run(on_step=crash_and_restore)
    merged_after = {}
    for r in sim.merges():
        if r["epoch"] == 7:
            for m, n in zip(r["learners"], r["c_steps"], strict=True):
                merged_after[m] = merged_after.get(m, 0) + n
    want = saved["theta"]
    for m in range(c.learners):
        assert merged_after[m] == steps - consumed[m], (m, merged_after, consumed)
        for k, v in work_sum(sim.update, m, steps).items():
            want[k] += (v - work_sum(sim.update, m, consumed[m])[k]) / c.learners
    theta = sim.syncer.global_params()
    for k in theta:
        np.testing.assert_allclose(theta[k], want[k], atol=2e-5, err_msg=k)


def test_token_weights_equal_uniform_weights_for_equal_batches():
    a = Sim(cfg(weights="tokens"), 20, down_delay=lambda m, msg: 3.0)
    b = Sim(cfg(weights="uniform"), 20, down_delay=lambda m, msg: 3.0)
    a.run()
    b.run()
    for k, v in a.syncer.global_params().items():
        np.testing.assert_allclose(v, b.syncer.global_params()[k], rtol=1e-6)


def test_merged_normalisation_counts_partial_merges_as_full_rounds():
    """The paper's literal normalisation moves Θ as far for one learner's offer as for all:
    with lagging peers the total exceeds the roster's (the inflation roster removes)."""
    steps = 24
    roster = Sim(cfg(), steps, step_time=[1.0, 1.5, 2.2])
    merged = Sim(dataclasses.replace(cfg(), normalize="merged"), steps, step_time=[1.0, 1.5, 2.2])
    roster.run()
    merged.run()
    want = expected_theta(roster, steps)
    err = {n: max(float(np.abs(s.syncer.global_params()[k] - want[k]).max()) for k in want)
           for n, s in (("roster", roster), ("merged", merged))}  # fmt: skip
    assert err["roster"] < 2e-5 < err["merged"]


def test_a_retry_after_refusals_is_not_refused_as_an_offer_from_the_future(monkeypatch):
    """Fast steps, heartbeats every 0.5 s: the syncer learns a learner's step from its
    accepted offers and heartbeats. While a refused fragment sits out its retry wait, the
    learner keeps telling its step, so the retry (many steps past the last accepted offer)
    is not refused as 'ahead of the learner's reports', and all its work is merged."""
    from decoupled_diloco.diloco import syncer as syncer_mod
    from decoupled_diloco.diloco.offer_checks import Reason

    accept = syncer_mod.Syncer._accept

    def refusing(self, offer, now):  # the syncer refuses learner 0's offers of steps 20-59
        if offer.learner == 0 and 20 <= offer.step < 60:
            self.refusals.reject(offer, Reason("scale", "a test's refusal"), now)
            return None
        return accept(self, offer, now)

    monkeypatch.setattr(syncer_mod.Syncer, "_accept", refusing)
    steps = 600
    sim = Sim(cfg(learners=2, fragments=1, sync_every=2, overlap=0, heartbeat_every=0.5),
              steps, step_time=[0.005, 0.005])  # fmt: skip
    sim.run()
    assert sim.syncer.stats.get("reject:step", 0) == 0  # only the test's own refusals
    assert_every_step_merged_once(sim, steps)


class _SyncerLink:
    """Learner 0's outbox and inbox, wired straight to a real syncer (delivery at once).
    `restore`, once set: called with the next offer, which dies with the syncer; it returns
    the restored syncer, whose snapshot reaches the learner as its announcement. Virtual clock:
    a receive costs 1 ms, or its whole timeout when nothing arrives."""

    def __init__(self, syncer, clock: dict, announced: bool = True, delivered: bool = True):
        self.syncer, self.clock, self.restore, self.inbox = syncer, clock, None, []
        # `announced` False: the restored syncer does not know the learner (no checkpoint),
        # so it sends no announcement; the offer then reaches it (`delivered`) or dies with
        # the old one.
        self.announced, self.delivered = announced, delivered

    def _deliver(self, out) -> None:
        self.inbox += [msg for m, msg in out if m == 0]

    def offer(self, ticket, copies) -> None:
        offer = materialize(ticket, copies)
        if self.restore is not None:
            self.syncer, self.restore = self.restore(), None
            if self.announced:
                self._deliver([(0, self.syncer.snapshot(self.clock["t"]))])
                return
            if not self.delivered:
                return
        self._deliver(self.syncer.handle(offer, self.clock["t"]))

    def send(self, msg) -> None:
        self._deliver(self.syncer.handle(msg, self.clock["t"]))

    def flush(self, timeout: float = 0.0, deliver_timeout: float | None = None) -> bool:
        return True

    def receive(self, timeout: float) -> list:
        out, self.inbox = self.inbox, []
        self.clock["t"] += 1e-3 if out else timeout
        return out


def _three_steps(proto, replica, link) -> None:
    """Steps 1-3 of a learner offering every 2 steps: step 2's offer is merged, step 3's
    work is unmerged when its final sync begins."""
    for _ in range(3):
        replica.step()
        proto.stepped()
        offer_and_receive(proto, replica, link, link.receive)
        apply_and_beat(proto, replica, link)
    assert proto.unmerged_steps() == [1]


def test_a_final_sync_reaches_a_restored_syncer_that_never_saw_its_life():
    """The syncer's checkpoint predates the learner's rejoin (its registry holds the learner's
    earlier life), and the syncer dies during the learner's final sync. The learner, which
    sends no heartbeats there, must still make the restored syncer admit its life: else its
    Leave and re-offers are refused as of another incarnation until final_wait runs out."""
    c = cfg(learners=1, fragments=1, sync_every=2, overlap=0, final_sync=True, final_wait=60.0)
    plan = make_fragment_plan(SHAPES, 1, "balanced", 2)
    theta0, update, clock = initial_params(), linear_update(), {"t": 0.0}
    syncer = Syncer(c, plan, theta0, record=lambda r: None)
    syncer.handle(Learner(0, c, plan, 64, lambda: clock["t"]).join(), 0.0)  # life 0
    saved = copy.deepcopy((syncer.state_dict(), syncer.meta_dict()))  # its last checkpoint
    records = []

    def restore():
        restored = Syncer(c, plan, theta0, record=records.append, epoch=1)
        restored.load_state_dict(*copy.deepcopy(saved), clock["t"])
        return restored

    proto = Learner(0, c, plan, 64, lambda: clock["t"], incarnation=1)  # life 0 crashed
    link = _SyncerLink(syncer, clock)
    replica = NumpyReplica(0, update)
    replica.init_from_host(proto.start([s for _, s in syncer.handle(proto.join(), 0.0)]))
    _three_steps(proto, replica, link)  # the offer at step 2 is merged by the syncer that dies
    link.restore = restore  # the syncer dies with the final offer
    finish(proto, replica, link, link.receive, lambda: clock["t"])
    assert proto.resyncs == 1 and proto.unmerged_steps() == [0]
    assert clock["t"] < 5.0  # not final_wait
    merges = [r for r in records if r.get("event") == "merge"]
    # The restore lost the merge of steps 0-1 (by design: replayed by no one); step 2 is
    # the learner's own unmerged work, merged once.
    assert [(r["learners"], r["c_steps"]) for r in merges] == [([0], [1])]
    assert not link.syncer.learners[0].joined  # it left, in the life the syncer now knows
    last = update(theta0, 0, 2)  # step 2's change (linear_update ignores θ)
    want = {k: v + last[k] for k, v in theta0.items()}
    for k, v in link.syncer.global_params().items():
        np.testing.assert_allclose(v, want[k], atol=2e-6, err_msg=k)


@pytest.mark.parametrize("delivered", [True, False])
def test_a_final_sync_reaches_a_restored_syncer_that_knows_no_learner(delivered):
    """The syncer dies as the learner leaves, before its first checkpoint: the restored one
    knows no learner, so it announces itself to nobody, and the final offer is refused as
    from an unknown learner (`delivered`) or died with the old syncer. The learner must make
    itself known (a heartbeat, which the syncer takes as a join and answers with its
    snapshot): it waited until final_wait ran out (120 s by default), and its last steps
    never reached Θ."""
    c = cfg(
        learners=1,
        fragments=1,
        sync_every=2,
        overlap=0,
        final_sync=True,
        final_wait=60.0,
        heartbeat_every=0.5,
    )  # (the default's: beats are what this is about)
    plan = make_fragment_plan(SHAPES, 1, "balanced", 2)
    theta0, update, clock = initial_params(), linear_update(), {"t": 0.0}
    syncer = Syncer(c, plan, theta0, record=lambda r: None)
    records = []
    proto = Learner(0, c, plan, 64, lambda: clock["t"])
    link = _SyncerLink(syncer, clock, announced=False, delivered=delivered)
    replica = NumpyReplica(0, update)
    replica.init_from_host(proto.start([s for _, s in syncer.handle(proto.join(), 0.0)]))
    _three_steps(proto, replica, link)  # the offer at step 2 is merged by the syncer that dies
    link.restore = lambda: Syncer(c, plan, theta0, record=records.append, epoch=1)
    finish(proto, replica, link, link.receive, lambda: clock["t"])
    assert clock["t"] < 5.0  # not final_wait
    assert proto.resyncs == 1 and proto.unmerged_steps() == [0]
    merges = [r for r in records if r.get("event") == "merge"]
    assert [(r["learners"], r["c_steps"]) for r in merges] == [([0], [1])]
    assert not link.syncer.learners[0].joined  # it left the life that now knows it


@pytest.mark.parametrize("apply", ["rebase", "overwrite"])
@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_mixing_contracts_the_outer_step_towards_one_round_of_work(apply, alpha):
    """Every learner adds the same vector g each step (synchronous, τ = 0, P = 1). With outer
    (lr, μ) Θ settles into moving S = lr/(1 − μ) rounds of work per round; learners that keep
    α of their distance to each merge pull Θ back by it in their next offer, and Θ moves
    S/(1 + α(S − 1)) rounds per round: 7 → 1.75 for DiLoCo's (0.7, 0.9) at α = 0.5."""
    H, rounds, lr, mu = 4, 80, 0.7, 0.9
    g = {k: np.full(s, 1e-3, np.float32) for k, s in SHAPES.items()}
    positions = []
    c = cfg(learners=2, quorum=2, fragments=1, sync_every=H, overlap=0, max_wait=-1,
            outer_lr=lr, outer_momentum=mu, apply=apply, alpha=alpha)  # fmt: skip
    sim = Sim(c, H * rounds, update=lambda params, m, step: g)
    sim.run(on_step=lambda s: positions.append(s.syncer.global_params()["block_0/w"][0, 0]))
    per_round = (positions[-1] - positions[-1 - 2 * 10 * H]) / 10  # 2 learners: 2 calls a step
    S = lr / (1 - mu)
    want = S / (1 + alpha * (S - 1)) * H * 1e-3
    assert per_round == pytest.approx(want, rel=2e-3), (per_round, want)


@pytest.mark.parametrize("apply", ["rebase", "land", "overwrite"])
def test_a_restore_holding_the_offer_in_flight_merges_none_of_its_steps_twice(apply):
    """The syncer merges the learner's step-4 offer (v1), checkpoints, and dies before v1
    reaches the learner; its restored life's Snapshot (v1, whose clock holds the offer) does.
    Each step Θ holds is held once, and the merges' step counts say which. With "overwrite"
    the resync rebased (keeping the offer's steps in θ on top of Θ_restored) and the next
    offer, counted from zero, brought them again: Θ held steps 1-4 twice."""
    c = cfg(learners=1, fragments=1, sync_every=4, overlap=2, apply=apply, max_wait=0.0)
    lost = {"epoch": None}

    def down_delay(m, msg):  # the dead life's messages never arrive
        return math.inf if getattr(msg, "epoch", None) == lost["epoch"] else 0.0

    sim = Sim(c, 12, down_delay=down_delay)

    def crash_after_the_first_merge(sim):
        if sim.syncer.version[0] == 1 and lost["epoch"] is None:
            lost["epoch"] = sim.syncer.epoch
            state = copy.deepcopy(sim.syncer.state_dict())
            meta = copy.deepcopy(sim.syncer.meta_dict())
            syncer = type(sim.syncer)(c, sim.plan, sim.theta0, record=sim.records.append, epoch=7)
            syncer.load_state_dict(state, meta, sim.t)
            sim.syncer = syncer
            sim._deliver([(0, syncer.snapshot(sim.t))])

    sim.run(on_step=crash_after_the_first_merge)
    assert lost["epoch"] is not None
    # Θ − Θ_0 in the basis of the learner's 12 step vectors: each coefficient 0 or 1.
    theta = sim.syncer.global_params()
    names = sorted(theta)
    zero = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    basis = np.stack([np.concatenate([sim.update(zero, 0, t)[k].ravel() for k in names])
                      for t in range(12)], axis=1)  # fmt: skip
    moved = np.concatenate([(theta[k] - sim.theta0[k]).ravel() for k in names])
    coef = np.linalg.lstsq(basis, moved, rcond=None)[0]
    held = np.round(coef)
    np.testing.assert_allclose(coef, held, atol=1e-3)
    assert set(held) <= {0.0, 1.0}, coef
    assert sim.merged_steps()[(0, 0)] == held.sum()
    if apply != "overwrite":
        assert held.sum() == 12


def test_a_left_learners_final_offer_refused_as_stale_is_merged_after_all():
    """Learner 0 (3 s links, 6 quick steps) leaves with its step-4 offer in flight and
    offers steps 5-6 on the version holding it; learner 1's merges make that offer stale
    (max_staleness 1). A learner that left gets no more versions, so its retries went on
    the same base and were refused until its final wait ran out: 4 of its 6 steps reached
    Θ. The syncer now sends it the fragment's version with the refusal."""
    c = cfg(learners=2, fragments=1, sync_every=4, overlap=0, max_staleness=1, final_wait=60.0)

    def delay(m, msg):
        return 3.0 if m == 0 else 0.0

    sim = Sim(c, 40, step_time=[0.1, 1.0], up_delay=delay, down_delay=delay)
    sim.learners[0].steps_left = 6
    sim.run()
    stale = [r for r in sim.records if r.get("event") == "reject" and r["kind"] == "stale"]
    assert stale and stale[0]["learner"] == 0  # the case this test is about
    assert sim.merged_steps() == {(0, 0): 6, (1, 0): 40}
