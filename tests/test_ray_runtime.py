"""The Ray runtime on a local Ray cluster: learners and the syncer as separate processes.

One cluster serves the module (the runtime reuses a connected driver). Every learner
process has its own 2 fake CPU devices; runs use the same model, batch and step count so
the persistent compilation cache serves all of them after the first.
"""

import json
import os
import signal
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from decoupled_diloco import config as config_lib  # noqa: E402
from decoupled_diloco.diloco import compression  # noqa: E402
from decoupled_diloco.diloco.messages import Heartbeat, Join, Offer  # noqa: E402
from decoupled_diloco.runtime import ray_cluster, ray_links, syncer_host  # noqa: E402
from decoupled_diloco.runtime.local import LocalRuntime  # noqa: E402
from decoupled_diloco.runtime.ray_runtime import RayRuntime  # noqa: E402

pytestmark = pytest.mark.ray

STEPS = 24  # the same in every run: one compiled train step for the whole module
CRASH_AT = 10.0  # s: the fault schedule kills learner 2 (usually mid-training, else starting)
# Learner 2 runs 5x slower than its measured step time so that it is still training at
# CRASH_AT on a fast machine too (a crash after a learner finished is not applied).


@pytest.fixture(scope="module")
def cluster():
    started = ray_cluster.connect(ray_cluster.RayConfig(num_cpus=2), verbose=False)
    yield
    if started:
        ray.shutdown()


def _read(path) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


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
def test_tpu_slices_are_found_from_node_resources():
    def node(slice_id, head=False):
        res = {"CPU": 8.0, "TPU": 4.0, slice_id: 1.0, "node:10.0.0.1": 1.0}
        if head:
            res["TPU-v5p-16-head"] = 1.0
        return {"Alive": True, "Resources": res, "NodeManagerAddress": "10.0.0.1"}

    head_vm = {"Alive": True, "Resources": {"CPU": 32.0, "syncer": 1.0}}
    nodes = [head_vm, node("dd-1", True), node("dd-1"), node("dd-0", True), node("dd-0")]
    slices = ray_cluster.tpu_slices(nodes)
    assert slices == {"dd-0": {"hosts": 2, "chips": 4}, "dd-1": {"hosts": 2, "chips": 4}}
    hosts = ray_cluster.learner_hosts(slices, 2)
    assert [h["slice"] for h in hosts] == ["dd-0", "dd-1"]
    opts = ray_cluster.learner_options("tpu", 8, 3, hosts[1])
    assert opts["resources"] == {"TPU": 4, "dd-1": 1} and opts["max_restarts"] == 3
    with pytest.raises(ValueError, match="diloco.learners=3"):
        ray_cluster.learner_hosts(slices, 3)
    assert ray_cluster.syncer_options({"syncer": 1.0}, 2, 3)["resources"] == {"syncer": 0.5}
    assert "resources" not in ray_cluster.syncer_options({"CPU": 2.0}, 1, 3)
    env = ray_cluster.learner_options("cpu", 2, 3)["runtime_env"]["env_vars"]
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


