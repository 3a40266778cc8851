"""The Ray runtime on a local Ray cluster: learners and the syncer as separate processes.

One cluster serves the module (the runtime reuses a connected driver). Every learner
process has its own 2 fake CPU devices; runs use the same model, batch and step count so
the persistent compilation cache serves all of them after the first.
"""

import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from decoupled_diloco import config as config_lib  # noqa: E402
from decoupled_diloco import run_files  # noqa: E402
from decoupled_diloco.config import RayConfig  # noqa: E402
from decoupled_diloco.diloco import compression  # noqa: E402
from decoupled_diloco.diloco.fragments import model_plan  # noqa: E402
from decoupled_diloco.diloco.messages import Heartbeat, Join, Offer  # noqa: E402
from decoupled_diloco.diloco.offer_checks import RunBounds  # noqa: E402
from decoupled_diloco.diloco.syncer import Syncer  # noqa: E402
from decoupled_diloco.runtime.local import LocalRuntime  # noqa: E402
from decoupled_diloco.runtime.ray import cluster as ray_cluster  # noqa: E402
from decoupled_diloco.runtime.ray import links as ray_links  # noqa: E402
from decoupled_diloco.runtime.ray.runtime import RayRuntime  # noqa: E402

pytestmark = pytest.mark.ray

STEPS = 24  # the same in every run: one compiled train step for the whole module
CRASH_AT = 10.0  # s: the fault schedule kills learner 2 (usually mid-training, else starting)
# Learner 2 runs 8x slower than its measured step time so that it is still training at
# CRASH_AT on a fast machine too. (A crash after the driver saw a learner finish is not
# applied; one that races the driver's status poll restarts a finished learner, which
# reports a rejoin at its last step.)


@pytest.fixture(scope="module")
def cluster():
    started = ray_cluster.connect(RayConfig(num_cpus=2), verbose=False)
    yield
    if started:
        ray.shutdown()


def _read(path) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


def _start(runtime) -> tuple[threading.Thread, dict]:
    """Runs `runtime` on a thread; the dict gets its "summary" or the "error" it raised."""
    out: dict = {}

    def go():
        try:
            out["summary"] = runtime.run()
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=go)
    thread.start()
    return thread, out


def _ray_config(small_config, **over):
    base = {
        "runtime": "ray",
        "diloco.learners": 3,
        "diloco.sync_every": 4,
        "diloco.fragments": 2,
        "train.steps": STEPS,
        "ray.poll_seconds": 0.25,
    }
    base.update(over)
    return small_config(**base)


# --- placement (pure) ---------------------------------------------------------------------
def _tpu_node(slice_id, worker, alive=True):
    res = {"CPU": 8.0, "TPU": 4.0, slice_id: 1.0, "node:10.0.0.1": 1.0}
    if worker == 0:
        res["TPU-v5p-16-head"] = 1.0
    labels = {} if worker is None else {"ray.io/tpu-worker-id": str(worker)}
    return {"Alive": alive, "Resources": res, "Labels": labels, "NodeManagerAddress": "10.0.0.1"}


def test_tpu_slices_are_found_from_node_resources():
    head_vm = {"Alive": True, "Resources": {"CPU": 32.0, "syncer": 1.0}}
    nodes = [head_vm, *[_tpu_node(s, w) for s, w in [("dd-1", 1), ("dd-1", 0), ("dd-0", 0)]]]
    nodes += [_tpu_node("dd-0", 1), _tpu_node("dd-2", 0, alive=False)]  # a preempted slice
    slices = ray_cluster.tpu_slices(nodes)
    assert slices == {"dd-0": {"hosts": 2, "chips": 4}, "dd-1": {"hosts": 2, "chips": 4}}
    hosts = ray_cluster.learner_hosts(slices, 2, 8)
    assert [h["slice"] for h in hosts] == ["dd-0", "dd-1"]
    opts = ray_cluster.learner_options("tpu", 8, 3, hosts[1])
    assert opts["resources"] == {"TPU": 4, "dd-1": 1} and opts["max_restarts"] == 3
    with pytest.raises(ValueError, match="diloco.learners=3"):
        ray_cluster.learner_hosts(slices, 3, 8)
    with pytest.raises(ValueError, match="devices_per_learner is 16"):
        ray_cluster.learner_hosts(slices, 2, 16)
    # Learners whose slices span other host counts would read overlapping windows (each
    # host reads a sub-shard of its learner's shard).
    mixed = {"dd-0": {"hosts": 2, "chips": 4}, "dd-1": {"hosts": 1, "chips": 8}}
    with pytest.raises(ValueError, match="different numbers of hosts"):
        ray_cluster.learner_hosts(mixed, 2, 8)
    assert ray_cluster.syncer_options({"syncer": 1.0}, 2, 3)["resources"] == {"syncer": 0.5}
    assert "resources" not in ray_cluster.syncer_options({"CPU": 2.0}, 1, 3)
    env = ray_cluster.learner_options("cpu", 2, 3)["runtime_env"]["env_vars"]
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    # From 11 slices on, learner m is still on dd-m (a string sort put dd-10 second).
    many = ray_cluster.tpu_slices([_tpu_node(f"dd-{i}", 0) for i in reversed(range(12))])
    assert list(many) == [f"dd-{i}" for i in range(12)]


def test_multi_host_learner_processes_are_pinned_to_their_tpu_workers():
    """Host h of a learner (h = 0 owns the link) must be JAX process h = TPU worker h: every
    process, also a restarted one, asks for its worker's label; Ray's creation order or the
    free hosts at restart time do not decide it."""
    slices = ray_cluster.tpu_slices([_tpu_node("dd-0", w) for w in (2, 0, 3, 1)])
    (layout,) = ray_cluster.learner_hosts(slices, 1, 16)
    assert layout == {"slice": "dd-0", "hosts": 4, "chips": 4}
    for host in range(4):
        opts = ray_cluster.learner_options("tpu", 16, -1, layout, host)
        assert opts["label_selector"] == {"ray.io/tpu-worker-id": str(host)}
        assert opts["resources"] == {"TPU": 4, "dd-0": 1} and opts["max_restarts"] == -1
    single = ray_cluster.tpu_slices([_tpu_node("dd-0", None)])  # one host: nothing to pin
    opts = ray_cluster.learner_options("tpu", 4, 3, ray_cluster.learner_hosts(single, 1, 4)[0])
    assert "label_selector" not in opts
    for workers in [(0, None), (0, 0), (1, 2)]:  # unlabelled, duplicate, no worker 0
        with pytest.raises(ValueError, match="ray.io/tpu-worker-id"):
            ray_cluster.tpu_slices([_tpu_node("dd-0", w) for w in workers])


