"""Fault matrix, offers and control messages (issue 18, items 2 and 3): each attack found by
hand, driven against a real `Syncer` with hand-built messages under a fake clock. Every
attack is refused with a logged reason and a counted kind; Θ stays bit-identical; the
learners it targets are not locked out; merges go on."""

import dataclasses

import numpy as np
import pytest

from decoupled_diloco.diloco import compression, refusals, syncer_state
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragments import make_fragment_plan
from decoupled_diloco.diloco.messages import Dropped, Heartbeat, Join, Leave, Merged, Offer
from decoupled_diloco.diloco.offer_checks import SLOT_WINDOW, RunBounds
from decoupled_diloco.diloco.syncer import Syncer
from decoupled_diloco.runtime.summary import refusal_counts

SHAPES = {"embedder/input_embedding": (16, 8), "block_0/attn/q": (8, 8),
          "block_0/ffw/up": (8, 12), "final_norm/scale": (8,)}  # fmt: skip
H, P, TOKENS = 4, 2, 64  # sync_every, fragments, tokens per learner step
BOUNDS = RunBounds(tokens_per_step=TOKENS, max_step=10_000)
CFG = DilocoConfig(learners=2, sync_every=H, fragments=P, quorum=1, grace_gamma=0.0)


class Run:
    """A syncer with learners 0 and 1 joined; `offer` makes honest offers of fragment 1,
    each at its learner's next due step (a new schedule slot), after a heartbeat of the
    learner's previous step, as a real learner's messages arrive."""

    def __init__(self, cfg: DilocoConfig = CFG):
        rng = np.random.default_rng(0)
        self.params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        self.plan = make_fragment_plan(SHAPES, P, "balanced", sync_every=H)
        self.log: list[dict] = []
        self.syncer = Syncer(cfg, self.plan, self.params, record=self.log.append, bounds=BOUNDS)
        self.now, self.steps, self.rng = 0.0, [0, 0], np.random.default_rng(1)
        for m in range(2):
            self.send(Join(m, 0, self.now, 0, TOKENS))

    def send(self, msg) -> list:
        self.now += 0.1
        return self.syncer.handle(msg, self.now)

    def grad(self, scale: float = 0.01) -> dict:
        return {k: (scale * self.rng.standard_normal(SHAPES[k])).astype(np.float32)
                for k in self.plan.names[1]}  # fmt: skip

    def offer(self, learner: int = 0, grad: dict | None = None, **kw) -> Offer:
        self.steps[learner] += H
        step = self.steps[learner]
        self.send(Heartbeat(learner, 0, step - 1, 0.1, self.now))
        payload = compression.encode(self.grad() if grad is None else grad, "none")
        fields = dict(learner=learner, incarnation=0, fragment=1, step=step, c_steps=H,
                      c_tokens=H * TOKENS, base_version=self.syncer.version[1], time=self.now,
                      payload=payload, nbytes=payload.nbytes())  # fmt: skip
        return Offer(**{**fields, **kw})

    def theta(self) -> dict:
        return {k: v.copy() for k, v in self.syncer.global_params().items()}

    def events(self, event: str) -> list[dict]:
        return [r for r in self.log if r["event"] == event]

    def registry(self) -> dict:
        """Every learner's entry, last_seen aside."""
        return {m: dataclasses.replace(i, last_seen=0.0) for m, i in self.syncer.learners.items()}


def merges(out) -> list[Merged]:
    return [msg for _, msg in out if isinstance(msg, Merged)]


def assert_rejected(run: Run, out, kind: str, before: dict, text: str = "") -> None:
    """The offer was rejected with `kind`, logged, counted, its learner told; Θ unchanged."""
    assert not merges(out)
    rejection = run.events("reject")[-1]
    assert rejection["kind"] == kind and text in rejection["reason"], rejection
    assert run.syncer.stats[f"reject:{kind}"] >= 1
    assert [type(msg) for _, msg in out] == [Dropped]
    assert not run.syncer.pending[1]
    for k, v in run.syncer.global_params().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


@pytest.mark.parametrize("history", [0, 6], ids=["first offer", "after honest offers"])
def test_an_offer_of_finite_1e15s_is_rejected_and_theta_unchanged(history):
    run = Run()
    for i in range(history):
        assert merges(run.send(run.offer(i % 2)))
    before, version = run.theta(), run.syncer.version[1]
    poison = {k: np.full(v.shape, 1e15, np.float32) for k, v in run.grad().items()}
    out = run.send(run.offer(0, poison))
    assert_rejected(run, out, "norm", before, "max_offer_norm_ratio")
    assert run.syncer.version[1] == version
    assert merges(run.send(run.offer(1)))  # honest work merges on


