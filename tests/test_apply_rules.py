"""How a learner applies merged fragments ("rebase" vs "overwrite"), and the syncer's
schedule-slot rounds that decide which offers a merge holds.

Learner tests drive one real `Learner` (tiny model, 2 CPU devices) through a scripted link:
offers are materialised at once, and the test plays the syncer by hand-writing `Merged`
replies, so every parameter update can be checked exactly.
"""

import jax
import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco import models
from decoupled_diloco.data import make_iterator
from decoupled_diloco.diloco import compression
from decoupled_diloco.diloco.fragments import flatten_params, make_fragment_plan
from decoupled_diloco.diloco.learner import Learner
from decoupled_diloco.diloco.messages import Heartbeat, Join, Merged, Offer, Snapshot
from decoupled_diloco.diloco.syncer import Syncer, SyncerConfig
from decoupled_diloco.diloco.transport import LearnerLink
from decoupled_diloco.sharding import make_mesh

H = 2  # one fragment, due every 2 steps


class ScriptedLink(LearnerLink):
    def __init__(self, method: str):
        self.method, self.sent, self.inbox = method, [], []

    def send(self, msg):
        if isinstance(msg, Offer):
            msg.payload = msg.payload.materialize(self.method)
        self.sent.append(msg)

    def receive(self, timeout: float = 0.0) -> list:
        out, self.inbox = self.inbox, []
        return out

    def offers(self) -> list[Offer]:
        return [m for m in self.sent if isinstance(m, Offer)]


def make_learner(small_config, apply="rebase", method="none", overlap=0):
    cfg = small_config(
        **{
            "diloco.sync_every": H,
            "diloco.overlap": overlap,
            "diloco.apply": apply,
            "diloco.compression": method,
            "diloco.final_sync": False,
        }
    )
    run = config_lib.validate(cfg)
    abstract = jax.eval_shape(lambda: models.init_params(run.model, jax.random.key(0)))
    shapes = {k: tuple(v.shape) for k, v in flatten_params(abstract).items()}
    plan = make_fragment_plan(shapes, 1, "balanced", H)
    link = ScriptedLink(method)
    mesh = make_mesh(jax.devices()[:2], run.mesh)
    data = make_iterator(run.data, "train", run.train.batch_size, 0, 1)
    learner = Learner(0, run.learner, run.model, run.train, mesh, data, plan, link)
    learner.init_from_rng(jax.random.key(0))
    theta0 = learner.host_params()
    link.inbox.append(Snapshot({0: 0}, theta0, 0.0))
    learner.start()
    return learner, link, theta0