def test_evaluation_requests_are_served_in_order_and_a_failed_one_is_reported():
    """ray.evaluate = "learner", the bookkeeping on both sides (no cluster needed)."""
    from decoupled_diloco.runtime.ray.eval import DriverEvals, LearnerEvals

    def make_evaluator():
        def evaluate(theta):
            if "bad" in theta:
                raise MemoryError("no room for a second copy")
            return float(sum(theta.values()))

        return evaluate

    results: list = []
    evals = LearnerEvals(0, 1, make_evaluator, results.append)
    evals.serve()  # nothing asked: nothing done
    evals.put(2, ({"a": 1.0}, {"b": 2.0}))  # Θ arrives in syncer shards
    evals.put(1, ({"a": 0.5},))
    evals.serve()
    evals.serve()
    evals.serve()
    assert results == [{"tag": 1, "eval_loss": 0.5}, {"tag": 2, "eval_loss": 3.0}]
    evals.put(3, ({"bad": 1.0},))
    evals.serve()  # must not raise: training goes on
    assert results[-1]["tag"] == 3 and math.isnan(results[-1]["eval_loss"])
    assert "MemoryError" in results[-1]["error"]

    driver = DriverEvals()
    driver.pending[1] = {"learner": "global", "step": 8}
    row = driver.result({"tag": 1, "eval_loss": 2.0})
    assert row == {"learner": "global", "step": 8, "eval_loss": 2.0}
    assert driver.result({"tag": 4, "eval_loss": 1.5}) is None and driver.results == {4: 1.5}


def test_a_syncer_poll_in_flight_when_the_run_ends_keeps_its_records(
    monkeypatch, small_config, tmp_path
):
    """The driver polls the syncer shard for its merge records; a poll still in flight when
    the run ends (a Ctrl-C's, or the end of training) has taken its records from the shard's
    buffer, so they are recorded before the shard's own last ones (a merge Θ held was
    missing from merges.jsonl after a Ctrl-C: 379 of 400 steps of a fragment)."""
    from decoupled_diloco.runtime.ray import runtime as ray_runtime

    class Log:
        def __init__(self):
            self.records = []

        def record(self, rec):
            self.records.append(rec["version"])

    class Shard:
        finish = "finish"

    rt = RayRuntime(config_lib.validate(_ray_config(small_config)), str(tmp_path), verbose=False)
    rt.syncers, rt.log = [Shard()], Log()
    rt._pending = {("syncer", 0, 0): "poll in flight", ("learner", 0, 0): "a learner's poll"}
    traffic = {"bytes_in": 10, "bytes_out": 20}
    replies = {"poll in flight": {"records": [{"version": 2}], "traffic": traffic, **_AT}}
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: replies[ref])
    last = {"stats": {"merges": 3, **traffic}, "traffic": traffic, "records": [{"version": 3}],
            **_AT}  # fmt: skip
    monkeypatch.setattr(ray_runtime, "_call", lambda method: last)
    assert rt._finish_syncers() == [{"merges": 3, **traffic}]
    assert rt.log.records == [2, 3]
    assert rt._pending == {("learner", 0, 0): "a learner's poll"}


_AT = {"pid": 7, "node": "n0"}  # the process a fake reply comes from


def test_the_traffic_of_a_syncer_process_ray_restarted_stays_counted(
    monkeypatch, small_config, tmp_path
):
    """A syncer shard's process counts its bytes from 0: after Ray restarts it (a crash),
    the run's traffic is every process's, in the attempt's heartbeat and in the summary's
    stats (the last process's alone undercounted a run with a syncer crash)."""
    from decoupled_diloco.runtime.ray import runtime as ray_runtime

    class Log:
        def record(self, rec):
            pass

    class Shard:
        finish = poll = "shard"

    rt = RayRuntime(config_lib.validate(_ray_config(small_config)), str(tmp_path), verbose=False)
    rt.syncers, rt.log, rt.learners = [Shard()], Log(), {}
    first = {"records": [], "traffic": {"bytes_in": 100, "bytes_out": 300}, "fatal": None,
             "pid": 7, "node": "n0"}  # fmt: skip
    replies = [first, {**first, "traffic": {"bytes_in": 150, "bytes_out": 400}},
               {**first, "traffic": {"bytes_in": 5, "bytes_out": 6}, "pid": 9}]  # fmt: skip
    calls = iter(range(len(replies)))
    monkeypatch.setattr(rt, "_seen_pid", lambda *a: None)

    class Remote:
        @staticmethod
        def remote():
            return next(calls)  # the poll's ref

    monkeypatch.setattr(Shard, "poll", Remote, raising=False)
    monkeypatch.setattr(ray, "wait", lambda refs, **kw: (refs, []))
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: replies[ref])
    rt._collect()
    assert rt.bytes_communicated() == 400
    rt._collect()  # the same process, later: its newer count replaces its older one
    assert rt.bytes_communicated() == 550
    rt._collect()  # a new process (Ray restarted it) counts from 0
    assert rt.bytes_communicated() == 561
    own = {"bytes_in": 7, "bytes_out": 8}
    end = {"stats": {"merges": 4, **own}, "traffic": own, "records": [], "pid": 9,
           "node": "n0"}  # fmt: skip
    monkeypatch.setattr(ray_runtime, "_call", lambda method: end)
    assert rt._finish_syncers() == [{"merges": 4, "bytes_in": 157, "bytes_out": 408}]
    assert rt.bytes_communicated() == 565


