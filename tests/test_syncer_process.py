"""The local runtime's syncer in a process of its own (`local_syncer`): the wire between the
two processes, the same run as with a syncer thread, a dead syncer process fails the run."""

import collections
import contextlib
import dataclasses
import errno
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from multiprocessing import shared_memory

import jax
import ml_dtypes
import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.checkpoint import Checkpointer
from decoupled_diloco.diloco.messages import Heartbeat, Offer
from decoupled_diloco.runtime import wire as wire_lib
from decoupled_diloco.runtime.local import LocalRuntime
from decoupled_diloco.runtime.syncer_process import SyncerProcess, SyncerProcessError
from decoupled_diloco.runtime.wire import Wire, WireClosedError


def _echo(conn) -> None:
    """Child: sends back what it gets (tagged "echo") until "stop"; "exit" dies at once."""
    w = Wire(conn)
    while True:
        kind, meta, obj = w.recv()
        if kind == "stop":
            break
        if kind == "exit":
            os._exit(3)
        w.send("echo", obj, **meta)
    w.settle(30.0)
    w.close()


@pytest.fixture
def echo():
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_echo, args=(theirs,), daemon=True)
    child.start()
    theirs.close()
    w = Wire(ours)
    yield w, child
    if child.is_alive():
        child.kill()
    w.close()


def _payload(rng, scale: int = 1) -> dict:
    big = rng.standard_normal((scale * 300, 257)).astype(np.float32)  # 300 KB: out of band
    return {
        "big": big,
        "strided": big[:, ::2],  # not contiguous: numpy pickles it in band
        "bf16": rng.standard_normal(70_000).astype(ml_dtypes.bfloat16),
        "int8": rng.integers(-128, 127, 200_000, dtype=np.int8),
        "small": np.arange(7, dtype=np.int64),
        "scalar": 3.5,
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert b[k].dtype == a[k].dtype and b[k].shape == a[k].shape, k
            assert np.ascontiguousarray(b[k]).tobytes() == np.ascontiguousarray(a[k]).tobytes(), k
        else:
            assert b[k] == a[k], k


def test_the_wire_carries_arrays_exactly_and_reuses_its_segments(echo):
    w, child = echo
    rng = np.random.default_rng(0)
    offer = Offer(learner=2, incarnation=1, fragment=3, step=40, c_steps=12, c_tokens=3072,
                  base_version=5, time=1.5, payload=_payload(rng), nbytes=123)  # fmt: skip
    for i in range(6):
        w.settle(30.0)  # the last message's segment is acknowledged (the ack has a thread)
        w.send("x", offer, i=i)
        kind, meta, back = w.recv(timeout=60)
        assert kind == "echo" and meta == {"i": i}
        assert dataclasses.replace(back, payload=None) == dataclasses.replace(offer, payload=None)
        _assert_same(offer.payload, back.payload)
        assert back.payload["big"].flags.writeable  # the receiver owns its copy
    big = offer.payload["big"].nbytes + offer.payload["bf16"].nbytes
    big += offer.payload["int8"].nbytes
    assert w.bytes_received >= 6 * big and w.bytes_sent >= 6 * big
    # One segment served all six.
    assert len(w._free) + len(w._lent) == 1
    # Small messages never touch shared memory.
    sent = w.bytes_sent
    w.send("x", Heartbeat(learner=0, incarnation=0, step=1, step_seconds=0.1, time=0.0), i=9)
    assert w.recv(timeout=60)[2].step == 1 and w.bytes_sent == sent
    # A larger message takes a larger segment; closing unlinks every segment of this end.
    w.settle(30.0)
    w.send("x", _payload(rng, scale=8), i=10)
    w.recv(timeout=60)
    names = [s.name for s in w._free] + list(w._lent)
    assert len(names) == 2
    w.send("stop")
    child.join(30)
    assert child.exitcode == 0
    w.close()
    for name in names:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)


def test_without_room_in_shared_memory_a_message_goes_whole_through_the_pipe(echo, monkeypatch):
    w, child = echo
    monkeypatch.setattr(wire_lib, "_shm_free_bytes", lambda: 8 << 20)  # a full /dev/shm
    payload = _payload(np.random.default_rng(2))
    w.send("x", payload, i=0)
    kind, _, back = w.recv(timeout=60)
    _assert_same(payload, back)
    assert w.inline_fallbacks == 1 and w.bytes_sent == 0 and not w._lent and not w._free
    assert w.bytes_received > 0  # the child had room: its echo came through shared memory