def test_ray_config_keys_are_validated(small_config):
    with pytest.raises(ValueError, match="ray.accelerator"):
        config_lib.validate(_ray_config(small_config, **{"ray.accelerator": "gpu"}))
    with pytest.raises(ValueError, match="diloco.sync_every"):
        config_lib.validate(_ray_config(small_config, **{"diloco.sync_every": 0}))


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
    """K=1 run (steps slowed 3x by sleeping) in which learner 2 is killed by the fault
    schedule at CRASH_AT, learner 1 by SIGKILL at its step 6, the syncer by SIGKILL after merges
    went on without learner 1."""
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
            "faults.speed_factors": [3.0, 3.0, 5.0],
            "faults.crashes": [[2, CRASH_AT]],
            "faults.restart_delay_s": 1.0,
        },
    )
    runtime = RayRuntime(config_lib.validate(cfg), str(workdir), verbose=False)
    out: dict = {}

    def go():
        try:
            out["summary"] = runtime.run()
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=go)
    thread.start()
    kills: dict = {}
    events_path, rows_path = workdir / "events.jsonl", workdir / "metrics.jsonl"
    while thread.is_alive():
        thread.join(0.2)
        events = _read(events_path)
        if not events:
            continue
        t = time.time() - events[0]["wall_t0"]  # the run's clock
        if "learner" not in kills:
            steps = [r["step"] for r in _read(rows_path) if r["learner"] == 1]
            starts = [e for e in events if e["event"] == "learner_start" and e["learner"] == 1]
            if steps and max(steps) >= 6 and starts:
                os.kill(starts[0]["pid"], signal.SIGKILL)
                kills["learner"], kills["seen_step"] = t, max(steps)
        elif "syncer" not in kills:
            merges = _read(workdir / "merges.jsonl")
            after = [r for r in merges if r["time"] > kills["learner"] + 1.0]
            ckpt = workdir / "checkpoints" / "syncer_0"
            saved = ckpt.is_dir() and any(d.isdigit() for d in os.listdir(ckpt))
            if len(after) >= 3 and saved:
                start = [e for e in events if e["event"] == "syncer_start"][-1]
                os.kill(start["pid"], signal.SIGKILL)
                kills["syncer"] = t
    if "error" in out:
        raise out["error"]
    assert {"learner", "syncer"} <= set(kills), kills
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
    # Resumed its data shard from its last checkpoint (every 4 steps; step 4's was written
    # before step 6 ran), not from the start.
    assert rejoin["step"] % 4 == 0 and 4 <= rejoin["step"] <= kills["seen_step"] + 4
    merges = _read(workdir / "merges.jsonl")
    # Merges go on while it is down. Offers it made before it died may still merge then
    # (a late offer waits for the next round), but nothing of a later incarnation can.
    meanwhile = [r for r in merges if kills["learner"] < r["time"] < rejoin["time"]]
    assert len([r for r in meanwhile if 1 not in r["learners"]]) >= 2
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
    before = [r for r in merges if r["time"] < kills["syncer"]]
    after = [r for r in merges if r["time"] > restore["time"]]
    assert len(after) >= 2
    for p, version in restore["versions"].items():
        assert version <= max((r["version"] for r in before if r["fragment"] == int(p)), default=0)
        later = [r["version"] for r in after if r["fragment"] == int(p)]
        assert not later or min(later) == version + 1  # continues from the checkpoint
    for m in range(3):
        assert _events(workdir, "learner_done", learner=m, step=STEPS)
    assert np.isfinite(summary["final_eval_loss"])


def test_fault_schedule_crash_kills_a_real_learner_process(chaos_run):
    workdir, summary, _ = chaos_run
    (down,) = _events(workdir, "learner_down", learner=2)
    assert down["time"] == CRASH_AT
    (rejoin,) = _events(workdir, "rejoin", learner=2)
    assert rejoin["process_restart"] and rejoin["time"] > CRASH_AT
    assert rejoin["pid"] != down["pid"]  # a new process (down["pid"] None: killed starting up)
    assert _events(workdir, "learner_done", learner=2, step=STEPS)
    assert summary["failures"] >= 3


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


def test_bad_offers_are_rejected_as_in_process(cluster, small_config, tmp_path):
    from decoupled_diloco.runtime.ray_syncer import SyncerActor, initial_params

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

    plan = syncer_host.fragment_plan(run)
    log: list[dict] = []
    theta0 = initial_params(run)
    local = syncer_host.new_syncer(run.syncer, plan, theta0, 2, 0, log.append)

    rng = np.random.default_rng(0)

    def grad(p, dtype=np.float32, scale=1e-3):
        return {
            k: (scale * rng.standard_normal(theta0[k].shape)).astype(dtype) for k in plan.names[p]
        }

    steps = iter(range(4, 10_000, 4))

    def offer(p, payload, learner=0, base=0, incarnation=0):
        # Each offer at a step of the next schedule slot (H = 4), so each can open a round
        # (as in tests/test_offer_validation.py's harness).
        enc = (
            payload
            if isinstance(payload, compression.Encoded)
            else compression.encode(payload, "none")
        )
        step = next(steps)
        return Offer(learner, incarnation, p, step, 4, 256, base, 0.0, 4, enc, enc.nbytes())

    good = compression.encode(grad(1), "none")
    nan = grad(1)
    nan[plan.names[1][0]][0] = np.nan
    wrong_shape = grad(1)
    wrong_shape[plan.names[1][0]] = np.zeros((3, 3), np.float32)
    msgs = [
        Join(0, 0, 0.0),
        Join(1, 0, 0.0),
        offer(1, nan),
        offer(1, wrong_shape),
        offer(1, compression.Encoded("none", dict([next(iter(good.tensors.items()))]))),
        offer(1, grad(1), learner=5),
        offer(1, grad(1), incarnation=3),
        offer(1, grad(1), base=7),
        offer(1, grad(1)),  # good: version 1
        offer(1, grad(1), learner=1, base=1),  # good: version 2
        offer(1, grad(1), base=0),  # good: base 0 is 2 versions old, max_staleness 1 -> stale
        Heartbeat(0, 0, 4, 0.1, 0.0),
        offer(0, grad(0)),  # good
    ]
    for msg in msgs:
        local.handle(msg, 0.0)
        ray.get(syncer_actor.post.remote(msg))
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