def test_a_resume_drops_the_rows_its_learners_redo_once_each_says_where_it_starts(
    small_config, tmp_path
):
    """A Ray resume after a kill logged the steps past the learners' checkpoints a second
    time (metrics.jsonl held two rows for a step): each learner's first report of the
    attempt says where it starts, and the rows past it go, as in the local runtime; the
    global rows past the lead go once every learner has started."""
    rows = [{"learner": m, "step": s} for s in (10, 20, 30) for m in (0, 1, 2)]
    rows += [{"learner": "global", "step": s} for s in (10, 20, 30)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config_lib.validate(_ray_config(small_config, **{"train.eval_every": 10}))
    rt = RayRuntime(cfg, str(tmp_path), verbose=False)

    def report(m, start, new_rows=()):
        out = {"steps": [], "events": [], "evals": [], "rows": list(new_rows), "step": start,
               "done": False, "incarnation": 0, "start_step": start}  # fmt: skip
        rt._learner_report(m, out)

    def kept(who):
        return [r["step"] for r in _read(tmp_path / "metrics.jsonl") if r["learner"] == who]

    report(0, 20, [{"learner": 0, "step": 21}])
    assert kept(0) == [10, 20, 21] and kept(1) == [10, 20, 30] and kept("global") == [10, 20, 30]
    report(0, 20, [{"learner": 0, "step": 22}])  # only the first report of a learner counts
    assert kept(0) == [10, 20, 21, 22]
    report(1, 10)
    assert kept(1) == [10] and kept("global") == [10, 20, 30] and not rt._all_started()
    rt.lost.add(2)  # out of the run: not waited for
    assert rt._all_started()
    assert rt._evaluations_start() == 30  # (train.eval_every 10: next after the lead 20)
    assert kept("global") == [10, 20]


def test_a_restarted_learner_process_counts_the_steps_its_dead_one_took_past_the_cut(
    small_config, tmp_path
):
    """A learner process killed at step 25 whose new process goes on from step 24 (the
    newest step Θ holds) lost step 25 as well, which only the driver saw: its rejoin counts
    it with the cut's loss, in every fragment, as a crash's loss (crash_lost_steps). It had
    been counted nowhere: merged + lost fell short of the steps trained."""
    cfg = config_lib.validate(_ray_config(small_config, **{"diloco.fragments": 2}))
    rt = RayRuntime(cfg, str(tmp_path), verbose=False)
    rt.hosts = [1, 1, 1]  # (one process per learner)
    rt.status[1] = {"step": 25, "done": False, "incarnation": 0}  # its last report
    rt._seen_pid(("learner", 1, 0), 100, "n0")
    rt._seen_pid(("learner", 1, 0), 200, "n0")  # a new process: the old one died at 25
    cut = {"0": [[14, 24]], "1": [[20, 24]]}  # what Θ lacked up to the cut (its own count)
    rejoin = {"event": "rejoin", "learner": 1, "step": 24, "incarnation": 1, "time": 1.0,
              "process_restart": True, "lost_steps": 10, "lost_spans": cut}  # fmt: skip
    rt._learner_event(1, rejoin)
    (logged,) = _read(tmp_path / "events.jsonl")
    assert logged["lost_spans"] == {"0": [[14, 24], [24, 25]], "1": [[20, 24], [24, 25]]}
    assert (logged["lost_steps"], logged["unseen_lost_steps"]) == (11, 1)
    assert (rt.ledger.crash_lost_steps, rt.ledger.resume_lost_steps) == (11, 0)
    rt._learner_event(1, {**rejoin, "time": 2.0})  # a later restart with no death seen: as is
    assert _read(tmp_path / "events.jsonl")[-1]["lost_steps"] == 10
    # A step past the cut that a syncer restore rolled back is syncer_lost_steps already.
    rt.ledger.seed_rolled({"1": {"0": [[23, 25]]}})
    rt._died_at[1] = 25
    rt._learner_event(1, {**rejoin, "time": 3.0})
    last = _read(tmp_path / "events.jsonl")[-1]
    assert (last["lost_steps"], last["rolled_back_steps"]) == (9, 2), last


def test_a_learner_process_that_dies_and_never_rejoins_counts_what_its_life_lost(
    small_config, tmp_path
):
    """Learner 1's life began at step 8; its process died at step 25, and the restarted one
    finished without rejoining (its membership had ended): no rejoin's cut counted the
    loss, so the driver emits `learner_gone` for it and the ledger counts what Θ lacks of
    that life (fragment 0 holds up to 16, fragment 1 up to 24: 9 steps). A learner lost
    for good (its restarts exhausted) counts its last life up to its last report; one that
    left gracefully (its final sync offered its work) counts none."""
    cfg = config_lib.validate(_ray_config(small_config, **{"diloco.fragments": 2}))
    rt = RayRuntime(cfg, str(tmp_path), verbose=False)
    rt.hosts = [1, 1, 1]

    def report(m, step, events=(), done=False):
        out = {"steps": [], "events": list(events), "evals": [], "rows": [], "step": step,
               "done": done, "incarnation": 0, "finished_at": 9.0}  # fmt: skip
        rt._learner_report(m, out)

    for p, step in [(0, 16), (1, 24)]:
        rt.log.record({"event": "merge", "fragment": p, "version": 1, "learners": [1],
                       "c_steps": [8], "steps": [step], "share": 1.0, "time": 1.0})  # fmt: skip
    report(1, 8, [{"event": "rejoin", "learner": 1, "step": 8, "incarnation": 1, "time": 0.5}])
    report(1, 25)
    rt._seen_pid(("learner", 1, 0), 100, "n0")
    rt._seen_pid(("learner", 1, 0), 200, "n0")  # a new process: the old one died at 25
    report(1, 20)  # (the new one restored its checkpoint)
    assert rt.ledger.crash_lost_steps == 0
    report(1, 20, done=True)  # out of its membership: it never rejoins
    gone = [e for e in _read(tmp_path / "events.jsonl") if e["event"] == "learner_gone"]
    assert [(e["learner"], e["step"], e["life_start"]) for e in gone] == [(1, 25, 8)]
    assert rt.ledger.crash_lost_steps == 9
    # Learner 2: started at 0, reported step 6, then Ray could not restart it.
    report(2, 0, [{"event": "learner_start", "learner": 2, "step": 0, "incarnation": 0,
                   "time": 0.1}])  # fmt: skip
    report(2, 6)
    rt._remove(2, stopped=False, error="ActorDiedError")
    rt._remove(2, stopped=False, error="ActorDiedError")  # (once)
    gone = [e for e in _read(tmp_path / "events.jsonl") if e["event"] == "learner_gone"]
    assert [(e["learner"], e["step"], e["life_start"]) for e in gone][1:] == [(2, 6, 0)]
    assert rt.ledger.crash_lost_steps == 9 + 6
    # Learner 0 left gracefully, then its process died: nothing of it is lost.
    report(0, 0, [{"event": "learner_start", "learner": 0, "step": 0, "incarnation": 0,
                   "time": 0.1}, {"event": "learner_leave", "learner": 0, "step": 12,
                   "incarnation": 0, "time": 2.0}])  # fmt: skip
    rt._seen_pid(("learner", 0, 0), 300, "n0")
    rt._seen_pid(("learner", 0, 0), 301, "n0")
    report(0, 12, done=True)
    assert len([e for e in _read(tmp_path / "events.jsonl") if e["event"] == "learner_gone"]) == 2
    # Learner 2 of a fresh driver finished, then its process died and was restarted (a
    # preemption while others train), or could not be: a finished learner lost nothing.
    rt = RayRuntime(cfg, str(tmp_path / "done"), verbose=False)
    rt.hosts = [1, 1, 1]
    report(2, 0, [{"event": "learner_start", "learner": 2, "step": 0, "incarnation": 0,
                   "time": 0.1}])  # fmt: skip
    rt._seen_pid(("learner", 2, 0), 100, "n0")
    report(2, 24, [{"event": "learner_done", "learner": 2, "step": 24, "time": 5.0}], done=True)
    rt._seen_pid(("learner", 2, 0), 200, "n0")
    report(2, 24, done=True)
    rt._remove(2, stopped=False, error="ActorDiedError")
    events = _read(tmp_path / "done" / "events.jsonl")
    assert not [e for e in events if e["event"] == "learner_gone"]
    assert rt.ledger.crash_lost_steps == 0


def test_a_syncer_checkpoint_commits_once_the_driver_took_the_records_of_its_merges(
    monkeypatch,
):
    """Records the driver has not polled die with a killed syncer process; a checkpoint
    committed meanwhile held their merges, so the restored Θ held merges merges.jsonl and
    the work accounting never knew. The commit now waits for the poll (not at the end, and
    not forever)."""
    from decoupled_diloco.runtime.ray import syncer as ray_syncer

    class Loop:
        @staticmethod
        def traffic():
            return {}

    class Context:
        @staticmethod
        def get_node_id():
            return "n0"

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    actor = ray_syncer.SyncerActor.__new__(ray_syncer.SyncerActor)
    actor.shard, actor.fatal, actor.loop = 0, None, Loop()
    actor._records, actor._records_lock, actor._made, actor._taken = [], threading.Lock(), 0, 0
    actor._stop = threading.Event()
    actor._record({"event": "merge", "version": 1})
    committed = threading.Event()
    saver = threading.Thread(target=lambda: (actor._delivered(), committed.set()))
    saver.start()
    assert not committed.wait(0.3)  # the merge's record is not the driver's yet
    assert [r["version"] for r in actor.poll()["records"]] == [1]
    assert committed.wait(5.0)
    saver.join()
    actor._record({"event": "merge", "version": 2})
    monkeypatch.setattr(ray_syncer, "DELIVERY_WAIT_S", 0.2)
    t0 = time.monotonic()
    actor._delivered()  # no poll comes: it gives up (and says so) instead of never saving
    assert 0.2 <= time.monotonic() - t0 < 5.0
    actor._stop.set()
    t0 = time.monotonic()
    actor._delivered()  # the end of the run: `finish` hands the records over itself
    assert time.monotonic() - t0 < 0.1


def test_ray_config_keys_are_validated(small_config):
    with pytest.raises(ValueError, match="ray.accelerator"):
        config_lib.validate(_ray_config(small_config, **{"ray.accelerator": "gpu"}))
    with pytest.raises(ValueError, match="ray.evaluate"):
        RayConfig(evaluate="syncer").validate()
    for path in ("", "runs/ckpt"):  # a TPU run's actors write on many hosts: a shared path
        with pytest.raises(ValueError, match="ray.checkpoint_dir"):
            RayConfig(accelerator="tpu", checkpoint_dir=path).validate()
    RayConfig(accelerator="tpu", checkpoint_dir="gs://b/run").validate()
    with pytest.raises(ValueError, match="diloco.sync_every"):
        config_lib.validate(_ray_config(small_config, **{"diloco.sync_every": 0}))


# --- a cluster of its own ------------------------------------------------------------------
_OWN_CLUSTER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from conftest import _small_config  # 8 fake CPU devices, like the test session
import ray
from decoupled_diloco import config as config_lib
from decoupled_diloco.runtime.ray.runtime import RayRuntime

assert not ray.is_initialized()
over = json.loads(sys.argv[3])
cfg = config_lib.validate(_small_config(**over))
summary = RayRuntime(cfg, sys.argv[2], verbose=False).run()
print(json.dumps({"steps": summary["steps"], "connected_after": ray.is_initialized()}))
"""


def _processes_mentioning(text: str) -> list[str]:
    out = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(cmd[:200])
    return out


def test_runtime_starts_and_stops_its_own_local_cluster(tmp_path):
    """No fixture cluster: with ray.address = "" the runtime starts a local cluster (in its own
    temp dir), runs, and shuts every process of it down again. In a fresh interpreter, so
    that no test session's cluster is connected."""
    temp_dir = f"/tmp/ray_dd_own{os.getpid()}"  # short: Ray's socket paths are limited
    over = {
        "runtime": "ray",
        "diloco.learners": 2,
        "diloco.sync_every": 4,
        "diloco.fragments": 2,
        "train.steps": 8,
        "ray.address": "",
        "ray.num_cpus": 2,
        "ray.temp_dir": temp_dir,
        "ray.poll_seconds": 0.25,
    }
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    args = [sys.executable, "-c", _OWN_CLUSTER, tests_dir, str(tmp_path), json.dumps(over)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"steps": 8, "connected_after": False}
    assert _read(tmp_path / "merges.jsonl")
    assert os.path.isdir(temp_dir)  # the session was there ...
    deadline = time.monotonic() + 20
    while _processes_mentioning(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _processes_mentioning(temp_dir)  # ... and none of its processes is left
    shutil.rmtree(temp_dir, ignore_errors=True)


# --- same results as in process -----------------------------------------------------------
def test_deterministic_k_equals_m_run_matches_the_local_runtime(cluster, small_config, tmp_path):
    over = {
        "diloco.quorum": 3,
        "diloco.max_wait": -1.0,  # learners wait for every merge: lockstep, deterministic
        "diloco.overlap": 0,
        "diloco.grace_gamma": 0.0,
        "diloco.weights": "uniform",
        "diloco.merge": "mean",
        "diloco.embedding_merge": "mean",
        # The final Θ is evaluated by learner 0 on its devices (2, like the local runtime's
        # evaluator mesh): the same loss as in process is the check of that path.
        "ray.evaluate": "learner",
    }
    cfg = _ray_config(small_config, **over)
    on_ray = RayRuntime(config_lib.validate(cfg), str(tmp_path / "ray"), verbose=False).run()
    cfg.runtime = "local"
    local = LocalRuntime(config_lib.validate(cfg), str(tmp_path / "local"), verbose=False).run()

    def sequence(workdir):
        return [
            (r["fragment"], r["version"], r["learners"]) for r in _read(workdir / "merges.jsonl")
        ]

    merges = sequence(tmp_path / "ray")
    assert len(merges) >= 2 * STEPS // 4  # every fragment every H steps, plus the final sync
    assert all(learners == [0, 1, 2] for _, _, learners in merges)
    assert merges == sequence(tmp_path / "local")
    assert set(on_ray) == set(local)
    assert on_ray["steps"] == local["steps"] == STEPS
    assert abs(on_ray["final_eval_loss"] - local["final_eval_loss"]) < 1e-4
    rows = [r for r in _read(tmp_path / "ray" / "metrics.jsonl") if r["learner"] != "global"]
    assert {(r["learner"], r["step"]) for r in rows} == {
        (m, s) for m in range(3) for s in range(1, STEPS + 1)
    }


# --- fault domains --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chaos_run(cluster, tmp_path_factory):
    """K=1 run (steps slowed by sleeping) in which learner 2 is killed by the fault schedule
    at CRASH_AT, learner 1 by SIGKILL at its step 6, the syncer by SIGKILL after merges went on
    without learner 1. Learner 0 waits at step 10 until learner 1 is killed: it still has
    steps to offer while learner 1 restarts (it might have finished by then), and they are
    ahead of learner 1's, so each opens a round at once (an offer behind the last merged
    round waits for the next). It runs at full speed: an emulated slow chip would stretch the
    held step by its factor, and sleep through the restart."""
    from conftest import _small_config

    workdir = tmp_path_factory.mktemp("chaos")
    cfg = _ray_config(
        _small_config,
        **{
            "diloco.quorum": 1,
            "diloco.overlap": 1,
            "diloco.grace_gamma": 0.0,
            "train.checkpoint_every": 4,
            "diloco.syncer_checkpoint_seconds": 1.0,
            "diloco.syncer_checkpoint_duty": 1.0,  # checkpoints as often as that, when loaded
            "faults.speed_factors": [1.0, 3.0, 8.0],
            # A learner that finished before the syncer kill, its Leave lost with the syncer,
            # holds up the last learner's final sync this long (default 30 s).
            "diloco.confirm_timeout": 5.0,
            "faults.crashes": [[2, CRASH_AT]],
            "faults.restart_delay_s": 1.0,
        },
    )
    runtime = RayRuntime(config_lib.validate(cfg), str(workdir), verbose=False)
    thread, out = _start(runtime)
    kills: dict = {}
    events_path, rows_path = workdir / "events.jsonl", workdir / "metrics.jsonl"
    release = str(workdir / "release")
    while thread.is_alive():
        thread.join(0.2)
        events = _read(events_path)
        if not events:
            continue
        t = time.time() - events[0]["wall_t0"]  # the run's clock
        if "hold" not in kills:
            if any(e["event"] == "learner_start" and e["learner"] == 0 for e in events):
                try:
                    _call_in_actor(events[0]["run_id"], 0, _hold(), 10, release)
                    kills["hold"] = t
                except ray.exceptions.RayError:
                    pass  # not up yet: try again
        elif "learner" not in kills:
            steps = [r["step"] for r in _read(rows_path) if r["learner"] == 1]
            starts = [e for e in events if e["event"] == "learner_start" and e["learner"] == 1]
            if steps and max(steps) >= 6 and starts:
                os.kill(starts[0]["pid"], signal.SIGKILL)
                kills["learner"], kills["seen_step"] = t, max(steps)
                open(release, "w").close()
        elif "syncer" not in kills:
            merges = _read(workdir / "merges.jsonl")
            after = [r for r in merges if r["time"] > kills["learner"] + 1.0]
            ckpt = workdir / "checkpoints" / "syncer_0"
            saved = ckpt.is_dir() and any((ckpt / d / "manifest.json").exists()
                                          for d in os.listdir(ckpt))  # fmt: skip
            if len(after) >= 3 and saved:
                start = [e for e in events if e["event"] == "syncer_start"][-1]
                os.kill(start["pid"], signal.SIGKILL)
                kills["syncer"] = t
    if "error" in out:
        raise out["error"]
    assert {"hold", "learner", "syncer"} <= set(kills), kills
    return workdir, out["summary"], kills


def _events(workdir, kind, **match):
    return [
        e
        for e in _read(workdir / "events.jsonl")
        if e["event"] == kind and all(e.get(k) == v for k, v in match.items())
    ]


def test_sigkilled_learner_rejoins_while_merges_keep_flowing(chaos_run):
    workdir, summary, kills = chaos_run
    (rejoin,) = [e for e in _events(workdir, "rejoin", learner=1) if e["time"] > kills["learner"]]
    assert rejoin["process_restart"] and rejoin["incarnation"] >= 1
    merges = _read(workdir / "merges.jsonl")
    # Resumed its data shard from its last checkpoint (every 4 steps; step 4's was written
    # before step 6 ran), not from the start, then skipped ahead to the newest step of its
    # first life that Θ holds (an offer merged after the checkpoint), if any (resume_cut).
    cuts = [e for e in _events(workdir, "resume_cut", learner=1) if e["time"] > kills["learner"]]
    resumed = rejoin["step"] - sum(e["skipped_steps"] for e in cuts)
    assert resumed % 4 == 0 and 4 <= resumed <= kills["seen_step"] + 4
    held = [s for r in merges if r["time"] < rejoin["time"]
            for m, inc, s in zip(r["learners"], r["incarnations"], r["steps"], strict=True)
            if (m, inc) == (1, 0)]  # fmt: skip
    assert rejoin["step"] == max([resumed, *held])
    # Merges go on while it is down: learner 0's offers merge without waiting for it. Its
    # offers from before it died may ride along (a late offer waits for the next round),
    # but nothing of a later incarnation can. (Ray restarts it within a few seconds.)
    meanwhile = [r for r in merges if kills["learner"] < r["time"] < rejoin["time"]]
    assert [r for r in meanwhile if 0 in r["learners"]], (kills, rejoin)
    for r in meanwhile:
        for m, inc in zip(r["learners"], r["incarnations"], strict=True):
            assert m != 1 or inc < rejoin["incarnation"], r
    assert any(1 in r["learners"] for r in merges if r["time"] > rejoin["time"])
    assert _events(workdir, "learner_done", learner=1, step=STEPS)
    assert summary["steps"] == STEPS and summary["restarts"] >= 3


def test_syncer_killed_mid_run_recovers_from_its_checkpoint(chaos_run):
    workdir, summary, kills = chaos_run
    (restore,) = _events(workdir, "syncer_restore")
    assert restore["time"] > kills["syncer"]
    assert sum(restore["versions"].values()) > 0  # Θ of a checkpoint, not Θ_0
    assert _events(workdir, "syncer_start", process_restart=True)
    merges = _read(workdir / "merges.jsonl")
    after = [r for r in merges if r["time"] > restore["time"]]
    assert len(after) >= 2
    # The records a process has not yet handed to the driver's poll die with it, but no
    # checkpoint holds their merges (it commits once the driver took them): merges.jsonl
    # has every merge the restored Θ holds.
    for p, version in restore["versions"].items():
        later = [r["version"] for r in after if r["fragment"] == int(p)]
        assert not later or min(later) == version + 1  # continues from the checkpoint
        before = {r["version"] for r in merges if r["fragment"] == int(p) and r not in after}
        assert set(range(1, version + 1)) <= before, (p, version, sorted(before))
    for m in range(3):
        assert _events(workdir, "learner_done", learner=m, step=STEPS)
    assert np.isfinite(summary["final_eval_loss"])
    # The traffic of the killed process counts too (each process counts its own).
    recorded = sum(r["bytes_in"] + r["bytes_out"] for r in merges)
    assert summary["bytes_communicated"] >= recorded > 0


def test_fault_schedule_crash_kills_a_real_learner_process(chaos_run):
    workdir, summary, _ = chaos_run
    (down,) = _events(workdir, "learner_down", learner=2)
    assert down["time"] == CRASH_AT
    (rejoin,) = _events(workdir, "rejoin", learner=2)
    assert rejoin["process_restart"] and rejoin["time"] > CRASH_AT
    assert rejoin["pid"] != down["pid"]  # a new process (down["pid"] None: killed starting up)
    assert _events(workdir, "learner_done", learner=2, step=STEPS)
    assert summary["failures"] >= 3


def _hold():
    """hold(learner_actor, step, release): the learner takes no step past `step` until the
    file `release` exists. Made in here so that cloudpickle sends it by value (actors cannot
    import tests/)."""

    def hold(learner_actor, step: int, release: str) -> None:
        import os
        import time

        inner = learner_actor.loop.replica.step

        def held_step(batch):
            while learner_actor.loop.step >= step and not os.path.exists(release):
                time.sleep(0.05)
            return inner(batch)

        learner_actor.loop.replica.step = held_step

    return hold


def _call_in_actor(run_id: str, m: int, fn, *args) -> None:
    """Runs fn(learner_actor, *args) inside learner m's current process (Ray's __ray_call__)."""
    actor = ray.get_actor(ray_links.actor_name(run_id, "learner", m))
    ray.get(actor.__ray_call__.remote(fn, *args), timeout=30)


def test_raising_learner_restarts_then_is_lost_when_its_restarts_run_out(
    cluster, small_config, tmp_path
):
    """Learner 1 raises in a train step (no SIGKILL): its process exits, Ray restarts it
    (ray.max_restarts = 1) and it rejoins. It raises again: its restarts are exhausted, it is
    reported lost, and the run goes on with learner 0 (held at step 6 until then), which
    also evaluates Θ on its own devices (ray.evaluate = "learner")."""

    # Defined in here so that cloudpickle sends them by value (actors cannot import tests/).
    def fail(learner_actor) -> None:
        def boom(batch):
            raise RuntimeError("injected learner failure")

        learner_actor.loop.replica.step = boom

    cfg = _ray_config(
        small_config,
        **{
            "diloco.learners": 2,
            "diloco.quorum": 1,
            "diloco.overlap": 1,
            "diloco.grace_gamma": 0.0,
            "train.checkpoint_every": 4,
            "train.eval_every": 8,
            "faults.speed_factors": [1.0, 8.0],  # learner 1 is still training when hit again
            "ray.max_restarts": 1,
            "ray.evaluate": "learner",
        },
    )
    release = str(tmp_path / "release")
    runtime = RayRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False)
    thread, out = _start(runtime)
    done: list[str] = []
    while thread.is_alive():
        thread.join(0.2)
        events = _read(tmp_path / "events.jsonl")
        if not events:
            continue
        run_id = events[0]["run_id"]
        seen = {(e["event"], e.get("learner"), e.get("process_restart")) for e in events}
        steps = [r["step"] for r in _read(tmp_path / "metrics.jsonl") if r["learner"] == 1]
        try:
            if "hold" not in done and ("learner_start", 0, False) in seen:
                _call_in_actor(run_id, 0, _hold(), 6, release)
                done.append("hold")
            elif "fail1" not in done and steps and max(steps) >= 5:
                _call_in_actor(run_id, 1, fail)
                done.append("fail1")
            elif "fail2" not in done and ("rejoin", 1, True) in seen:
                _call_in_actor(run_id, 1, fail)
                done.append("fail2")
            elif "release" not in done and ("learner_lost", 1, None) in seen:
                open(release, "w").close()
                done.append("release")
        except ray.exceptions.RayError:
            pass  # that process is going down or not up yet: try again
    if "error" in out:
        raise out["error"]
    assert done == ["hold", "fail1", "fail2", "release"]

    errors = _events(tmp_path, "learner_error", learner=1)
    assert len(errors) == 2 and all("injected learner failure" in e["error"] for e in errors)
    (rejoin,) = _events(tmp_path, "rejoin", learner=1)
    assert rejoin["process_restart"] and rejoin["incarnation"] >= 1
    assert errors[0]["time"] < rejoin["time"] < errors[1]["time"]
    (lost,) = _events(tmp_path, "learner_lost", learner=1)
    assert lost["time"] > errors[1]["time"] and "injected learner failure" in lost["error"]
    # It left the syncer's membership each time (no round waits for it, the roster drops
    # it), not only after diloco.heartbeat_timeout (300 s) of silence: its first life as
    # soon as Ray restarted its process (which announced it, before its start-up and join;
    # no schedule said it died), its second once lost.
    first, left = _events(tmp_path, "leave", learner=1)
    assert errors[0]["time"] < first["time"] < rejoin["time"] and not first["finished"]
    (join,) = [e for e in _events(tmp_path, "join", learner=1) if e["incarnation"] > 0]
    assert first["time"] < join["time"]
    assert not left["finished"] and left["time"] >= errors[1]["time"]
    assert not _events(tmp_path, "learner_done", learner=1)
    assert _events(tmp_path, "learner_done", learner=0, step=STEPS)
    merges = _read(tmp_path / "merges.jsonl")
    # Merges go on with learner 0 (an offer learner 1 made before it died may still ride
    # along with one of them).
    after = [r for r in merges if r["time"] > lost["time"]]
    assert all(0 in r["learners"] for r in after) and [0] in [r["learners"] for r in after]
    summary = out["summary"]
    assert summary["steps"] == STEPS and summary["failures"] >= 2
    evals = [r for r in _read(tmp_path / "metrics.jsonl") if r["learner"] == "global"]
    assert evals and all(math.isfinite(r["eval_loss"]) for r in evals)
    assert math.isfinite(summary["final_eval_loss"])


def _missing_package_learner(failing: tuple[int, ...]):
    """A learner actor class whose learners `failing` raise the same ImportError in every
    process (a TPU host without a package); defined here so cloudpickle sends it by value."""
    from decoupled_diloco.runtime.ray.learner import LearnerActor

    class MissingPackage(LearnerActor):
        def _setup(self):
            if self.m in failing:
                raise ModuleNotFoundError("No module named 'sentencepiece'")
            super()._setup()

    return MissingPackage


def test_learner_failing_the_same_way_is_stopped_not_restarted_forever(
    cluster, small_config, tmp_path, monkeypatch
):
    """Unlimited restarts (the TPU configs' setting) and learner 1 raising the same error in
    every process: after ray.max_same_failures = 2 it is stopped, reported once, and the run
    finishes with learner 0."""
    from decoupled_diloco.runtime.ray import runtime as ray_runtime

    monkeypatch.setattr(ray_runtime, "LearnerActor", _missing_package_learner((1,)))
    over = {"diloco.learners": 2, "diloco.quorum": 1, "ray.max_restarts": -1}
    cfg = _ray_config(small_config, **over, **{"ray.max_same_failures": 2})
    summary = RayRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False).run()
    errors = _events(tmp_path, "learner_error", learner=1)
    assert len(errors) == 2 and all("sentencepiece" in e["error"] for e in errors)
    (stopped,) = _events(tmp_path, "learner_stopped", learner=1)
    assert stopped["failures"] == 2 and stopped["time"] >= errors[1]["time"]
    assert stopped["error"] == "ModuleNotFoundError: No module named 'sentencepiece'"
    assert not _events(tmp_path, "learner_lost") and not _events(tmp_path, "rejoin", learner=1)
    assert _events(tmp_path, "learner_done", learner=0, step=STEPS)
    assert summary["steps"] == STEPS and math.isfinite(summary["final_eval_loss"])