def global_update(theta0: dict, seed: int, scale: float = 1e-2) -> dict:
    """A stand-in Θ_new: Θ_0 moved by some other learners' work."""
    rng = np.random.default_rng(seed)
    return {
        k: (v + scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in theta0.items()
    }


def reply(theta: dict, version: int, learners=(), steps=(), method="none") -> Merged:
    payload = compression.encode(theta, method)
    return Merged(0, version, payload, tuple(learners), 0.0, 0, tuple(steps), (0,) * len(learners))


def assert_close(a: dict, b: dict, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=atol, rtol=1e-6, err_msg=k)


def test_a_round_without_us_rebases_and_keeps_all_local_work(small_config):
    learner, link, theta0 = make_learner(small_config)
    for _ in range(3):  # offers at step 2 (not merged yet), then step 3
        learner.run_step()
    before = learner.host_params()
    counters = (learner.c_steps[0], learner.c_tokens[0])
    theta1 = global_update(theta0, seed=1)
    link.inbox.append(reply(theta1, 1, learners=[5], steps=[2]))  # someone else's merge
    learner._receive(0.0)
    learner._apply_due()
    after = learner.host_params()
    assert_close(after, {k: before[k] + (theta1[k] - theta0[k]) for k in before})
    assert (learner.c_steps[0], learner.c_tokens[0]) == counters  # nothing of ours merged
    assert learner.base_version[0] == 1
    # The next offer, anchored on Θ_1, carries every step since Θ_0.
    learner.run_step()  # step 4: due
    v = compression.decode(link.offers()[-1].payload)
    assert link.offers()[-1].base_version == 1 and link.offers()[-1].c_steps == 4
    now = learner.host_params()
    assert_close(v, {k: theta1[k] - now[k] for k in v})


def test_a_merge_of_our_offer_keeps_the_steps_taken_since_it(small_config):
    learner, link, theta0 = make_learner(small_config, overlap=1)
    learner.run_step()
    learner.run_step()  # step 2: offers θ_2
    theta_s = learner.host_params()
    learner.run_step()  # step 3
    theta1 = global_update(theta0, seed=2)
    link.inbox.append(reply(theta1, 1, learners=[0, 3], steps=[2, 7]))
    before = learner.host_params()
    learner._receive(0.0)
    learner._apply_due()
    after = learner.host_params()
    assert_close(after, {k: theta1[k] + before[k] - theta_s[k] for k in before})
    assert learner.c_steps[0] == 1  # step 3 is not in Θ_1 yet
    assert learner.w_steps[0] == 1


def test_overwrite_mode_replaces_the_fragment(small_config):
    learner, link, theta0 = make_learner(small_config, apply="overwrite")
    for _ in range(3):
        learner.run_step()
    theta1 = global_update(theta0, seed=3)
    link.inbox.append(reply(theta1, 1, learners=[5], steps=[2]))
    learner._receive(0.0)
    learner._apply_due()
    np.testing.assert_equal(learner.host_params(), theta1)
    assert learner.c_steps[0] == 0


def test_tau_zero_merge_of_our_offer_is_an_exact_overwrite(small_config):
    learner, link, theta0 = make_learner(small_config)
    learner.run_step()
    theta1 = global_update(theta0, seed=4)
    link.inbox.append(reply(theta1, 1, learners=[0], steps=[2]))
    learner.run_step()  # step 2: offers, receives its merge, applies it at once
    np.testing.assert_equal(learner.host_params(), theta1)
    assert learner.c_steps[0] == 0


def test_lossy_offers_keep_what_the_syncer_did_not_receive(small_config):
    # Error feedback: after a merge of a 1-bit offer, the next outer gradient is v − v̂.
    learner, link, theta0 = make_learner(small_config, method="int1")
    learner.run_step()
    learner.run_step()  # offers v = Θ_0 − θ_2, int1-compressed
    theta_s = learner.host_params()
    v = {k: theta0[k] - theta_s[k] for k in theta0}
    v_hat = compression.decode(link.offers()[-1].payload)
    theta1 = global_update(theta0, seed=5)
    link.inbox.append(reply(theta1, 1, learners=[0], steps=[2]))
    learner._receive(0.0)
    learner._apply_due()
    after = learner.host_params()
    assert_close({k: theta1[k] - after[k] for k in after}, {k: v[k] - v_hat[k] for k in v})
    assert max(float(np.abs(v[k] - v_hat[k]).max()) for k in v) > 1e-4  # int1 really is lossy


# --- syncer rounds -----------------------------------------------------------------------
SHAPES = {"embedder/input_embedding": (16, 8), "block_0/w": (8, 8)}


def syncer(rounds="scheduled", quorum=1, learners=3):
    plan = make_fragment_plan(SHAPES, 1, "balanced", sync_every=4)
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    cfg = SyncerConfig(quorum=quorum, grace_gamma=0.0, rounds=rounds)
    s = Syncer(cfg, plan, params, learners)
    for m in range(learners):
        s.handle(Join(m, 0, 0.0), 0.0)
    return s


def offer(learner: int, step: int, base: int = 0) -> Offer:
    grads = {k: np.full(s, 0.01 * (learner + 1), np.float32) for k, s in SHAPES.items()}
    return Offer(learner, 0, 0, step, 4, 256, base, 0.0, 4, compression.encode(grads, "none"))


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


@pytest.mark.parametrize("drop", [True, False])
def test_an_offer_repeating_merged_work_is_dropped(drop):
    s = syncer(learners=2)
    s.cfg = SyncerConfig(quorum=1, grace_gamma=0.0, drop_superseded=drop)
    s.handle(offer(0, step=4), 1.0)  # merged into version 1
    # Learner 0's next offer was made before it applied version 1: base 0 < 1.
    s.handle(offer(0, step=8, base=0), 2.0)
    assert s.version[0] == (1 if drop else 2)


def test_a_late_offer_does_not_open_a_round_or_eat_the_grace_window():
    s = syncer(learners=3)
    s.cfg = SyncerConfig(quorum=1, grace_gamma=1.0, max_grace=10.0, overlap=2)
    for m in range(3):
        s.handle(Heartbeat(m, 0, 1, 1.0, 0.0), 0.0)  # 1 s steps: grace budget τ·ξ = 2 s
    assert not merged(s.handle(offer(0, step=4), 1.0))  # quorum; grace runs until t = 3
    assert not merged(s.handle(offer(1, step=5), 1.5))
    (m,) = merged(s.tick(3.1))
    assert m.learners == (0, 1)
    s.handle(offer(2, step=4), 5.0)  # late: waits for the next round, opens none
    assert s.round_open[0] is None
    assert not merged(s.handle(offer(0, step=8, base=1), 20.0))  # fresh: quorum at once
    assert s.grace_window() == pytest.approx(2.0, rel=0.2)  # no 15 s "time to quorum"
    (m,) = merged(s.tick(22.5))
    assert m.learners == (0, 2)


def test_time_spent_evaluating_is_not_allocated_training_time():
    from decoupled_diloco.runtime.accounting import Ledger

    class Done:
        step = 10

    def goodput(idle: float) -> float:
        ledger = Ledger(1)
        for i in range(10):
            ledger.step(0, 1.0, now=1.0 + i + (idle if i >= 5 else 0.0))
        ledger.idle(0, idle)
        ledger.finish(0, 10.0 + idle)
        return ledger.summary(10.0 + idle, uses_syncer=False, learners=[Done()])["goodput"]

    assert goodput(0.0) == pytest.approx(1.0)
    assert goodput(4.0) == pytest.approx(1.0)  # a 4 s evaluation mid-run costs no goodput


def test_allocation_ends_when_training_ends_not_after_the_tail():
    from decoupled_diloco.runtime.accounting import Ledger

    class Done:
        step = 10

    ledger = Ledger(1)
    for i in range(10):
        ledger.step(0, 1.0, now=1.0 + i)
    ledger.finish(0, 10.0)  # last step done: final offers and checkpoint follow
    ledger.finish(0, 13.0)  # the runtime's final report after its 3 s tail
    assert ledger.summary(13.0, uses_syncer=False, learners=[Done()])["goodput"] == pytest.approx(
        1.0
    )


def test_step_time_estimate_leaves_out_the_compiling_first_step(small_config):
    """The heartbeat's step time (the syncer's grace window is built on it) must not carry
    the first step's compilation, after a start and after a crash alike."""
    learner, link, _ = make_learner(small_config)
    clock = {"t": 0.0}
    learner.clock = lambda: clock["t"]

    learner.run_step()  # its interval to the next step start holds the compilation
    clock["t"] += 30.0
    for _ in range(5):
        learner.run_step()
        clock["t"] += 0.5
    learner.run_step()
    assert learner.step_seconds == pytest.approx(0.5)
    learner.crash()
    assert learner.step_seconds == 0.0 and learner.timed_intervals == 0
