"""The learner's asynchronous pipeline: batches read ahead (data/prefetch.py) and merges
staged on the devices ahead of the boundary that applies them (runtime/boundary.py) change
when host work happens, never what the learner computes."""

import threading

import jax
import numpy as np
import pytest
from conftest import threads_left
from protocol_sim import HeldExecutor, NumpyReplica, Sim
from test_work_conservation import assert_every_step_merged_once, cfg

from decoupled_diloco.data import DataConfig, make_iterator
from decoupled_diloco.data.prefetch import Prefetch


def _iterator():
    return make_iterator(DataConfig(seq_len=16), "train", batch_size=4)


def test_prefetch_yields_the_plain_iterators_batches_and_state():
    plain, ahead = _iterator(), Prefetch(_iterator(), depth=3)
    for _ in range(7):
        np.testing.assert_array_equal(next(ahead), next(plain))
        # The consumer's position, however far ahead the reader thread is.
        assert ahead.get_state() == plain.get_state()
    ahead.close()


def test_prefetch_resumes_at_the_next_batch_after_set_state_and_close():
    plain, ahead = _iterator(), Prefetch(_iterator(), depth=4)
    for _ in range(3):
        next(ahead)
    saved = ahead.get_state()
    batches = [next(ahead) for _ in range(5)]
    ahead.set_state(saved)  # a resume from a checkpoint taken after 3 batches
    for b in batches:
        np.testing.assert_array_equal(next(ahead), b)
    ahead.close()  # rewinds the source to the consumer's position
    plain.set_state(ahead.get_state())
    np.testing.assert_array_equal(next(ahead), next(plain))
    ahead.close()


def test_prefetch_skips_batches_without_placing_them():
    """A rejoin skips the steps Θ already holds: each skipped batch was placed on the
    devices (the prefetcher's `put`) only to be dropped."""
    placed = []

    def put(batch):
        placed.append(batch)
        return batch

    plain, ahead = _iterator(), Prefetch(_iterator(), depth=2, put=put)
    np.testing.assert_array_equal(next(ahead), next(plain))
    for _ in range(6):
        next(plain)
    ahead.close()  # (what the reader placed ahead so far is not the skip's)
    placed.clear()
    ahead.skip(6)
    assert ahead.get_state() == plain.get_state()
    np.testing.assert_array_equal(next(ahead), next(plain))
    assert len(placed) <= 3  # the next batch and the reader's look-ahead, none skipped
    ahead.close()


def test_prefetch_places_batches_on_its_own_thread():
    threads = []

    def put(batch):
        threads.append(threading.current_thread().name)
        return batch + 1

    plain, ahead = _iterator(), Prefetch(_iterator(), depth=2, put=put)
    np.testing.assert_array_equal(next(ahead), next(plain) + 1)
    assert threads and all(name == "prefetch" for name in threads)
    ahead.close()


class _Failing:
    """Three good batches, then an error."""

    batch_size = 1

    def __init__(self):
        self.i = 0

    def __next__(self):
        self.i += 1
        if self.i > 3:
            raise OSError("record 4 is corrupt")
        return np.full((1, 2), self.i)

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = state["i"]


def test_prefetch_raises_a_readers_error_at_the_batch_it_belongs_to():
    ahead = Prefetch(_Failing(), depth=8)
    assert [int(next(ahead)[0, 0]) for _ in range(3)] == [1, 2, 3]
    with pytest.raises(OSError, match="record 4 is corrupt"):
        next(ahead)
    assert ahead.get_state() == {"i": 3}


def test_prefetch_retries_a_batch_whose_placement_failed():
    """A failed `put` (placing a batch on the devices) left the reader past that batch: the
    retry the docstring promises read the next one, and the failed batch was lost."""
    plain, calls = _iterator(), []

    def put(batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("transient device error")
        return batch

    ahead = Prefetch(_iterator(), depth=2, put=put)
    want = [next(plain) for _ in range(5)]
    got = [next(ahead), next(ahead)]
    with pytest.raises(RuntimeError, match="transient"):
        next(ahead)
    got += [next(ahead), next(ahead), next(ahead)]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    ahead.close()


def test_prefetch_rejects_a_depth_below_one():
    with pytest.raises(ValueError, match="depth"):
        Prefetch(_iterator(), depth=0)


def _final_state(sim: Sim) -> dict:
    out = {f"theta/{k}": v for k, v in sim.syncer.global_params().items()}
    for lr in sim.learners:
        out.update({f"{lr.proto.id}/{k}": v for k, v in lr.replica.host_params().items()})
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # rebase, τ = 1
        dict(overlap=0, compression="int8"),  # lossy offers: error feedback through v̂
        dict(apply="overwrite", overlap=2, alpha=0.5),
        dict(learners=4, quorum=2, alpha=0.25, outer_momentum=0.9, outer_lr=0.7),
        dict(apply="land", overlap=2, alpha=0.5),
    ],
)
@pytest.mark.parametrize("device_rebase", [False, True])
def test_staged_merges_give_bit_identical_models(kw, device_rebase):
    """Every learner's θ and the syncer's Θ are bit-identical with merges staged ahead and
    computed at the boundary; most applied merges were staged. With `device_rebase` the
    stager computes rebases from Θ_new, v̂ and the G it kept from the version before
    (placed again only when it has not got it: a learner's first merge of a fragment)."""
    runs = {}
    for stage in (False, True):
        sim = Sim(cfg(**kw), 30, up_delay=lambda m, msg: 1.5 * m,
                  down_delay=lambda m, msg: 0.7 + m, stage=stage,
                  device_rebase=device_rebase)  # fmt: skip
        sim.run()
        runs[stage] = sim
    plain, staged = _final_state(runs[False]), _final_state(runs[True])
    for k in plain:
        np.testing.assert_array_equal(staged[k], plain[k], err_msg=k)
    stagers = [lr.stager for lr in runs[True].learners]
    hits, misses = sum(s.hits for s in stagers), sum(s.misses for s in stagers)
    assert hits > 0 and hits >= misses, (hits, misses)
    moves = sum(s.anchor_moves for s in stagers)
    rebases = sum(s.rebases for s in stagers)
    on_device = sum(s.offers_on_device for s in stagers)
    if not device_rebase or kw.get("apply") == "overwrite":
        assert rebases == moves == on_device == 0  # overwrites are mixes: no G kept
        return
    # Offers whose v = G − θ the devices computed from the G kept: all but each fragment's
    # first (no merge yet) and the final sync's.
    assert on_device >= runs[True].syncer.stats["offers"] // 2, on_device
    # G placed once per learner and fragment (its first merge), and again only where a
    # version superseded one staged before it was applied, which these delays make rare.
    first = len(stagers) * runs[True].plan.num_fragments
    assert rebases > 2 * first and moves <= first + rebases // 10, (rebases, moves, first)