def test_the_norm_bound_is_the_ratio_times_the_median_of_recent_offers():
    run = Run()
    for i in range(6):  # honest offers: RMS 0.01 per parameter
        run.send(run.offer(i % 2))
    # 50x the median is within the default ratio of 100 (an honest restart or a one-step
    # offer is far closer); 200x is not.
    assert merges(run.send(run.offer(0, run.grad(0.5))))
    before = run.theta()
    assert_rejected(run, run.send(run.offer(1, run.grad(2.0))), "norm", before)
    # 0 turns the check off: the same poison is merged (what the knob guards against).
    off = Run(dataclasses.replace(CFG, max_offer_norm_ratio=0.0))
    poison = {k: np.full(v.shape, 1e15, np.float32) for k, v in off.grad().items()}
    assert merges(off.send(off.offer(0, poison)))
    assert np.abs(off.syncer.global_params()["block_0/attn/q"]).max() > 1e13


@pytest.mark.parametrize("ratio", [0.5, -1.0])
def test_the_norm_ratio_knob_is_validated(ratio):
    with pytest.raises(ValueError, match="diloco.max_offer_norm_ratio must be 0 .off. or >= 1"):
        DilocoConfig(max_offer_norm_ratio=ratio).validate()
    DilocoConfig(max_offer_norm_ratio=0.0).validate()  # off


def test_an_offer_claiming_2_53_tokens_in_one_step_is_rejected():
    run = Run()
    before = run.theta()
    out = run.send(run.offer(0, c_tokens=2**53, c_steps=1))
    assert_rejected(run, out, "tokens_per_step", before, "train.batch_size x data.seq_len")
    # One token more than c_steps full batches is too many; exactly full batches merge.
    out = run.send(run.offer(0, c_tokens=H * TOKENS + 1))
    assert_rejected(run, out, "tokens_per_step", before)
    assert merges(run.send(run.offer(0, c_tokens=H * TOKENS)))
    assert run.syncer.learners[0].tokens_per_step == TOKENS  # its weight was never inflated


@pytest.mark.parametrize("base", [-1, -64])
def test_a_negative_base_version_is_rejected(base):
    run = Run()  # max_staleness = 64: -1...-64 are within it
    before = run.theta()
    assert_rejected(run, run.send(run.offer(0, base_version=base)), "base_version", before)


def test_an_offer_far_ahead_in_slots_is_rejected_and_k1_keeps_merging():
    run = Run()
    ahead = run.offer(0)
    before = run.theta()
    # 63 slots ahead of its learner's reports (within the old 64-slot lead, which let it
    # cover slot 64 and leave every later offer without a fresh round).
    out = run.send(dataclasses.replace(ahead, step=ahead.step + 63 * H))
    assert_rejected(run, out, "step", before, "from the future")
    # K = 1: every slot's first offer closes its round at once, as before the attack.
    versions = []
    for slot in range(7):
        run.steps[0] = run.steps[1] = slot * H
        assert merges(run.send(run.offer(slot % 2)))
        versions.append(run.syncer.version[1])
    assert versions == list(range(1, 8))
    # The window: SLOT_WINDOW slots past the learner's reported step merge, one more does not.
    reported = run.syncer.learners[0].step
    before = run.theta()
    out = run.send(run.offer(0, step=reported + (SLOT_WINDOW + 1) * H))
    assert_rejected(run, out, "step", before)
    assert merges(run.send(run.offer(0, step=reported + SLOT_WINDOW * H)))


def test_an_offer_without_work_is_rejected_with_an_event():
    run = Run()
    before = run.theta()
    out = run.send(run.offer(0, c_steps=0, c_tokens=0))
    assert_rejected(run, out, "counters", before, "c_steps=0")
    (notice,) = [msg for _, msg in out if isinstance(msg, Dropped)]
    assert notice.learner == 0 and "c_steps=0" in notice.reason


def test_an_offer_claiming_steps_already_merged_is_rejected():
    run = Run()
    assert merges(run.send(run.offer(0)))  # step 4 is in version 1
    before = run.theta()
    out = run.send(run.offer(0, c_steps=2 * H, c_tokens=2 * H * TOKENS))  # step 8: 4 new steps
    assert_rejected(run, out, "counters", before, "merged already")