def test_a_segment_the_file_system_cannot_back_is_never_written(echo, monkeypatch):
    """The free-space check passed, but another sender took the room before this one wrote
    (two shards' forwarders, a syncer process's replies): the new segment's pages cannot be
    reserved, and the message goes whole through the pipe instead of writing past the end
    of /dev/shm, which killed the process with SIGBUS."""
    w, child = echo

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(wire_lib.os, "posix_fallocate", no_room, raising=False)
    ns = wire_lib._pid_namespace()
    before = {n for n in os.listdir("/dev/shm") if n.startswith(f"ddw_{ns}_{os.getpid()}_")}
    payload = _payload(np.random.default_rng(3))
    w.send("x", payload, i=0)
    _, _, back = w.recv(timeout=60)
    _assert_same(payload, back)
    assert w.inline_fallbacks == 1 and w.bytes_sent == 0 and not w._lent and not w._free
    after = {n for n in os.listdir("/dev/shm") if n.startswith(f"ddw_{ns}_{os.getpid()}_")}
    assert after <= before  # the segment it could not back is gone


_RACE = """
import multiprocessing, threading, numpy as np
from decoupled_diloco.runtime import wire as wire_lib
pipes = [multiprocessing.Pipe(duplex=True) for _ in range(2)]
senders, receivers = [wire_lib.Wire(a) for a, _ in pipes], [wire_lib.Wire(b) for _, b in pipes]
msg = {"theta": np.ones(22 << 18, np.float32)}  # 22 MB each, 40 MB of /dev/shm
segment, both = wire_lib.Wire._segment, threading.Barrier(2)
def together(self, n):  # both have their segment before either writes into it
    seg = segment(self, n)
    both.wait(30)
    return seg
wire_lib.Wire._segment = together
threads = [threading.Thread(target=w.send, args=("x", msg)) for w in senders]
[t.start() for t in threads]
got = [r.recv(30)[2]["theta"] for r in receivers]
[t.join() for t in threads]
assert all(np.array_equal(g, msg["theta"]) for g in got)
print("inline", sorted(w.inline_fallbacks for w in senders))
"""


def test_two_senders_that_passed_the_free_space_check_together_do_not_die(tmp_path):
    """The race itself, in a private mount namespace whose /dev/shm is a 40 MB tmpfs (needs
    unshare and the right to mount: skipped elsewhere)."""
    script = tmp_path / "race.py"
    script.write_text(_RACE)
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=40m tmpfs /dev/shm"],
                           capture_output=True, check=False)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"no private /dev/shm here: {probe.stderr.decode().strip()}")
    cmd = f"mount -t tmpfs -o size=40m tmpfs /dev/shm && exec {sys.executable} {script}"
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", cmd],
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # SIGBUS: -7 / 135
    assert "inline [0, 1]" in out.stdout  # one went through shared memory, one whole


def test_a_dead_peer_is_an_error_not_a_hang(echo):
    w, child = echo
    w.send("exit")
    child.join(30)
    assert child.exitcode == 3
    with pytest.raises(WireClosedError):
        w.recv(timeout=30)


def test_segments_a_killed_process_left_are_removed_by_the_next_run(echo, tmp_path):
    """A kill -9 of a run's process group takes multiprocessing's resource tracker with it,
    and its wire segments stayed in /dev/shm for good (a container's is often 64 MB). They
    carry their owner's pid: a later run removes those whose owner is gone, of its own pid
    namespace only (where the pid means that process), and nothing else."""
    w, _ = echo
    w.send("data", {"big": np.zeros(1 << 17, np.float32)})  # out of band: a segment
    w.recv(timeout=60)
    ns = wire_lib._pid_namespace()
    mine = [n for n in os.listdir("/dev/shm") if n.startswith(f"ddw_{ns}_{os.getpid()}_")]
    assert mine  # the name says whose it is
    gone = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    gone.start()
    gone.join()
    names = {f"ddw_{ns}_{gone.pid}_0a1b2c3d": True,  # its owner is dead: removed
             f"ddw_{ns}_{os.getpid()}_0a1b2c3d": False,  # alive
             f"ddw_1{ns}_{gone.pid}_0a1b2c3d": False,  # another pid namespace's
             f"psm_{gone.pid}": False, "ddw_notes": False}  # fmt: skip
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert wire_lib.sweep_orphans(str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, removed in names.items() if not removed)