def test_a_learner_that_never_waits_applies_a_merge_once_it_is_placed():
    """max_wait 0: a rebase whose update is still being placed is applied at a later
    boundary instead of waited for, and every step still reaches Θ exactly once with the
    roster's coefficient."""
    held, seen, steps = HeldExecutor(), {"calls": 0, "deferred": 0}, 30

    def on_step(sim):  # the stager's thread finishes only every 7th learner step
        seen["deferred"] = max(seen["deferred"], *(f.deferred for lr in sim.learners
                                                   for f in lr.proto.frags))  # fmt: skip
        seen["calls"] += 1
        if seen["calls"] % 7 == 0:
            held.release()

    # τ = 3 and quick replies: versions arrive boundaries before the one that applies them
    sim = Sim(cfg(overlap=3), steps, up_delay=lambda m, msg: 0.3 * m,
              down_delay=lambda m, msg: 0.2 + 0.3 * m, stage=True, stage_executor=held)  # fmt: skip
    sim.run(on_step)
    assert seen["deferred"] > 0  # some rebases were not placed by the boundary due
    assert sum(lr.proto.deferrals for lr in sim.learners) >= seen["deferred"]  # counted
    assert_every_step_merged_once(sim, steps)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "kw",
    [
        dict(overlap=0, fragments=1),
        dict(overlap=1, fragments=3),
        dict(overlap=0, fragments=2, quorum=2),
        dict(overlap=1, fragments=3, quorum=2, compression="int8"),
        dict(overlap=1, fragments=3, apply="land"),
    ],
)
@pytest.mark.parametrize("device_rebase", [False, True])
def test_deferred_merges_conserve_work_whenever_placements_finish(seed, kw, device_rebase):
    """Placements finish at random moments (also after a learner's last step, whose
    deferred merge the final sync must apply before offering the rest); with
    `device_rebase`, versions superseded and cancelled before their job ran leave the G a
    rebase takes right."""
    rng = np.random.default_rng(seed)
    ups, downs = rng.uniform(0, 3, 3), rng.uniform(0, 4, 3)
    held, steps = HeldExecutor(), 30

    def on_step(sim):
        if rng.random() < 0.25:
            held.release()

    sim = Sim(cfg(**kw), steps, up_delay=lambda m, msg: ups[m], down_delay=lambda m, msg: downs[m],
              step_time=[1.0, 1.7, 0.6], stage=True, stage_executor=held,
              device_rebase=device_rebase)  # fmt: skip
    sim.run(on_step)
    if kw.get("compression", "none") == "none":
        assert_every_step_merged_once(sim, steps)
    else:  # lossy offers: Θ is not exact, but every step is merged once
        merged = sim.merged_steps()
        assert all(merged.get((m, p), 0) == steps
                   for m in range(3) for p in range(sim.plan.num_fragments)), merged  # fmt: skip