def test_run_fails_when_every_learner_is_stopped(cluster, small_config, tmp_path, monkeypatch):
    from decoupled_diloco.runtime.ray import runtime as ray_runtime

    monkeypatch.setattr(ray_runtime, "LearnerActor", _missing_package_learner((0, 1)))
    over = {"diloco.learners": 2, "ray.max_restarts": -1, "ray.max_same_failures": 1}
    runtime = RayRuntime(config_lib.validate(_ray_config(small_config, **over)), str(tmp_path))
    with pytest.raises(RuntimeError, match="every learner is out for good.*max_same_failures=1"):
        runtime.run()
    assert {e["learner"] for e in _events(tmp_path, "learner_stopped")} == {0, 1}


def _syncer_failing_after_a_merge():
    """A syncer actor class whose serving loop raises once its shard has merged (in every
    process); defined here so that cloudpickle sends it by value."""
    from decoupled_diloco.runtime.ray.syncer import SyncerActor

    class FailingSyncer(SyncerActor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            loop, serve_turn = self.loop, self.loop.serve_turn

            def failing_turn(*a, **kw):
                if loop.syncer is not None and loop.syncer.stats.get("merges", 0) >= 1:
                    raise RuntimeError("injected syncer failure")
                return serve_turn(*a, **kw)

            loop.serve_turn = failing_turn

    return FailingSyncer


def test_run_fails_at_once_with_the_shards_error_when_a_syncer_is_lost_for_good(
    cluster, small_config, tmp_path, monkeypatch
):
    """The syncer shard raises after its first merge and has no restart left: the run stops
    then, with the shard's error, not when the learners have trained on without merges to
    the end and waited out their final syncs (and then with Ray's ActorDiedError)."""
    from decoupled_diloco.runtime.ray import runtime as ray_runtime

    monkeypatch.setattr(ray_runtime, "SyncerActor", _syncer_failing_after_a_merge())
    over = {"diloco.learners": 2, "diloco.quorum": 1, "ray.max_restarts": 0}
    runtime = RayRuntime(config_lib.validate(_ray_config(small_config, **over)), str(tmp_path))
    with pytest.raises(RuntimeError, match=r"syncer shard 0 is lost for good \(ray.max_restarts=0"
                       r".*last error: RuntimeError: injected syncer failure"):  # fmt: skip
        runtime.run()
    (error,) = _events(tmp_path, "syncer_error", shard=0)
    assert "injected syncer failure" in error["error"]
    assert not _events(tmp_path, "final_sync_unconfirmed")  # no learner waited for it


def _syncer_failing_to_start():
    """A syncer actor class whose constructor raises (say, on a checkpoint it cannot restore);
    defined here so that cloudpickle sends it by value."""
    from decoupled_diloco.runtime.ray.syncer import SyncerActor

    class UnstartableSyncer(SyncerActor):
        def __init__(self, *args, **kwargs):
            raise ValueError("injected: syncer checkpoint unreadable")

    return UnstartableSyncer


def test_run_fails_at_once_with_the_error_of_a_syncer_that_cannot_start(
    cluster, small_config, tmp_path, monkeypatch
):
    """Ray restarts no actor whose constructor raised: the run stops at the driver's first
    poll with the constructor's error, not after the learners' joins time out
    (diloco.join_timeout, again in every restarted process), nor with Ray's wrapped message."""
    from decoupled_diloco.runtime.ray import runtime as ray_runtime

    monkeypatch.setattr(ray_runtime, "SyncerActor", _syncer_failing_to_start())
    over = {"diloco.learners": 2, "diloco.join_timeout": 120.0}
    runtime = RayRuntime(config_lib.validate(_ray_config(small_config, **over)), str(tmp_path))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"syncer shard 0 failed to start \(ValueError: "
                       r"injected: syncer checkpoint unreadable\)"):  # fmt: skip
        runtime.run()
    assert time.monotonic() - start < 100.0  # (the learners' joins would time out at 120 s)