def test_a_syncer_process_traffic_is_known_before_its_last_words():
    """A killed attempt's heartbeat read the child's traffic as 0 (known only from its last
    words): each reply now says the traffic so far, and the parent keeps the last."""
    sp = SyncerProcess.__new__(SyncerProcess)
    sp._final, sp._traffic, sp._error, sp._last_reply = None, {}, None, None
    sp._answers, sp._answers_lock, sp._done = {}, threading.Lock(), threading.Event()
    sent, seen = [], []

    class Link:
        def send(self, learner, msg):
            sent.append((learner, msg))

    traffic = {"bytes_in": 100, "bytes_out": 50}
    last_words = {"params": {}, "stats": {"bytes_in": 300, "bytes_out": 90}}
    messages = iter([("reply", {"learner": 0, "traffic": traffic}, "merged"),
                     ("again", {"learner": 1, "traffic": {**traffic, "bytes_out": 80}}, None),
                     ("done", {}, last_words)])  # fmt: skip

    class FakeWire:
        def recv(self):
            seen.append(sp.bytes_communicated())
            return next(messages)

    sp.link, sp.wire = Link(), FakeWire()
    sp._read()
    assert sent == [(0, "merged"), (1, "merged")]
    assert seen == [0, 150, 180] and sp.bytes_communicated() == 390


def _report_stop_signals(out) -> None:
    """Child: whether SIGINT and SIGTERM were ignored when it started."""
    import signal

    out.put([signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM)])


def test_a_syncer_process_ignores_a_ctrl_c_from_its_first_instruction():
    """A terminal's Ctrl-C reaches the whole process group (a scheduler's SIGTERM may too):
    one that came while the syncer process still imported (before it could ignore the
    signal itself) killed it, and the run failed instead of stopping in order. It starts
    with both ignored; the parent keeps its own handlers."""
    import signal

    from decoupled_diloco.runtime import syncer_process

    ctx = multiprocessing.get_context("spawn")
    before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    for ignored, started in ((True, syncer_process._stop_signals_ignored()),
                             (False, contextlib.nullcontext())):  # fmt: skip
        out = ctx.Queue()
        child = ctx.Process(target=_report_stop_signals, args=(out,))
        with started:
            child.start()
        assert out.get(timeout=120) == [ignored, ignored]
        child.join(30)
        assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == before


def test_a_bad_local_syncer_fails_at_start_up(small_config):
    with pytest.raises(ValueError, match="local_syncer must be one of"):
        config_lib.validate(small_config(local_syncer="fork"))


def _read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _synchronous(small_config, **over):
    """Synchronous Streaming DiLoCo (K = M, learners wait for every merge): its result does
    not depend on timing, so two runs of it must agree to the bit."""
    base = {"diloco.learners": 2, "diloco.sync_every": 4, "diloco.fragments": 2,
            "diloco.overlap": 1, "diloco.quorum": 2, "diloco.max_wait": -1.0,
            "diloco.grace_gamma": 0.0, "train.steps": 24, "train.eval_every": 8,
            # learners sleep 2/3 of a step: the main thread's evaluations (it looks every
            # 0.2 s) find them mid-run
            "faults.speed_factors": [3.0, 3.0]}  # fmt: skip
    base.update(over)
    return config_lib.validate(small_config(**base))