def test_a_device_rebase_takes_the_g_its_update_names():
    """The stager keeps the Θ_new it placed as the next rebase's G only for the update that
    names it: a version superseding one staged before it was applied rebases on the G
    before both (placed again), a rebase after an applied one on the kept Θ_new, and after
    `clear` (a restart) nothing kept is used."""
    from protocol_sim import ImmediateExecutor

    from decoupled_diloco.diloco import compression
    from decoupled_diloco.diloco.updates import Rebase, Update, rebase_delta
    from decoupled_diloco.runtime.boundary import MergeStager

    rng = np.random.default_rng(0)
    thetas = [{"w": rng.standard_normal(5).astype(np.float32)} for _ in range(5)]
    sent = {"w": rng.standard_normal(5).astype(np.float32)}
    stager = MergeStager(NumpyReplica(0, None), ImmediateExecutor(), device_rebase=True)

    def staged(version, anchored, anchor_version, held=False):
        """The x the stager computes for Θ_version on G = Θ_anchor_version, and the host's."""
        payload = compression.encode(thetas[version], "none")
        v = sent if held else None
        key = (0, 0, version, 0, anchored, held, False)
        r = Rebase(payload, thetas[anchor_version], v, (0, 0, 0, anchored, anchor_version),
                   (0, 0, 0, anchored + 1, version))  # fmt: skip
        u = Update("add", lambda: rebase_delta(thetas[anchor_version], thetas[version], v), 0.0,
                   key, rebase=r)  # fmt: skip
        stager.stage([u])
        return stager.take(u)["w"], u.arrays["w"]

    for device, host in [
        staged(1, 0, 0),  # the first: G placed
        staged(2, 0, 0, held=True),  # supersedes version 1 (never applied): G placed again
        staged(3, 1, 2),  # version 2 applied: its Θ_new is this G
        staged(4, 2, 3, held=True),
    ]:
        np.testing.assert_array_equal(device, host)
    assert stager.anchor_moves == 2 and stager.rebases == 4
    stager.clear()
    device, host = staged(4, 3, 4)  # would find Θ_4 kept under this G's name, but a restart
    np.testing.assert_array_equal(device, host)
    assert stager.anchor_moves == 3


def test_the_stager_defers_only_what_had_a_boundary_to_be_placed():
    """An update staged at this boundary is applied now (waiting for it costs no more than
    computing it here); one staged at an earlier boundary and still not placed waits for a
    later boundary; once placed, it is ready."""
    from decoupled_diloco.diloco.updates import Update
    from decoupled_diloco.runtime.boundary import MergeStager

    held = HeldExecutor()
    stager = MergeStager(NumpyReplica(0, None), held)
    stager.next_boundary()
    u = Update("add", {"w": np.ones(2, np.float32)}, key=("w", 0, 1))
    stager.stage([u])
    assert stager.ready(u.key)  # first seen here: apply now
    stager.next_boundary()
    assert not stager.ready(u.key)  # it had a whole step: placement is slow, defer
    held.release()
    assert stager.ready(u.key)
    np.testing.assert_array_equal(stager.take(u)["w"], np.ones(2))
    assert stager.ready(("w", 0, 2))  # never staged: computed at the boundary


def test_closing_a_stager_ends_its_own_worker_and_leaves_a_callers_pool_running():
    import concurrent.futures

    from decoupled_diloco.diloco.updates import Update
    from decoupled_diloco.runtime.boundary import MergeStager

    u = Update("add", {"w": np.ones(2, np.float32)}, key=("w", 0, 1))
    before = set(threading.enumerate())
    own = MergeStager(NumpyReplica(0, None))
    own.stage([u])
    np.testing.assert_array_equal(own.take(u)["w"], np.ones(2))
    own.close()
    assert threads_left(before) == []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        MergeStager(NumpyReplica(0, None), pool).close()
        assert pool.submit(int, "7").result() == 7  # still the caller's to use


def test_a_placement_slower_than_a_step_is_deferred_even_when_first_seen_here():
    """A version first seen at the boundary that applies it is waited for only when the
    placements so far say it is placed within WAIT_SHARE of a step or within the time the
    learner waits for its device anyway; a learner whose merges take longer than that to
    place (big fragments, fast steps) keeps stepping instead."""
    from decoupled_diloco.diloco.updates import Update
    from decoupled_diloco.runtime.boundary import WAIT_SHARE, MergeStager

    now = [0.0]

    class SlowReplica(NumpyReplica):
        def place(self, arrays):  # placing takes 0.5 s of the stager's clock
            now[0] += 0.5
            return super().place(arrays)

    held = HeldExecutor()
    stager = MergeStager(SlowReplica(0, None), held, clock=lambda: now[0])
    stager.next_boundary()
    first = Update("add", {"w": np.ones(2, np.float32)}, key=("w", 0, 1))
    stager.stage([first])
    assert stager.ready(first.key, step_seconds=0.1)  # nothing known yet: wait for it
    held.release()
    assert stager.job_seconds == pytest.approx(0.5)
    stager.take(first)

    stager.next_boundary()
    second = Update("add", {"w": np.ones(2, np.float32)}, key=("w", 0, 2))
    stager.stage([second])
    assert not stager.ready(second.key, step_seconds=0.1)  # 0.5 s left > a share of 0.1 s
    assert stager.ready(second.key, step_seconds=0.5 / WAIT_SHARE)  # within the share
    assert stager.ready(second.key)  # the learner's step time unknown: wait
    stager.slack = 0.5  # the learner waits 0.5 s a step for its device anyway
    assert stager.ready(second.key, step_seconds=0.1)  # waiting costs the device nothing
    stager.slack = 0.0
    now[0] += 0.48  # most of the expected placement has passed
    assert stager.ready(second.key, step_seconds=0.5)
    held.release()
    assert stager.ready(second.key, step_seconds=0.1)  # placed
    stager.take(second)

    # Two fragments' versions at one boundary: the worker places them in turn, so the
    # second is expected after both (taking it would wait for the first as well).
    stager.next_boundary()
    a, b = (Update("add", {"w": np.ones(2, np.float32)}, key=(p, 0, 3)) for p in ("u", "v"))
    stager.stage([a, b])
    budget_step = 0.6 / WAIT_SHARE  # a budget of 0.6 s: one placement, not two
    assert stager.ready(a.key, step_seconds=budget_step)
    assert not stager.ready(b.key, step_seconds=budget_step)