def _syncer_always_failing():
    """A syncer actor class whose serving loop raises at once in every process; defined here
    so that cloudpickle sends it by value."""
    from decoupled_diloco.runtime.ray.syncer import SyncerActor

    class AlwaysFailing(SyncerActor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

            def failing_turn(*a, **kw):
                raise RuntimeError("injected syncer failure")

            self.loop.serve_turn = failing_turn

    return AlwaysFailing


def test_run_fails_when_a_syncer_shard_fails_the_same_way_in_every_life(
    cluster, small_config, tmp_path, monkeypatch
):
    """Unlimited restarts (the TPU configs' setting) and a shard raising the same error in
    every process, merging nothing: after ray.max_same_failures = 2 the run fails with the
    error, instead of Ray restarting the shard for as long as the learners train apart."""
    from decoupled_diloco.runtime.ray import runtime as ray_runtime

    monkeypatch.setattr(ray_runtime, "SyncerActor", _syncer_always_failing())
    over = {"diloco.learners": 2, "diloco.join_timeout": 60.0, "ray.max_restarts": -1,
            "ray.max_same_failures": 2}  # fmt: skip
    runtime = RayRuntime(config_lib.validate(_ray_config(small_config, **over)), str(tmp_path))
    why = r"syncer shard 0 failed 2 times in a row .*max_same_failures=2.*injected syncer failure"
    with pytest.raises(RuntimeError, match=why):
        runtime.run()
    assert len(_events(tmp_path, "syncer_error", shard=0)) == 2
    assert not _events(tmp_path, "learner_error")  # (no join waited out its timeout)


# --- offer validation across the process boundary -------------------------------------------
@ray.remote(num_cpus=0)
class _Inbox:
    """Stands in for a learner actor: keeps what the syncer delivers."""

    def __init__(self):
        self.msgs = []

    def deliver(self, msg):
        self.msgs.append(msg)

    def take(self):
        out, self.msgs = self.msgs, []
        return out

    def peek(self):
        return list(self.msgs)


def test_bad_offers_are_rejected_as_in_process(cluster, small_config, tmp_path):
    from decoupled_diloco.runtime.ray.syncer import SyncerActor, initial_params

    run = config_lib.validate(
        _ray_config(
            small_config,
            **{"diloco.learners": 2, "diloco.quorum": 1, "diloco.max_staleness": 1},
        )
    )
    run_id = f"test{os.getpid()}"
    inboxes = [
        _Inbox.options(name=ray_links.actor_name(run_id, "learner", m)).remote() for m in range(2)
    ]
    opts = ray_cluster.syncer_options({}, 1, 0)
    actor = ray.remote(SyncerActor).options(name=ray_links.actor_name(run_id, "syncer", 0), **opts)
    syncer_actor = actor.remote(0, run, str(tmp_path), run_id, time.time())

    plan = model_plan(run.model, run.diloco)
    log: list[dict] = []
    theta0 = initial_params(run)
    # The actor's syncer is bounded by the run's config (syncer_loop.py): so is this one.
    bounds = RunBounds(run.train.batch_size * run.data.seq_len, run.train.steps)
    local = Syncer(run.diloco, plan, theta0, record=log.append, bounds=bounds)

    rng = np.random.default_rng(0)

    def grad(p, dtype=np.float32, scale=1e-3):
        return {
            k: (scale * rng.standard_normal(theta0[k].shape)).astype(dtype) for k in plan.names[p]
        }

    steps = iter(range(4, run.train.steps + 1, 4))
    # The actor's syncer is a new life with an epoch of its own (the local one's is 0): learn
    # it from the Snapshot a Join brings, as a learner does, and give the local one the same.
    for msg in (Join(0, 0, 0.0), Join(1, 0, 0.0)):
        local.handle(msg, 0.0)
        ray.get(syncer_actor.post.remote(msg))
    deadline = time.monotonic() + 60
    snapshots: list = []
    while not snapshots and time.monotonic() < deadline:
        snapshots = [m for m in ray.get(inboxes[0].peek.remote()) if hasattr(m, "epoch")]
        time.sleep(0.1)
    local.epoch = epoch = snapshots[0].epoch

    def offer(p, payload, learner=0, base=0, incarnation=0, bad=False):
        # Each good offer at a step of the next schedule slot (H = 4), so each can open a
        # round (as in tests/test_offer_validation.py's harness); bad ones at step 4 (a
        # step far ahead of what its learner reported would be rejected for that).
        enc = (
            payload
            if isinstance(payload, compression.Encoded)
            else compression.encode(payload, "none")
        )
        step = 4 if bad else next(steps)
        return Offer(
            learner, incarnation, p, step, 4, 256, base, 0.0, enc, enc.nbytes(), epoch=epoch
        )

    good = compression.encode(grad(1), "none")
    nan = grad(1)
    nan[plan.names[1][0]][0] = np.nan
    wrong_shape = grad(1)
    wrong_shape[plan.names[1][0]] = np.zeros((3, 3), np.float32)
    msgs = [
        offer(1, nan, bad=True),
        offer(1, wrong_shape, bad=True),
        offer(1, compression.Encoded("none", dict([next(iter(good.tensors.items()))])), bad=True),
        offer(1, grad(1), learner=5, bad=True),
        offer(1, grad(1), incarnation=3, bad=True),
        offer(1, grad(1), base=7, bad=True),
        offer(1, grad(1)),  # good: version 1
        offer(1, grad(1), learner=1, base=1),  # good: version 2
        offer(1, grad(1), base=0),  # good: base 0 is 2 versions old, max_staleness 1 -> stale
        Heartbeat(0, 0, 4, 0.1, 0.0),
        offer(0, grad(0)),  # good
    ]
    for msg in msgs:
        local.handle(msg, 0.0)
        ray.get(syncer_actor.post.remote(msg))
        # One message per batch, as `local` handles them: the actor's loop handles what it
        # takes as one batch, rounds closing after it (Syncer.handle_batch).
        deadline = time.monotonic() + 60
        while ray.get(syncer_actor.queued.remote()) and time.monotonic() < deadline:
            time.sleep(0.01)
    deadline = time.monotonic() + 60
    records = []
    while time.monotonic() < deadline:
        records += ray.get(syncer_actor.poll.remote())["records"]
        if sum(r["event"] == "merge" for r in records) >= 3:
            break
        time.sleep(0.2)

    def rejects(recs):
        return [(r["learner"], r["fragment"], r["reason"]) for r in recs if r["event"] == "reject"]

    assert len(rejects(log)) == 7
    assert rejects(records) == rejects(log)
    assert [r["version"] for r in records if r["event"] == "merge"] == [1, 2, 1]
    remote = ray.get(syncer_actor.global_params.remote())
    for k, v in local.global_params().items():
        np.testing.assert_array_equal(remote[k], v)
    # Replies crossed as numpy: each learner got its Snapshot and the merges it lived for.
    got = ray.get(inboxes[0].take.remote())
    assert type(got[0]).__name__ == "Snapshot"
    assert all(isinstance(v, np.ndarray) for v in got[0].params.values())
    for h in [syncer_actor, *inboxes]:
        ray.kill(h)


def test_a_cluster_short_of_slices_leaves_no_run_in_the_workdir(cluster, small_config, tmp_path):
    """A TPU run on a cluster without the slices fails before its workdir records a run:
    the next start there, with another config or corpus, is a new run, not a refused one."""
    over = {
        "ray.accelerator": "tpu",
        "ray.checkpoint_dir": str(tmp_path / "ck"),
        "devices_per_learner": 4,
    }  # (a slice's chips: 0 is refused for TPU runs)
    run = config_lib.validate(_ray_config(small_config, **over))
    with pytest.raises(ValueError, match="the Ray cluster has 0 TPU slices"):
        RayRuntime(run, str(tmp_path / "run"), verbose=False).run()
    assert not (tmp_path / "run" / run_files.RUN_CONFIG).exists()
    # A corpus record of such a start binds nothing either.
    (tmp_path / "run" / run_files.CORPUS).write_text('{"train": {"sha256": "0", "documents": 1}}')
    assert run_files.check_corpus(str(tmp_path / "run"), run.data, force=False) == []