@pytest.mark.slow
def test_a_syncer_process_gives_the_run_a_syncer_thread_gives(small_config, tmp_path):
    out = {}
    for mode in ("thread", "process"):
        rt = LocalRuntime(_synchronous(small_config, local_syncer=mode), str(tmp_path / mode),
                          verbose=False)  # fmt: skip
        summary = rt.run()
        merges = [(r["fragment"], r["version"], sorted(r["learners"]))
                  for r in _read(tmp_path / mode / "merges.jsonl")]  # fmt: skip
        evals = [(r["step"], r["eval_loss"]) for r in _read(tmp_path / mode / "metrics.jsonl")
                 if r["learner"] == "global"]  # fmt: skip
        out[mode] = summary, merges, evals
        if mode == "process":  # it really ran there: offers and Θ crossed the wire
            (proc,) = rt.syncers
            assert isinstance(proc, SyncerProcess) and proc.process.exitcode == 0
            assert proc.process.pid != os.getpid()
            assert proc.wire.bytes_sent > 0 and proc.wire.bytes_received > 0
        else:
            assert not rt.syncer_processes
    (s_t, merges_t, evals_t), (s_p, merges_p, evals_p) = out["thread"], out["process"]
    assert merges_t and merges_p == merges_t
    # Θ was read from the process mid-run too (when depends on timing: compare the last).
    assert len(evals_p) >= 2 and all(np.isfinite(loss) for _, loss in evals_p)
    assert evals_p[-1] == evals_t[-1]
    assert s_p["final_eval_loss"] == s_t["final_eval_loss"]
    for key in ("merges", "mean_offer_steps", "rejected_offers"):
        assert s_p[key] == s_t[key], key


def test_a_learner_at_its_boundary_when_the_run_fails_elsewhere_keeps_its_work(
    small_config, tmp_path, monkeypatch
):
    """The run fails (another thread) while a learner is at a step boundary, where it reads
    its replies: it stops there and saves its step, as a learner the failure finds between
    steps does (before, the boundary's RunAbortedError left it unsaved). Its Leave does not
    say it finished its steps."""
    from decoupled_diloco.diloco.learner import Learner
    from decoupled_diloco.runtime.learner_loop import LearnerLoop

    cfg = _synchronous(small_config, **{"train.steps": 40, "train.eval_every": 0,
                                        "faults.speed_factors": [1.0, 1.0]})  # fmt: skip
    rt = LocalRuntime(cfg, str(tmp_path), verbose=False)
    boundary = LearnerLoop._boundary

    def fail_elsewhere_at_step_6(self):
        if self.m == 0 and self.step == 6:  # what a failed thread does (LocalRuntime._thread)
            rt.errors.append(RuntimeError("another thread failed"))
            rt.failed.set()
        return boundary(self)

    leaves, leave = [], Learner.leave

    def recording_leave(self, finished):
        leaves.append((self.id, finished))
        return leave(self, finished)

    monkeypatch.setattr(LearnerLoop, "_boundary", fail_elsewhere_at_step_6)
    monkeypatch.setattr(Learner, "leave", recording_leave)
    with pytest.raises(RuntimeError):
        rt.run()
    loop = rt.loops[0]
    assert loop.step == 6
    assert (0, False) in leaves and not any(finished for _, finished in leaves)
    ckpt = Checkpointer(tmp_path / "checkpoints" / "learner_0")
    assert ckpt.latest_step() == 6
    ckpt.close()