def test_a_learner_that_may_wait_waits_for_a_merge_being_placed():
    """max_wait > 0 (the synchronous baselines): the merge is applied at s + τ, waiting for
    its placement: the same models as merges computed at the boundary."""
    runs, held = {}, HeldExecutor()
    for stage in (False, True):
        sim = Sim(cfg(max_wait=-1.0, quorum=3), 20, down_delay=lambda m, msg: 0.5 + m,
                  stage=stage, stage_executor=held if stage else None)  # fmt: skip
        sim.run()
        runs[stage] = sim
    plain, staged = _final_state(runs[False]), _final_state(runs[True])
    for k in plain:
        np.testing.assert_array_equal(staged[k], plain[k], err_msg=k)
    assert any(f.forced for f in held.futures)  # the learners did wait for placements


def test_a_decoupled_runs_rows_carry_host_share_and_mfu(small_config, tmp_path, monkeypatch):
    """A real run with the pipeline on (prefetch, staged merges): merges were staged and
    applied from the devices, and each learner row reports host_share in [0, 1] and, where
    the device's peak is known (here pretended for CPU), mfu = tokens/s · FLOPs/token /
    (devices · peak)."""
    import json

    from decoupled_diloco import config as config_lib
    from decoupled_diloco import mfu
    from decoupled_diloco.models.flops import train_flops_per_token
    from decoupled_diloco.runtime import boundary
    from decoupled_diloco.runtime.local import LocalRuntime

    monkeypatch.setattr(mfu, "peak_flops", lambda kind: 1e9)
    hits = []
    take = boundary.MergeStager.take

    def counting(self, u):
        out = take(self, u)
        hits.append(out is not None)
        return out

    monkeypatch.setattr(boundary.MergeStager, "take", counting)
    from decoupled_diloco.runtime.learner_loop import LearnerLoop

    at_boundary = {}  # (learner, step) -> merges applied by the end of its boundary
    step_boundary = LearnerLoop._boundary

    def recording(self):
        step_boundary(self)
        at_boundary[self.m, self.step] = self.proto.applied_merges

    monkeypatch.setattr(LearnerLoop, "_boundary", recording)
    over = {"diloco.learners": 2, "diloco.sync_every": 4, "diloco.fragments": 2,
            "diloco.overlap": 1, "train.steps": 12, "train.log_every": 1,
            "train.metrics_lag": 1}  # fmt: skip
    cfg = small_config(**over)
    run = config_lib.validate(cfg)
    LocalRuntime(run, str(tmp_path), verbose=False).run()
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in rows if isinstance(r.get("learner"), int) and "loss" in r]
    assert rows and any(hits), "no merge was applied from staged device arrays"
    assert any(r.get("merges_applied", 0) > 0 for r in rows)  # and the rows count them
    # A row is written metrics_lag steps after its step: its counts are its step's still.
    assert [r["merges_applied"] for r in rows] == [
        at_boundary[r["learner"], r["step"]] for r in rows
    ]
    assert len(set(at_boundary.values())) > 2  # merges were applied along the way
    # diloco.device_rebase (the default): rebases and offers' v computed on the devices
    assert max(r["device_rebases"] for r in rows) > 0
    assert max(r["device_offers"] for r in rows) > 0
    assert all(r["merges_deferred"] >= 0 for r in rows)
    flops = train_flops_per_token(run.model, run.data.seq_len)
    devices = jax.device_count() // 2
    for r in rows:
        assert 0.0 <= r.get("host_share", 0.0) <= 1.0
        if r["tokens_per_second"] > 0:
            want = r["tokens_per_second"] * flops / (devices * 1e9)
            assert r["mfu"] == pytest.approx(want, rel=1e-6)
    assert sum("host_share" in r for r in rows) >= len(rows) - 2


