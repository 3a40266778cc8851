"""Streamed syncer checkpoints (fragment_checkpoint.py, runtime/syncer_loop.py `save`):
written off the serving thread one fragment at a time, so merges go on during a save and
the extra memory is one fragment's Θ + momentum; each fragment is restored bit-exactly at
the version its copy was taken, with its own vector clock; a save the syncer's death
interrupts is never committed; a corrupted fragment makes the restore fall back."""

import dataclasses
import gc
import os
import threading
import time
import tracemalloc
import types

import numpy as np
import pytest
from damage import flip_values

from decoupled_diloco.checkpoint import CorruptCheckpointError
from decoupled_diloco.diloco import compression
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragments import make_fragment_plan
from decoupled_diloco.diloco.messages import Join, Leave, Offer, Snapshot
from decoupled_diloco.diloco.transport import SyncerLink
from decoupled_diloco.fragment_checkpoint import FragmentCheckpointer
from decoupled_diloco.runtime.syncer_loop import SyncerLoop

H, P, TOKENS = 4, 4, 64  # sync_every, fragments, tokens per learner step
SHAPES = {f"block_{i}/w": (2048, 1024) for i in range(P)}  # one 8 MiB leaf per fragment
PLAN = make_fragment_plan(SHAPES, P, "balanced", sync_every=H)
CFG = DilocoConfig(learners=1, sync_every=H, fragments=P, quorum=1, grace_gamma=0.0)
RUN = types.SimpleNamespace(
    diloco=CFG,
    train=types.SimpleNamespace(batch_size=8, steps=10_000),
    data=types.SimpleNamespace(seq_len=TOKENS // 8),
)


class ListLink(SyncerLink):
    """Messages the test puts in `inbox`; replies are kept in `sent` (and with their
    learner in `sent_to`)."""

    def __init__(self):
        self.inbox, self.sent, self.sent_to = [], [], []

    def receive(self, timeout: float) -> list:
        msgs, self.inbox = self.inbox, []
        return msgs

    def send(self, learner, msg) -> None:
        self.sent.append(msg)
        self.sent_to.append((learner, msg))


class Run:
    """A syncer loop under a fake clock with one joined learner that offers on schedule."""

    def __init__(self, directory, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        self.now, self.records, self.link = 0.0, [], ListLink()
        self.loop = SyncerLoop(0, RUN, PLAN, self.params, self.link,
                               FragmentCheckpointer(str(directory)), schedule=None,
                               clock=lambda: self.now, record=self.records.append,
                               emulate_outages=False)  # fmt: skip
        self.rounds = dict.fromkeys(range(P), 0)
        self.serve(Join(0, 0, self.now, 0, TOKENS))

    def serve(self, *msgs) -> None:
        """One turn of the serving thread with `msgs` in the inbox."""
        self.now += 0.01
        self.link.inbox += msgs
        self.loop.serve_turn(max_block=0.0)

    def offer(self, p: int, seed: int) -> Offer:
        self.rounds[p] += 1
        rng = np.random.default_rng(seed)
        v = {k: (0.01 * rng.standard_normal(SHAPES[k])).astype(np.float32) for k in PLAN.names[p]}
        s, step = self.loop.syncer, PLAN.offsets[p] + H * self.rounds[p]
        return Offer(learner=0, incarnation=0, fragment=p, step=step, c_steps=H,
                     c_tokens=H * TOKENS, base_version=s.version[p], time=self.now,
                     payload=compression.encode(v, "none"), nbytes=1, epoch=s.epoch)  # fmt: skip

    def merge(self, p: int, seed: int) -> None:
        version = self.loop.syncer.version[p]
        self.serve(self.offer(p, seed))
        rejected = [r for r in self.records if r["event"] in ("reject", "drop_offer")]
        assert self.loop.syncer.version[p] == version + 1, rejected

    def fragment(self, p: int) -> tuple:
        """(Θ_p, momentum_p, version, clock) copied from the live syncer."""
        s = self.loop.syncer
        with self.loop.lock:
            return ({k: v.copy() for k, v in s.theta[p].items()},
                    {k: v.copy() for k, v in s.outer[p].momentum.items()},
                    s.version[p], s.clock(p))  # fmt: skip


def _restored(directory):
    """A new life of the syncer built from the checkpoint in `directory`."""
    loop = SyncerLoop(0, RUN, PLAN, {k: np.zeros(s, np.float32) for k, s in SHAPES.items()},
                      ListLink(), FragmentCheckpointer(str(directory)), schedule=None,
                      clock=lambda: 100.0, record=lambda r: None, emulate_outages=False,
                      restarted=True)  # fmt: skip
    return loop.syncer


def _assert_fragment(syncer, p: int, expected: tuple) -> None:
    theta, momentum, version, clock = expected
    assert syncer.version[p] == version and syncer.clock(p) == clock
    for k in theta:  # bit for bit
        np.testing.assert_array_equal(syncer.theta[p][k], theta[k], strict=True)
        np.testing.assert_array_equal(syncer.outer[p].momentum[k], momentum[k], strict=True)


def test_a_restored_syncer_announces_itself_to_learners_that_left(tmp_path):
    # A learner in its final sync has left, and may wait for an offer the lost life never
    # merged: only the new life's snapshot makes it offer that work again.
    run = Run(tmp_path)
    run.merge(0, seed=0)
    run.serve(Leave(0, 0, run.now, True))
    assert not run.loop.syncer.learners[0].joined
    assert run.loop.save()
    link = ListLink()
    loop = SyncerLoop(0, RUN, PLAN, {k: np.zeros(s, np.float32) for k, s in SHAPES.items()},
                      link, FragmentCheckpointer(str(tmp_path)), schedule=None,
                      clock=lambda: 100.0, record=lambda r: None, emulate_outages=False,
                      restarted=True)  # fmt: skip
    loop._announce()
    (to, snap), *_ = link.sent_to
    assert to == 0 and isinstance(snap, Snapshot) and snap.epoch == loop.syncer.epoch
    # Its bytes count as traffic (a join's reply's too): they did not, so a run with
    # many (re)joins reported only its merges' bytes.
    full = sum(int(np.prod(s)) * 4 for s in SHAPES.values())
    assert loop.bytes_communicated() == full
    loop.syncer.handle(Join(0, 1, 100.0, 0, TOKENS), 100.0)
    assert loop.bytes_communicated() == 2 * full


def test_a_finished_flag_that_comes_after_the_leave_is_saved(tmp_path):
    """The runtime's Leave (finished=False) may overtake the learner's own (finished=True),
    which then marks the life finished (it stays in the merge weights' roster). A save was
    skipped while versions and (learner, incarnation, joined) were unchanged, so a restore
    before the next merge lost the flag."""
    run = Run(tmp_path)
    run.merge(0, seed=0)
    run.serve(Leave(0, 0, run.now, False))
    assert run.loop.save()
    run.serve(Leave(0, 0, run.now, True))
    assert run.loop.syncer.learners[0].finished and run.loop.save()
    assert _restored(tmp_path).learners[0].finished


def test_peak_extra_memory_of_a_save_is_one_fragment(tmp_path):
    run = Run(tmp_path)
    for p in range(P):
        run.merge(p, seed=p)
    fragment = sum(2 * np.prod(SHAPES[k]) * 4 for k in PLAN.names[0])  # Θ + momentum bytes
    state = P * fragment
    slack = 2 << 20  # checksums read 64k elements at a time (~1.5 MiB), JSON, bookkeeping
    assert fragment >= 8 * slack and state >= 4 * fragment  # the bound means something
    # Only the save's own allocations: garbage of earlier tests (whose finalizers allocate)
    # is collected first, and no collection runs inside the measured save.
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        assert run.loop.save()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        gc.enable()
    assert peak <= fragment + slack, f"save used {peak / 2**20:.1f} MiB, one fragment is " \
        f"{fragment / 2**20:.1f} MiB, the state {state / 2**20:.1f} MiB"  # fmt: skip
    for p in range(P):
        _assert_fragment(_restored(tmp_path), p, run.fragment(p))


def test_merges_go_on_while_a_save_writes(tmp_path):
    """The saver is held inside its first fragment's write: the serving thread keeps merging
    every fragment; each fragment is restored as it was when its copy was taken."""
    run = Run(tmp_path)
    for p in range(P):
        run.merge(p, seed=10 + p)
    writing, release = threading.Event(), threading.Event()
    write = run.loop.ckpt.write_fragment
    copied = {}  # fragment -> the live state when the saver copied it

    def held_write(n, p, arrays, info):
        copied[p] = run.fragment(p)
        if not writing.is_set():
            writing.set()
            assert release.wait(30)
        return write(n, p, arrays, info)

    run.loop.ckpt.write_fragment = held_write
    assert run.loop.save_in_background()
    assert writing.wait(30)
    first = next(iter(copied))
    t0 = time.monotonic()
    for p in range(P):  # while the save is stuck in a write
        run.merge(p, seed=20 + p)
    assert time.monotonic() - t0 < 5.0 and run.loop._saver.is_alive()
    assert not run.loop.save_in_background()  # one save at a time
    release.set()
    run.loop.wait_for_save()
    assert copied[first][2] + 1 == run.loop.syncer.version[first]  # copied before the merge
    later = [p for p in copied if p != first]
    assert all(copied[p][2] == run.loop.syncer.version[p] for p in later)  # after it
    restored = _restored(tmp_path)
    for p in range(P):
        _assert_fragment(restored, p, copied[p])


def test_a_save_the_syncer_death_interrupts_is_never_committed(tmp_path):
    run = Run(tmp_path)
    run.merge(0, seed=1)
    assert run.loop.save()
    saved = [run.fragment(p) for p in range(P)]
    run.merge(1, seed=2)
    write = run.loop.ckpt.write_fragment

    def dying_write(n, p, arrays, info):
        run.loop._set(None)  # the syncer process dies while fragment p is being written
        return write(n, p, arrays, info)

    run.loop.ckpt.write_fragment = dying_write
    assert not run.loop.save()
    assert run.loop.ckpt.all_steps() == [1]
    restored = _restored(tmp_path)
    for p in range(P):
        _assert_fragment(restored, p, saved[p])
    assert FragmentCheckpointer(str(tmp_path)).begin() == 2  # and its leftovers are gone
    assert sorted(os.listdir(tmp_path)) == ["1"]


def test_a_restored_syncer_merges_exactly_like_the_one_that_saved(tmp_path):
    run = Run(tmp_path)
    for p in range(P):
        run.merge(p, seed=30 + p)
    run.merge(2, seed=40)
    assert run.loop.save()
    again = Run(tmp_path / "unused")
    again.loop = types.SimpleNamespace(syncer=_restored(tmp_path), lock=threading.Lock())
    again.loop.syncer.handle(Join(0, 1, again.now, 0, TOKENS), again.now)
    run.rounds, again.rounds = dict(run.rounds), dict(run.rounds)
    for p in (2, 0):
        a, b = run.offer(p, seed=50 + p), again.offer(p, seed=50 + p)
        b.incarnation = 1
        run.serve(a)
        again.loop.syncer.handle(b, 200.0)
        ta, ma, va, _ = run.fragment(p)
        tb, mb, vb, _ = again.fragment(p)
        assert va == vb
        for k in ta:
            np.testing.assert_array_equal(ta[k], tb[k], strict=True)
            np.testing.assert_array_equal(ma[k], mb[k], strict=True)


def test_a_corrupted_fragment_falls_back_to_the_previous_save(tmp_path):
    run = Run(tmp_path)
    run.merge(0, seed=1)
    assert run.loop.save()
    first = [run.fragment(p) for p in range(P)]
    run.merge(3, seed=2)
    assert run.loop.save()
    flip_values(tmp_path / "2")
    ckpt = FragmentCheckpointer(str(tmp_path))
    parts, _ = ckpt.restore()
    assert [s for s, _, _ in ckpt.refused] == [2] and ckpt.all_steps() == [1]
    assert os.path.isdir(ckpt.refused[0][2])
    for p in range(P):
        np.testing.assert_array_equal(parts[p][0]["theta"][PLAN.names[p][0]],
                                      first[p][0][PLAN.names[p][0]])  # fmt: skip


def test_a_read_only_load_of_theta_skips_the_momenta(tmp_path):
    run = Run(tmp_path)
    run.merge(1, seed=3)
    assert run.loop.save()
    parts, meta = FragmentCheckpointer(str(tmp_path), read_only=True).read(1, momentum=False)
    assert all(set(arrays) == {"theta"} for arrays, _ in parts.values())
    assert parts[1][1]["version"] == 1 and meta["plan"] == PLAN.to_json()


def test_when_no_save_verifies_every_one_stays_and_a_retry_fails_alike(tmp_path):
    # Moving them aside would leave no checkpoint at all: the next attempt would start the
    # global model afresh from Θ_0 while the learners resume theirs.
    d = tmp_path / "syncer_0"
    run = Run(d)
    for seed, p in ((1, 0), (2, 3)):
        run.merge(p, seed=seed)
        assert run.loop.save()
    for n in (1, 2):
        manifest = d / str(n) / "manifest.json"
        manifest.write_text(manifest.read_text()[:-20])
    for _ in range(2):
        ckpt = FragmentCheckpointer(str(d))
        with pytest.raises(CorruptCheckpointError, match=r"no kept checkpoint step.*/2: .*/1: "):
            ckpt.restore()
        assert ckpt.all_steps() == [1, 2] and not ckpt.refused
        assert not (tmp_path / "corrupt").exists()


@pytest.mark.parametrize("text", ["[1]", '"x"', "null", '{"_integrity": 5}'])
def test_a_manifest_that_parses_but_is_no_object_is_refused_and_the_older_step_restored(
    tmp_path, text
):
    run = Run(tmp_path)
    run.merge(0, seed=1)
    assert run.loop.save()
    run.merge(3, seed=2)
    assert run.loop.save()
    (tmp_path / "2" / "manifest.json").write_text(text)
    ckpt = FragmentCheckpointer(str(tmp_path))
    ckpt.restore()
    assert [(step, moved is not None) for step, _, moved in ckpt.refused] == [(2, True)]
    assert "manifest" in ckpt.refused[0][1]


@pytest.mark.parametrize("bad", ["manifest", "missing"])
def test_an_unreadable_manifest_is_refused(tmp_path, bad):
    run = Run(tmp_path)
    run.merge(0, seed=1)
    assert run.loop.save()
    manifest = tmp_path / "1" / "manifest.json"
    if bad == "manifest":
        manifest.write_text(manifest.read_text().replace('"version": 1', '"version": 7'))
        with pytest.raises(Exception, match="no kept checkpoint step can be trusted"):
            FragmentCheckpointer(str(tmp_path)).restore()
    else:
        manifest.unlink()  # an uncommitted step is no step at all
        assert FragmentCheckpointer(str(tmp_path)).latest_step() is None


@pytest.mark.parametrize("duty", [0.25, 1.0])
def test_checkpoints_take_at_most_their_duty_of_the_time(tmp_path, monkeypatch, duty):
    """Saves that take 0.1 s, due every 0.01 s: with duty 0.25 each starts at least
    0.1 / 0.25 = 0.4 s after the previous one; with duty 1 they run back to back."""
    starts = []

    def slow_save(self):
        starts.append(time.monotonic())
        time.sleep(0.1)
        self._saved_key = ((0, len(starts)),), ()  # a save holding merges
        return True

    monkeypatch.setattr(SyncerLoop, "save", slow_save)
    _serve_with_saves_due_every_10ms(tmp_path, duty, done=lambda: False, seconds=1.5)
    gaps = np.diff(starts[:-1])  # the last one is the final save at stop
    if duty < 1:
        assert len(gaps) >= 2 and gaps[1:].min() >= 0.4 - 0.02, gaps  # after the first save
    else:
        assert len(gaps) >= 8 and gaps[1:].max() < 0.2, gaps


def _serve_with_saves_due_every_10ms(tmp_path, duty, done, seconds, started=None):
    """Serves a syncer loop with saves due every 0.01 s and `duty` until `done()` or for
    `seconds`; `started(loop)` once it exists."""
    cfg = dataclasses.replace(CFG, syncer_checkpoint_seconds=0.01, syncer_checkpoint_duty=duty)
    run = types.SimpleNamespace(diloco=cfg, train=RUN.train, data=RUN.data)
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    loop = SyncerLoop(0, run, PLAN, params, ListLink(), FragmentCheckpointer(str(tmp_path)),
                      schedule=None, clock=time.monotonic, record=lambda r: None,
                      emulate_outages=False)  # fmt: skip
    if started is not None:
        started(loop)
    stop = threading.Event()
    server = threading.Thread(target=loop.run, args=(stop,))
    server.start()
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    server.join()


def test_the_gap_after_a_save_counts_that_save(tmp_path, monkeypatch):
    """The duty's gap is computed once the save before it has ended: a gap computed while it
    was still being written (its time unknown) let the next save start at once."""
    from decoupled_diloco.runtime import syncer_loop

    starts, release, loops = [], threading.Event(), []

    def slow_save(self):
        starts.append(time.monotonic())
        time.sleep(0.1)
        if len(starts) == 2:
            release.wait(0.5)  # ends once the serving thread computed a gap meanwhile
        self._saved_key = ((0, len(starts)),), ()
        return True

    real_gap = syncer_loop.checkpoint_gap

    def gap(interval, save_seconds, duty):
        if len(starts) == 2 and not release.is_set():  # the second save is being written
            release.set()
            loops[0]._saver.join()  # it ends before the gap computed here is used
        return real_gap(interval, save_seconds, duty)

    monkeypatch.setattr(SyncerLoop, "save", slow_save)
    monkeypatch.setattr(syncer_loop, "checkpoint_gap", gap)
    _serve_with_saves_due_every_10ms(tmp_path, 0.25, done=lambda: len(starts) >= 3, seconds=10,
                                     started=loops.append)  # fmt: skip
    # The second save took 0.1-0.6 s, the first 0.1 s: 0.1 / 0.25 = 0.4 s at least.
    assert len(starts) >= 3 and starts[2] - starts[1] >= 0.4 - 0.02, np.diff(starts)


def test_what_a_save_costs_ignores_merge_less_saves_and_one_slow_save(tmp_path, monkeypatch):
    """The duty spaces saves by the shorter of the last two that held merges: the first
    saves (they meet the learners' compilation) and one slow save do not stretch the gap;
    saves that stay slow do."""
    from decoupled_diloco.runtime import syncer_loop

    now = [0.0]
    monkeypatch.setattr(syncer_loop.time, "monotonic", lambda: now[0])
    loop = Run(tmp_path).loop
    for version, seconds, cost in [(0, 3.0, 0.0), (1, 9.0, 0.0), (2, 0.5, 0.5), (3, 4.0, 0.5),
                                   (4, 4.0, 4.0), (5, 0.5, 0.5)]:  # fmt: skip

        def fake_save(self, version=version, seconds=seconds):
            now[0] += seconds
            self._saved_key = ((0, version), (1, 0)), ()
            return True

        monkeypatch.setattr(SyncerLoop, "save", fake_save)
        loop._save_or_keep_error()
        assert loop.save_seconds == cost, version


def _restarted_loop(directory, params=None, record=lambda r: None):
    """A new life of the syncer loop built from the checkpoint in `directory`."""
    params = params or {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    return SyncerLoop(0, RUN, PLAN, params, ListLink(), FragmentCheckpointer(str(directory)),
                      schedule=None, clock=lambda: 100.0, record=record,
                      emulate_outages=False, restarted=True)  # fmt: skip


def test_a_finished_leave_during_a_save_is_in_that_checkpoint(tmp_path):
    """The registry was taken when the save began: a learner that left finished while the
    fragments were written was restored 'joined, unfinished' (it never says so again), timed
    out as dead and dropped out of the merge roster, rescaling every later merge."""
    run = Run(tmp_path)
    run.merge(0, seed=1)
    writing, release = threading.Event(), threading.Event()
    write = run.loop.ckpt.write_fragment

    def held_write(n, p, arrays, info):
        if not writing.is_set():
            writing.set()
            assert release.wait(30)
        return write(n, p, arrays, info)

    run.loop.ckpt.write_fragment = held_write
    assert run.loop.save_in_background() and writing.wait(30)
    run.serve(Leave(0, 0, run.now, True))
    release.set()
    run.loop.wait_for_save()
    restored = _restored(tmp_path).learners[0]
    assert restored.finished and not restored.joined
    assert not run.loop.save()  # what was saved is what the syncer holds


def test_a_refused_step_that_cannot_be_moved_never_displaces_a_good_one(tmp_path, monkeypatch):
    """A refused step left in place (its move failed: a read-only parent, an object-store
    error) was reported as moved and still counted for max_to_keep: the next commit
    deleted the last step that verifies, keeping the bad one."""
    from decoupled_diloco import checkpoint

    run = Run(tmp_path)
    run.merge(0, seed=1)
    assert run.loop.save()
    run.merge(3, seed=2)
    assert run.loop.save()
    (tmp_path / "2" / "manifest.json").write_text("[1]")

    def cannot_move(src, dst):
        raise OSError("read-only file system")

    monkeypatch.setattr(checkpoint.paths, "move_tree", cannot_move)
    records = []
    loop = _restarted_loop(tmp_path, record=records.append)
    refused = [r for r in records if r["event"] == "checkpoint_refused"]
    assert [(r["checkpoint_step"], r["moved_to"]) for r in refused] == [(2, None)]
    loop.syncer.handle(Join(0, 1, 100.0, 0, TOKENS), 100.0)
    for n in range(2):  # two more saves: max_to_keep (2) good steps stay, 1 is dropped last
        p, step = 1 + n, PLAN.offsets[1 + n] + H
        loop.syncer.handle(Offer(learner=0, incarnation=1, fragment=p, step=step, c_steps=H,
                                 c_tokens=H * TOKENS, base_version=loop.syncer.version[p],
                                 time=100.0, epoch=loop.syncer.epoch, nbytes=1,
                                 payload=compression.encode(
                                     {k: np.full(SHAPES[k], 0.01, np.float32)
                                      for k in PLAN.names[p]}, "none")), 100.0)  # fmt: skip
        assert loop.save()
        assert loop.ckpt.all_steps() == ([1, 2, 3] if n == 0 else [2, 3, 4])


def test_a_checkpoint_of_another_model_or_layout_is_refused_at_restore(tmp_path):
    """The fragment plan names leaves only: a model of another width matched it, and the
    restored syncer refused every offer of the real model; a missing fragment was a bare
    KeyError."""
    from decoupled_diloco.diloco import syncer_state

    run = Run(tmp_path)
    run.merge(0, seed=1)
    assert run.loop.save()
    wider = {k: np.zeros((s[0], 2 * s[1]), np.float32) for k, s in SHAPES.items()}
    with pytest.raises(ValueError, match=r"theta of fragment 0 does not fit the model: block_0"):
        _restarted_loop(tmp_path, wider)
    parts, meta = FragmentCheckpointer(str(tmp_path)).restore()
    state, meta = syncer_state.join_parts(parts, meta)
    del state["momentum"]["1"]
    fresh = Run(tmp_path / "fresh").loop.syncer
    with pytest.raises(ValueError, match="has no momentum of fragment 1, which this syncer owns"):
        syncer_state.load(fresh, state, meta, 0.0)


def test_a_restore_with_fewer_learners_drops_the_ones_beyond(tmp_path):
    """A forced resume with fewer learners re-registered the missing ones: a finished one
    stayed in the merge roster for good, halving every merge."""
    from decoupled_diloco.diloco import syncer_state

    run = Run(tmp_path)
    run.merge(0, seed=1)
    assert run.loop.save()
    parts, meta = FragmentCheckpointer(str(tmp_path)).restore()
    state, meta = syncer_state.join_parts(parts, meta)
    meta["learners"]["1"] = list(meta["learners"]["0"])
    meta["learners"]["1"][4] = True  # finished: in the roster
    fresh = Run(tmp_path / "fresh").loop.syncer
    syncer_state.load(fresh, state, meta, 0.0)
    assert sorted(fresh.learners) == [0] and fresh.registry.roster(0.0) in ([0], [])