def test_a_heartbeat_of_a_huge_incarnation_is_dropped_and_locks_nobody_out():
    run = Run()
    registry = run.registry()
    assert run.send(Heartbeat(0, 10**18, 5, 0.1, run.now)) == []
    # One life ahead without a Join, while learner 0 is live: not its join either.
    assert run.send(Heartbeat(0, 1, 5, 0.1, run.now)) == []
    assert [r["kind"] for r in run.events("drop_message")] == ["implausible", "new_incarnation"]
    assert run.registry() == registry
    assert merges(run.send(run.offer(0)))  # learner 0's real life goes on
    # A real restart (a Join) still starts a new life.
    assert run.send(Join(0, 1, run.now, 8, TOKENS))
    assert run.syncer.learners[0].incarnation == 1


def test_a_heartbeat_of_a_huge_step_is_dropped_and_the_future_check_holds():
    run = Run()
    assert run.send(Heartbeat(0, 0, 2**60, 0.1, run.now)) == []
    assert run.events("drop_message")[-1]["kind"] == "implausible"
    assert run.syncer.learners[0].step < BOUNDS.max_step
    before = run.theta()
    out = run.send(run.offer(0, step=BOUNDS.max_step))  # still far ahead of its reports
    assert_rejected(run, out, "step", before, "from the future")
    out = run.send(run.offer(0, step=BOUNDS.max_step + H))
    assert_rejected(run, out, "step", before, "past the run's")


class Bare:
    """A message with no fields at all."""


def _without(msg, field: str):
    delattr(msg, field)
    return msg


MALFORMED = [
    ("join learner is a string", Join("0", 0, 0.0), "malformed"),
    ("join incarnation None", Join(0, None, 0.0), "malformed"),
    ("join step None", Join(0, 0, 0.0, step=None), "malformed"),
    ("join tokens a string", Join(0, 0, 0.0, tokens_per_step="x"), "malformed"),
    ("join bool learner", Join(True, 0, 0.0), "malformed"),
    ("join float incarnation", Join(0, 1.0, 0.0), "malformed"),
    ("join nan time", Join(0, 0, float("nan")), "malformed"),
    ("join negative step", Join(0, 0, 0.0, step=-1), "implausible"),
    ("join past the run's steps", Join(0, 0, 0.0, step=10**12), "implausible"),
    ("join batch too large", Join(0, 0, 0.0, tokens_per_step=2**53), "implausible"),
    ("join negative incarnation", Join(0, -1, 0.0), "malformed"),
    ("join learner out of range", Join(5, 0, 0.0), "unknown_learner"),
    ("join missing incarnation", _without(Join(0, 0, 0.0), "incarnation"), "malformed"),
    ("heartbeat learner None", Heartbeat(None, 0, 0, 0.1, 0.0), "malformed"),
    ("heartbeat step a string", Heartbeat(0, 0, "s", 0.1, 0.0), "malformed"),
    ("heartbeat nan step time", Heartbeat(0, 0, 1, float("nan"), 0.0), "malformed"),
    ("heartbeat negative step time", Heartbeat(0, 0, 1, -1.0, 0.0), "malformed"),
    ("heartbeat step seconds string", Heartbeat(0, 0, 1, "s", 0.0), "malformed"),
    ("heartbeat list learner", Heartbeat([0], 0, 1, 0.1, 0.0), "malformed"),
    ("heartbeat missing step", _without(Heartbeat(0, 0, 1, 0.1, 0.0), "step"), "malformed"),
    ("leave incarnation a string", Leave(0, "x", 0.0), "malformed"),
    ("leave all None", Leave(None, None, None, None), "malformed"),
    ("leave finished a string", Leave(0, 0, 0.0, finished="yes"), "malformed"),
    ("leave of a life far ahead", Leave(0, 5000, 0.0), "implausible"),
    ("unknown message type", Bare(), "unknown_type"),
    ("a plain object", object(), "unknown_type"),
]