def test_metrics_are_read_metrics_lag_steps_late_and_a_nan_still_restarts(
    small_config, tmp_path, monkeypatch
):
    """With train.metrics_lag = 3, a step's metrics are read once 3 later steps are
    dispatched (the device keeps a queue), and a NaN loss is still caught: the learner
    restarts from Θ (a `nan_restart` event, 3 steps after the bad one) and the run ends with
    a finite global model. A NaN in a learner's last steps (found only at the end) keeps
    its unmerged work out of Θ: it leaves without final offers (`nan_at_end`), and the
    syncer has nothing to refuse."""
    import json

    import jax.numpy as jnp

    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime import learner_loop
    from decoupled_diloco.runtime.local import LocalRuntime
    from decoupled_diloco.train.replica import Replica

    lag, bad_step = 3, 5
    dispatched, reads = {}, []  # replica -> steps dispatched; (learner, read step, dispatched)
    step = Replica.step

    def step_with_a_nan(self, batch):
        metrics = step(self, batch)
        dispatched[id(self)] = n = dispatched.get(id(self), 0) + 1
        first_device = self.mesh.devices.flat[0].id
        if (first_device, n) not in ((0, bad_step), (4, 14)):
            return metrics
        # learner 0's 5th step diverges, and so does learner 1's last
        return {**metrics, "loss": jnp.float32(jnp.nan)}

    report = learner_loop.LearnerLoop._report

    def recording_report(self, finished):
        if finished is not None:
            reads.append((self.m, finished[0], self.step))
        return report(self, finished)

    monkeypatch.setattr(Replica, "step", step_with_a_nan)
    monkeypatch.setattr(learner_loop.LearnerLoop, "_report", recording_report)
    over = {"diloco.learners": 2, "diloco.sync_every": 4, "diloco.fragments": 2,
            "train.steps": 14, "train.log_every": 1, "train.eval_every": 0,
            "train.checkpoint_every": 0, "train.metrics_lag": lag}  # fmt: skip
    run = config_lib.validate(small_config(**over))
    summary = LocalRuntime(run, str(tmp_path), verbose=False).run()
    with open(tmp_path / "events.jsonl", encoding="utf-8") as f:
        events = [json.loads(line) for line in f]
    restarts = [e for e in events if e.get("event") == "nan_restart"]
    assert [(e["learner"], e["step"]) for e in restarts] == [(0, bad_step + lag)]
    # The restarting life left (no round waits for it), then the next one joined.
    leaves = [e for e in events if e.get("event") == "leave" and e["learner"] == 0]
    rejoin = next(e for e in events if e.get("event") == "rejoin" and e["learner"] == 0)
    assert leaves and not leaves[0]["finished"] and leaves[0]["time"] <= rejoin["time"]
    (end,) = [e for e in events if e["event"] == "nan_at_end"]
    assert (end["learner"], end["step"]) == (1, 14)
    assert summary["rejected_offers"] == 0
    # Its steps that no merge brought into Θ are counted lost (they were counted nowhere):
    # per fragment, with those merged, each of its 14 steps once.
    with open(tmp_path / "merges.jsonl", encoding="utf-8") as f:
        merges = [json.loads(line) for line in f]
    for p in (0, 1):
        merged = sum(
            c
            for r in merges
            if r["fragment"] == p
            for m, c in zip(r["learners"], r["c_steps"], strict=True)
            if m == 1
        )
        lost = sum(b - a for a, b in end["lost_spans"].get(str(p), []))
        assert merged + lost == 14, (p, merged, lost)
    # How many are left out depends on which offers went out before the NaN was read (its
    # step's offers may have: metrics are read `lag` steps late), possibly none; the event
    # counts the most any fragment lacks.
    most = max((sum(b - a for a, b in s) for s in end["lost_spans"].values()), default=0)
    assert end["lost_steps"] == most
    crashes = sum(e.get("lost_steps", 0) for e in events if e["event"] == "rejoin")
    assert summary["crash_lost_steps"] == crashes + end["lost_steps"]
    assert max(now - read for _, read, now in reads) == lag  # read only 3 steps late
    assert {m for m, _, _ in reads} == {0, 1}
    assert np.isfinite(summary["final_eval_loss"])