@pytest.mark.slow
def test_a_syncer_process_that_dies_fails_the_run_instead_of_hanging(small_config, tmp_path):
    cfg = _synchronous(small_config, local_syncer="process", **{"train.steps": 400,
                       "train.eval_every": 0})  # fmt: skip
    rt = LocalRuntime(cfg, str(tmp_path), verbose=False)
    killed = threading.Event()

    def kill_after_a_merge():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            procs = getattr(rt, "syncer_processes", [])
            if procs and rt.log.ledger.merges > 0:
                procs[0].process.kill()
                killed.set()
                return
            time.sleep(0.05)

    threading.Thread(target=kill_after_a_merge, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        rt.run()
    assert killed.is_set()
    assert isinstance(info.value.__cause__, SyncerProcessError)
    assert "exited with code -9" in str(info.value.__cause__)
    assert max(loop.step for loop in rt.loops) < 400  # the learners were stopped
    # ...without waiting out final_wait for replies that cannot come, and kept their work.
    for loop in rt.loops:
        ckpt = Checkpointer(tmp_path / "checkpoints" / f"learner_{loop.m}")
        assert ckpt.latest_step() == loop.step > 0
        ckpt.close()
    assert time.monotonic() - start < 300


def _orphaning_parent(run, ckpt: str, pids) -> None:
    """Child: a run's parent side of a syncer process (no learners), which is then killed."""
    from decoupled_diloco import faults, models
    from decoupled_diloco.diloco.fragments import model_plan

    class Link:
        def receive(self, timeout):
            time.sleep(timeout)
            return []

        def send(self, learner, msg):
            pass

    schedule = faults.FaultSchedule(run.faults, run.num_learners, faults.HORIZON_S, 0.0)
    plan = model_plan(run.model, run.diloco)
    sp = SyncerProcess(0, run, plan, Link(), ckpt, lambda rec: None, schedule)
    init = models.flatten_params(models.init_params(run.model, jax.random.key(0)))
    sp.start({k: np.asarray(v, np.float32) for k, v in init.items()}, time.monotonic())
    assert sp.global_params() is not None  # (its loop serves)
    pids.put(sp.process.pid)
    time.sleep(600)


@pytest.mark.slow  # a spawned run killed: ~9 s on 2 cores
def test_an_orphaned_syncer_process_commits_no_checkpoint(small_config, tmp_path):
    """The run's process is killed: its syncer process ends its loop without the final
    checkpoint, which would hold merges whose records went nowhere (it saved one)."""
    import signal

    run = _synchronous(small_config, **{"diloco.syncer_checkpoint_seconds": 3600.0})
    ckpt = tmp_path / "syncer_0"
    ctx = multiprocessing.get_context("spawn")
    pids = ctx.Queue()
    # (not a daemon: those may not start processes)
    parent = ctx.Process(target=_orphaning_parent, args=(run, str(ckpt), pids))
    parent.start()
    try:
        child = pids.get(timeout=300)
        os.kill(parent.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break  # (an orphan's exit is reaped by init)
            time.sleep(0.1)
        else:
            pytest.fail("the orphaned syncer process did not exit")
    finally:
        parent.kill()
    committed = [d for d in ckpt.iterdir() if (d / "manifest.json").exists()]
    assert not committed, committed  # (it saved Θ_0 before)


@pytest.mark.slow
def test_a_syncer_process_whose_parent_is_killed_exits_quietly_saving_nothing_more(tmp_path):
    """kill -9 of the run's process: its syncer process, orphaned, finds the pipe closed and
    exits without a traceback and without another checkpoint. It used to merge what it held
    and save: the records of those merges had nowhere to go, so the checkpoint a resume
    restores held merges merges.jsonl lacked (a missing version, steps in Θ the work
    accounting never credited). As with a syncer thread, every merge a committed checkpoint
    holds is recorded. (This end-to-end run need not catch the orphan with merges to make;
    `test_an_orphaned_syncer_process_commits_no_checkpoint` pins the refused commit.)"""
    import signal
    import subprocess
    import sys

    args = [sys.executable, "-m", "decoupled_diloco.main", "--config=configs/tiny_decoupled.py",
            f"--workdir={tmp_path}", "--config.diloco.learners=2", "--config.train.steps=400",
            "--config.train.batch_size=8", "--config.data.seq_len=64",
            "--config.data.max_corpus_bytes=400000", "--config.train.eval_every=0",
            "--config.train.checkpoint_every=0", "--config.local_syncer=process",
            "--config.diloco.syncer_checkpoint_seconds=0.5"]  # fmt: skip
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(args, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    merges, deadline = tmp_path / "merges.jsonl", time.monotonic() + 180
    ckpt = tmp_path / "checkpoints" / "syncer_0"

    def committed():
        found = ckpt.iterdir() if ckpt.exists() else ()
        return sorted((int(d.name), d) for d in found
                      if d.name.isdigit() and (d / "manifest.json").exists())  # fmt: skip

    while time.monotonic() < deadline and proc.poll() is None:
        if merges.exists() and len(_read(merges)) >= 4 and committed():
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it was killed"
    os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)  # (the orphan holds stderr open until it exits)
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    last = json.loads((committed()[-1][1] / "manifest.json").read_text())
    assert last["fragments"], last
    recorded = collections.defaultdict(set)
    for rec in _read(merges):
        recorded[rec["fragment"]].add(rec["version"])
    for p, frag in last["fragments"].items():
        assert set(range(1, frag["version"] + 1)) <= recorded[int(p)], (p, frag["version"])