@pytest.mark.parametrize("case,msg,kind", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_control_message_is_logged_and_dropped_never_raised(case, msg, kind):
    run = Run()
    registry, before = run.registry(), run.theta()
    assert run.send(msg) == []
    (drop,) = run.events("drop_message")
    assert drop["kind"] == kind and drop["reason"], drop
    assert drop["message"] == type(msg).__name__
    assert run.syncer.stats["dropped_messages"] == 1
    assert refusals.by_kind(run.syncer.stats, "drop_message") == {kind: 1}
    assert run.registry() == registry
    assert merges(run.send(run.offer(0)))  # the syncer is unharmed
    assert not np.array_equal(run.syncer.global_params()["block_0/attn/q"],
                              before["block_0/attn/q"])  # fmt: skip


def test_refusal_counts_survive_a_restore_and_reach_the_summary():
    run = Run()
    for i in range(5):
        run.send(run.offer(i % 2))
    before = run.theta()
    assert_rejected(run, run.send(run.offer(0, base_version=-1)), "base_version", before)
    run.send(run.offer(0, c_tokens=2**53, c_steps=1))
    run.send(Heartbeat(0, 0, 2**60, 0.1, run.now))
    run.send(Leave(None, None, None))
    run.syncer.handle(dataclasses.replace(run.offer(1), epoch=9), run.now)  # a lost life's
    stats = run.syncer.stats
    counters = ("rejected_offers", "dropped_offers", "dropped_messages")
    assert [stats[k] for k in counters] == [2, 1, 2]
    assert len(run.events("reject")) == 2 and len(run.events("drop_offer")) == 1

    # A restored syncer continues the counts and the offers' scale from its checkpoint.
    restored = Syncer(CFG, run.plan, run.params, bounds=BOUNDS, epoch=1)
    restored.load_state_dict(run.syncer.state_dict(), run.syncer.meta_dict(), run.now)
    assert {k: n for k, n in restored.stats.items() if refusals.is_count(k)} == {
        k: n for k, n in stats.items() if refusals.is_count(k)
    }
    assert list(restored.scale.recent[1]) == list(run.syncer.scale.recent[1])
    assert syncer_state.meta_dict(restored)["stats"]["dropped_messages"] == 2

    # summary.json: per kind, summed over syncer shards.
    counts = refusal_counts([stats, restored.stats])
    assert counts["rejections_by_reason"] == {"base_version": 2, "tokens_per_step": 2}
    assert counts["offer_drops_by_reason"] == {"epoch": 2}
    assert counts["message_drops_by_reason"] == {"implausible": 2, "malformed": 2}
    assert counts["dropped_messages"] == 4


@pytest.mark.slow
def test_an_honest_run_with_a_straggler_refuses_nothing(small_config, tmp_path):
    """The bounds are generous: late offers holding many steps, final offers of one or two
    steps and the learning-rate warmup stay within them in a real run, and summary.json
    carries the (zero) counters."""
    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime.local import LocalRuntime

    cfg = small_config(**{"diloco.learners": 2, "diloco.sync_every": 4, "diloco.fragments": 2,
                          "diloco.overlap": 1, "diloco.quorum": 1, "train.steps": 16,
                          "faults.speed_factors": [1.0, 4.0]})  # fmt: skip
    summary = LocalRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False).run()
    assert summary["merges"] >= 8
    for key in ("rejected_offers", "dropped_offers", "dropped_messages"):
        assert summary[key] == 0, key
    for key in ("rejections_by_reason", "offer_drops_by_reason", "message_drops_by_reason"):
        assert summary[key] == {}, key


def test_a_lost_lifes_offer_is_dropped_whoever_its_learner_is_to_the_new_life():
    """An offer made before a syncer restore reaches the restored life as an epoch drop,
    also when its learner has not joined that life yet or restarted since its checkpoint
    (it was rejected as from an unknown learner or a wrong incarnation). A malformed or
    impossible sender is still rejected."""
    run = Run()
    old = run.offer(0)
    log: list[dict] = []
    restored = Syncer(CFG, run.plan, run.params, record=log.append, bounds=BOUNDS, epoch=1)
    restored.load_state_dict(run.syncer.state_dict(), run.syncer.meta_dict(), run.now)
    fresh = Syncer(CFG, run.plan, run.params, record=log.append, bounds=BOUNDS, epoch=1)
    before = {k: v.copy() for k, v in restored.global_params().items()}
    for syncer, offer in (
        (restored, old),  # known, at the offer's incarnation
        (restored, dataclasses.replace(old, incarnation=1)),  # known at an older one
        (fresh, old),  # not joined to this life yet
    ):
        syncer.handle(offer, run.now)
    assert [r["kind"] for r in log if r["event"] in ("reject", "drop_offer")] == ["epoch"] * 3
    assert all(s.stats["rejected_offers"] == 0 for s in (restored, fresh))
    for offer, kind in ((dataclasses.replace(old, learner=7), "sender"),
                        (dataclasses.replace(old, epoch="0"), "envelope")):  # fmt: skip
        restored.handle(offer, run.now)
        assert log[-1]["event"] == "reject" and log[-1]["kind"] == kind
    for k, v in restored.global_params().items():
        np.testing.assert_array_equal(v, before[k])