@pytest.mark.slow
def test_a_learner_whose_last_step_diverges_counts_the_work_its_poisoned_offer_lost(
    small_config, tmp_path, monkeypatch
):
    """Learner 1's step 12 of 14 makes its parameters NaN; its offer of that step goes out
    before the lagged metrics show it and is refused as not finite. Leaving (`nan_at_end`),
    it counts every step no merge brought into Θ: the refused offer's were counted nowhere
    (8 of 14 steps accounted for)."""
    import json

    import jax
    import jax.numpy as jnp

    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime.local import LocalRuntime
    from decoupled_diloco.train.replica import Replica

    step, counts = Replica.step, {}

    def poisoned_last_step(self, batch):
        metrics = step(self, batch)
        counts[id(self)] = n = counts.get(id(self), 0) + 1
        if self.mesh.devices.flat[0].id == 4 and n >= 12:
            params = jax.tree.map(lambda x: x * jnp.nan, self.state.params)
            self.state = self.state._replace(params=params)
            return {**metrics, "loss": jnp.float32(jnp.nan)}
        return metrics

    monkeypatch.setattr(Replica, "step", poisoned_last_step)
    over = {"diloco.learners": 2, "diloco.sync_every": 4, "diloco.fragments": 1,
            "diloco.overlap": 1, "train.steps": 14, "train.log_every": 1,
            "train.eval_every": 0, "train.checkpoint_every": 0, "train.metrics_lag": 2}  # fmt: skip
    run = config_lib.validate(small_config(**over))
    summary = LocalRuntime(run, str(tmp_path), verbose=False).run()

    def read(name):
        with open(tmp_path / name, encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    events, merges = read("events.jsonl"), read("merges.jsonl")
    (end,) = [e for e in events if e["event"] == "nan_at_end"]
    assert end["learner"] == 1
    refused = [e for e in events if e["event"] == "reject" and e.get("learner") == 1]
    assert refused and summary["rejected_offers"] >= 1  # the poisoned offer of step 12
    merged = sum(c for r in merges for m, c in zip(r["learners"], r["c_steps"], strict=True)
                 if m == 1)  # fmt: skip
    assert merged + end["lost_steps"] == 14 and end["lost_spans"] == {"0": [[merged, 14]]}
    assert summary["crash_lost_steps"] == end["lost_steps"]
    assert np.isfinite(summary["final_eval_loss"])


@pytest.mark.slow
def test_evaluations_and_the_last_save_are_neither_step_time_nor_allocation(
    small_config, tmp_path, monkeypatch
):
    """A data-parallel learner evaluates every 4 steps and saves after its last: a step that
    evaluates reads its own metrics inside its time, but the evaluation is idle, not step
    time, and the last save belongs to the run's tail, so slow evaluations and a slow save
    leave the goodput whole (steps stretched 4x so that host bookkeeping is small)."""
    import time

    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime import accounting, learner_loop, local

    eval_s, save_s = 1.0, 1.5  # a leaked evaluation: a step >= 4 x eval_s
    seconds = []
    step = accounting.Ledger.step

    def recording(self, m, s, now):
        seconds.append(s)
        return step(self, m, s, now)

    save = learner_loop.LearnerLoop.save

    def slow_save(self):
        time.sleep(save_s)
        save(self)

    monkeypatch.setattr(accounting.Ledger, "step", recording)
    monkeypatch.setattr(learner_loop.LearnerLoop, "save", slow_save)
    over = {"diloco.learners": 1, "diloco.sync_every": 0, "train.eval_every": 4,
            "faults.speed_factors": [4.0]}  # fmt: skip
    run = config_lib.validate(small_config(**over))
    evaluate = local.Evaluator.__call__

    def slow_eval(self, params):
        time.sleep(eval_s)
        return evaluate(self, params)

    monkeypatch.setattr(local.Evaluator, "__call__", slow_eval)
    rt = local.LocalRuntime(run, str(tmp_path), verbose=False)
    summary = rt.run()
    assert len(seconds) == run.train.steps == 12
    # Steps 4, 8 and 12 evaluated: their time is the step's own (the first steps compile).
    assert max(seconds[3::4]) < eval_s
    assert summary["goodput"] >= 0.9


@pytest.mark.slow
def test_the_last_steps_device_time_is_step_time(small_config, tmp_path, monkeypatch):
    """A learner with a syncer (saved by its final sync, not by its last step) still reads
    its last step's metrics inside that step: the device finishing the steps still queued
    is training, so a slow drain at the end stretches the last step, not the allocation
    (it left a step's time out of every step on the GPU: goodput 0.995 at 200 CPU steps)."""
    import time

    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime import accounting, learner_loop, local

    drain_s = 1.5
    seconds = []
    step, report = accounting.Ledger.step, learner_loop.LearnerLoop._report

    def recording(self, m, s, now):
        seconds.append(s)
        return step(self, m, s, now)

    def slow_drain(self, finished):
        if finished is not None and finished[0] == self.run_cfg.train.steps:
            time.sleep(drain_s)  # the device still computing the queued steps
        return report(self, finished)

    monkeypatch.setattr(accounting.Ledger, "step", recording)
    monkeypatch.setattr(learner_loop.LearnerLoop, "_report", slow_drain)
    over = {"diloco.learners": 1, "diloco.sync_every": 4, "faults.speed_factors": [4.0]}
    run = config_lib.validate(small_config(**over))
    assert run.train.metrics_lag >= 1 and run.uses_syncer
    summary = local.LocalRuntime(run, str(tmp_path), verbose=False).run()
    assert len(seconds) == run.train.steps == 12
    assert seconds[-1] >= drain_s
    assert summary["goodput"] >= 0.9


@pytest.mark.slow
def test_an_emulated_slow_chip_is_slow_despite_the_pipeline(small_config, tmp_path, monkeypatch):
    """faults.speed_factors stretches a learner's steps by sleeping: with metrics read a
    step late the device still computes the queued step while the host sleeps, so the
    sleep must come after it or a 4x slower chip runs only about 2x slower (every
    heterogeneous-speed experiment and fault test rests on this). One learner alone, at
    speed 1 and at speed 4: the wall seconds per step. (Batches of 32: the device's share
    of a step must dwarf the host's unstretched bookkeeping, or a fast host's ratio falls
    toward the bug's.)"""
    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime import accounting, local

    times = []  # when the learner's steps ended
    step = accounting.Ledger.step

    def recording(self, m, s, now):
        times.append(now)
        return step(self, m, s, now)

    monkeypatch.setattr(accounting.Ledger, "step", recording)
    per_step = {}
    for factor in (1.0, 4.0):
        times.clear()
        over = {"diloco.learners": 1, "diloco.sync_every": 0, "train.steps": 24,
                "train.batch_size": 32, "faults.speed_factors": [factor]}  # fmt: skip
        run = config_lib.validate(small_config(**over))
        local.LocalRuntime(run, str(tmp_path / str(factor)), verbose=False).run()
        per_step[factor] = (times[-1] - times[3]) / (len(times) - 4)  # (compilation)
    ratio = per_step[4.0] / per_step[1.0]
    assert ratio >= 3.0, per_step  # 3.8-4.6 measured (batches of 32); 2.3-2.4 sleeping too early


@pytest.mark.slow  # a whole run with sleeps: ~7 s on 2 cores
def test_host_cpu_share_counts_the_threads_cpu_not_its_waits(small_config, tmp_path, monkeypatch):
    """A learner row's host_cpu_share is the share of the step the learner thread ran on a
    CPU: host work that sleeps (an interpreter lock held elsewhere, a slow read) counts in
    host_share only, host work that computes in both."""
    import itertools
    import json
    import time

    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime import local
    from decoupled_diloco.runtime.local import LocalRuntime

    pause = 0.05  # seconds slept and then spun per batch, on the learner thread (no prefetch)

    class Slow:
        def __init__(self, inner):
            self.inner = inner

        def __next__(self):
            time.sleep(pause)
            end = time.thread_time() + pause
            while time.thread_time() < end:
                pass
            return next(self.inner)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    make = local.make_iterator
    monkeypatch.setattr(local, "make_iterator", lambda *a, **k: Slow(make(*a, **k)))
    run = config_lib.validate(small_config(**{"train.prefetch": 0, "train.steps": 10}))
    LocalRuntime(run, str(tmp_path), verbose=False).run()
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in rows if r.get("learner") == 0 and "host_cpu_share" in r][2:]
    assert len(rows) >= 5
    host = float(np.median([r["host_share"] for r in rows]))
    cpu = float(np.median([r["host_cpu_share"] for r in rows]))
    # Each step: >= `pause` asleep and `pause` of CPU, beside a tiny train step whose own
    # time depends on the host (5-20 ms): the expected shares follow the measured step.
    pace = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in itertools.pairwise(rows)]
    step_s = float(np.median(pace))
    each = min(pause / step_s, 0.5)  # the share of a step asleep, and the share spinning
    assert host > 0.8 * 2 * each, (host, each)
    assert 0.7 * each < cpu < host - 0.7 * each, (cpu, host, each)
    data = float(np.median([r["data_share"] for r in rows]))  # all of it getting batches
    assert 0.8 * 2 * each < data <= host, (data, host, each)


