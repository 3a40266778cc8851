"""The local runtime's syncer in a process of its own (`local_syncer`): the wire between the
two processes, the same run as with a syncer thread, a dead syncer process fails the run."""

import dataclasses
import json
import multiprocessing
import os
import threading
import time
from multiprocessing import shared_memory

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


def test_a_dead_peer_is_an_error_not_a_hang(echo):
    w, child = echo
    w.send("exit")
    child.join(30)
    assert child.exitcode == 3
    with pytest.raises(WireClosedError):
        w.recv(timeout=30)


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


@pytest.mark.slow
def test_a_syncer_process_whose_parent_is_killed_saves_and_exits_quietly(tmp_path):
    """kill -9 of the run's process: its syncer process, orphaned, finds the pipe closed,
    merges what it holds and saves its checkpoint, and exits without a traceback (its
    records and replies have nowhere to go: the parent and its learners are gone)."""
    import signal
    import subprocess
    import sys

    args = [sys.executable, "-m", "decoupled_diloco.main", "--config=configs/tiny_decoupled.py",
            f"--workdir={tmp_path}", "--config.diloco.learners=2", "--config.train.steps=400",
            "--config.train.batch_size=8", "--config.data.seq_len=64",
            "--config.data.max_corpus_bytes=400000", "--config.train.eval_every=0",
            "--config.train.checkpoint_every=0", "--config.local_syncer=process"]  # fmt: skip
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(args, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    merges, deadline = tmp_path / "merges.jsonl", time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if merges.exists() and len(_read(merges)) >= 4:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it was killed"
    killed = time.time()
    os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)  # (the orphan holds stderr open until it exits)
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    ckpt = tmp_path / "checkpoints" / "syncer_0"
    assert max(p.stat().st_mtime for p in ckpt.iterdir()) >= killed  # its last save