def test_a_launch_held_by_the_devices_full_queue_is_a_wait_for_the_device(
    small_config, tmp_path, monkeypatch
):
    """XLA:CPU holds at most 32 programs per device in flight, and a launch beyond that
    blocks until one finishes: a device-bound learner then waits in the train step's call,
    not in a metrics read. That wait is the device's, so host_share stays low (it read
    ~1.0 on Ray, and 0.55-0.98 for one local learner on this CPU, counting it as host work)."""
    import json
    import time

    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime.local import LocalRuntime
    from decoupled_diloco.train import fragment_ops

    pause = 0.03  # seconds each launch of the train step is held, off the CPU

    def held(*args, **kwargs):
        fn = jax.jit(*args, **kwargs)
        return fragment_ops.Launch(lambda *a, **k: (time.sleep(pause), fn(*a, **k))[1])

    monkeypatch.setattr(fragment_ops, "launch", held)  # the replica's train step, row ops
    run = config_lib.validate(small_config(**{"train.prefetch": 0, "train.steps": 10}))
    before = fragment_ops.dispatch_waited()
    LocalRuntime(run, str(tmp_path), verbose=False).run()
    assert fragment_ops.dispatch_waited() == before  # counted on the learner's thread
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in rows if r.get("learner") == 0 and "host_share" in r][2:]
    assert len(rows) >= 5
    host = float(np.median([r["host_share"] for r in rows]))
    assert host < 0.5, host  # >= 30 ms of each step held in the launch


def test_dispatch_waited_counts_a_threads_time_off_the_cpu_in_launches():
    import threading
    import time

    from decoupled_diloco.train import fragment_ops

    asleep = fragment_ops.Launch(lambda: time.sleep(0.05))
    spin_until = [0.0]

    def spin():
        spin_until[0] = time.thread_time() + 0.05
        while time.thread_time() < spin_until[0]:
            pass

    busy = fragment_ops.Launch(spin)
    seen = {}

    def on_a_thread():
        t0 = fragment_ops.dispatch_waited()
        asleep()
        seen["asleep"] = fragment_ops.dispatch_waited() - t0
        t0 = fragment_ops.dispatch_waited()
        busy()
        seen["busy"] = fragment_ops.dispatch_waited() - t0

    main = fragment_ops.dispatch_waited()
    thread = threading.Thread(target=on_a_thread)
    thread.start()
    thread.join()
    assert 0.045 <= seen["asleep"] < 0.5
    assert seen["busy"] < 0.03  # on the CPU all along (2 busy cores may preempt it a little)
    assert fragment_ops.dispatch_waited() == main  # another thread's waits are its own


@pytest.mark.parametrize(
    "every,duty,first_s",
    [pytest.param(1, 0.25, 0.02, marks=pytest.mark.slow), (1, 0.25, 0.4), (3, 1.0, 0.02)],
)
def test_learner_checkpoints_take_at_most_their_duty_of_the_time(
    small_config, tmp_path, monkeypatch, every, duty, first_s
):
    """Periodic learner saves that take 20 ms (the first `first_s`), each step 10 ms or more:
    with train.checkpoint_duty 0.25 a save is followed by at least 0.02 · (1/0.25 − 1) =
    60 ms of steps before the next (the due ones in between wait), so saves take at most
    about a quarter of the time, and a slow first save (the checkpointer's set-up) does not
    space out the rest; with duty 1 every due one is taken at its step."""
    import time

    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime import local
    from decoupled_diloco.runtime.learner_loop import LearnerLoop
    from decoupled_diloco.runtime.local import LocalRuntime

    saves, steps = [], 60

    def slow_save(self):  # (writes nothing: the test is about when saves happen)
        saves.append((self.step, time.perf_counter()))
        time.sleep(first_s if len(saves) == 1 else 0.02)

    class Slow:  # 10 ms more per step: batches read on the learner's thread (no prefetch)
        def __init__(self, inner):
            self.inner = inner

        def __next__(self):
            time.sleep(0.01)
            return next(self.inner)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    make = local.make_iterator
    monkeypatch.setattr(local, "make_iterator", lambda *a, **k: Slow(make(*a, **k)))
    monkeypatch.setattr(LearnerLoop, "save", slow_save)
    over = {"train.steps": steps, "train.checkpoint_every": every,
            "train.checkpoint_duty": duty, "train.prefetch": 0}  # fmt: skip
    LocalRuntime(config_lib.validate(small_config(**over)), str(tmp_path), verbose=False).run()
    periodic = [(s, t) for s, t in saves if s < steps]  # the last step is the final save
    if duty < 1:
        # From the third save on, the shorter of the last two (20 ms) sets the gap: 20 ms of
        # saving and 60 ms of steps between starts, counted in steps at the mean step time
        # since the last save (steps after it may run faster: one gap of 69.95 ms was seen,
        # and 59.8 ms on a loaded machine), and over the run saves take about a quarter of
        # the time. The bound 50 ms keeps a margin under the 80 ms asked for and stays well
        # above the 30 ms of a save at every step (every = 1 without the duty).
        gaps = np.diff([t for _, t in periodic])[1:]
        assert len(periodic) >= 4 and gaps.min() >= 0.05, gaps
        assert 0.02 / gaps.mean() <= duty * 1.1, gaps
        # Most due saves were folded into later ones, where steps are shorter than the gap
        # (a host whose steps take 60 ms or more owes a save at every one).
        (s0, t0), (s1, t1) = periodic[0], periodic[-1]
        per_step = (t1 - t0 - 0.02 * (len(periodic) - 1)) / (s1 - s0)
        if per_step < 0.03:
            assert len(periodic) < steps // 2, (len(periodic), per_step)
        assert [s for s, _ in periodic] == sorted({s for s, _ in periodic})
    else:
        assert [s for s, _ in periodic] == list(range(every, steps, every))


def test_a_step_with_a_finite_loss_and_a_non_finite_gradient_has_diverged():
    """A backward pass that overflows under a finite forward (or an MoE router's auxiliary
    loss that does) makes the update, and so the parameters, NaN: the learner's check read
    the cross-entropy alone and trained on a step later."""
    import numpy as np

    from decoupled_diloco.runtime.learner_loop import metrics_diverged as diverged

    fine = {"loss": np.float32(2.5), "total_loss": np.float32(2.6), "grad_norm": np.float32(1.0)}
    assert not diverged(fine)
    for key in ("loss", "total_loss", "grad_norm"):
        for bad in (np.nan, np.inf):
            assert diverged({**fine, key: np.float32(bad)}), key
    assert not diverged({"loss": np.float32(1.0)})  # (rows without the other keys)


def _learner_rows(workdir, m=0):
    import json

    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if r.get("learner") == m and "loss" in r]


@pytest.mark.slow  # two whole runs with a 1.5 s evaluation and a 3 s outage: ~17 s on 2 cores
def test_a_rows_tokens_per_second_is_over_its_training_time_only(
    small_config, tmp_path, monkeypatch
):
    """A row's rate (and mfu) is the steps since the row before over their time. A data-
    parallel learner's evaluation (here 1.5 s) fell into the next row's window (5,696 tok/s
    between rows of 12,494 and 11,373); a restarted DiLoCo learner's first row held its
    3 s outage (748 against ~13k); a DiLoCo learner's first row read 0.0 with log_every 1."""
    import statistics
    import time

    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime.local import LocalRuntime
    from decoupled_diloco.train.evaluate import Evaluator

    call = Evaluator.__call__

    def slow_evaluation(self, params):
        time.sleep(1.5)
        return call(self, params)

    monkeypatch.setattr(Evaluator, "__call__", slow_evaluation)
    dp = {"train.steps": 30, "train.log_every": 5, "train.eval_every": 15,
          "train.checkpoint_every": 0}  # fmt: skip
    LocalRuntime(config_lib.validate(small_config(**dp)), str(tmp_path / "dp"), verbose=False).run()
    rows = _learner_rows(tmp_path / "dp")
    rates = {r["step"]: r["tokens_per_second"] for r in rows}
    steady = statistics.median(rates[s] for s in (10, 15, 25, 30))
    assert rates[20] > 0.3 * steady, rates  # the row after the step-15 evaluation

    crash = {"diloco.learners": 2, "diloco.sync_every": 4, "diloco.fragments": 2,
             "train.steps": 24, "train.log_every": 1, "train.eval_every": 0,
             "train.checkpoint_every": 0, "faults.unit": "steps", "faults.crashes": [[0, 12]],
             "faults.restart_delay_s": 3.0}  # fmt: skip
    run = config_lib.validate(small_config(**crash))
    LocalRuntime(run, str(tmp_path / "dec"), verbose=False).run()
    rows = _learner_rows(tmp_path / "dec")
    assert rows[0]["step"] == 1 and rows[0]["tokens_per_second"] > 0
    rates = [r["tokens_per_second"] for r in rows if r["step"] > 4]
    steady = statistics.median(rates)
    # Before the fix the row after the outage read 3 s for one step: far below 0.1 x.
    assert min(rates) > 0.1 * steady, rates
