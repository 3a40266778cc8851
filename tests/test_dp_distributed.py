"""The data-parallel baseline over several hosts: `distributed.*` -> one explicit JAX world
(jax.distributed before JAX's backend starts), process 0's records in the workdir, the
others' under process_<i>/, one shared checkpoint directory."""

import json
import os
import socket
import subprocess
import sys

import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco import main as entry
from decoupled_diloco.runtime import launch


def _dp(small_config, **over):
    return small_config(**{"diloco.learners": 1, "diloco.sync_every": 0, **over})


def test_dp_entry_point_joins_the_configured_world(small_config, monkeypatch):
    calls = []
    monkeypatch.setattr("jax.distributed.initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr("decoupled_diloco.jax_world.check", lambda *a: None)
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "4")
    over = {
        "distributed.coordinator_address": "10.130.0.7:8482",
        "distributed.num_processes": 4,
        "distributed.process_id": 3,
    }
    entry.join_world(_dp(small_config, **over))
    assert calls == [
        dict(
            coordinator_address="10.130.0.7:8482",
            num_processes=4,
            process_id=3,
            cluster_detection_method="deactivate",
            initialization_timeout=300,
        )
    ]
    assert "MEGASCALE_NUM_SLICES" not in os.environ
    entry.join_world(_dp(small_config))  # one process: no world to join
    assert len(calls) == 1
    with pytest.raises(ValueError, match="distributed.process_id"):
        entry.join_world(_dp(small_config, **{**over, "distributed.process_id": 4}))


def test_distributed_is_for_the_data_parallel_baseline_only(small_config):
    world = {"distributed.coordinator_address": "h:1", "distributed.num_processes": 2}
    run = config_lib.validate(_dp(small_config, **world))
    assert run.distributed.num_processes == 2
    assert launch.records_dir(run, "w") == "w"  # process 0
    run1 = config_lib.validate(_dp(small_config, **world, **{"distributed.process_id": 1}))
    assert launch.records_dir(run1, "w") == os.path.join("w", "process_1")
    for bad in ({"diloco.sync_every": 4, "diloco.learners": 2}, {"diloco.sync_every": 4}):
        with pytest.raises(ValueError, match="data-parallel baseline"):
            config_lib.validate(_dp(small_config, **world, **bad))


def test_a_bad_config_is_named_before_the_world_is_joined(tmp_path):
    """The entry point joined the world first: process 0 of 2 waited for a host that would
    never come (distributed.initialization_timeout, 300 s by default), then XLA aborted the
    process without naming the config's error. It is named at once now."""
    args = [sys.executable, "-m", "decoupled_diloco.main", "--config=configs/tiny_dense.py",
            f"--workdir={tmp_path / 'w'}", "--config.distributed.num_processes=2",
            f"--config.distributed.coordinator_address=127.0.0.1:{_free_port()}",
            "--config.distributed.initialization_timeout=120"]  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for bad, named in (("--config.train.steps=0", "train.steps"),
                       ("--config.diloco.sync_every=4", "data-parallel baseline")):  # fmt: skip
        out = subprocess.run([*args, bad], cwd=root, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "config error: " in out.stderr, out.stderr[-2000:]
        assert named in out.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_one_data_parallel_model(tmp_path):
    """Real jax.distributed on CPU: 2 processes x 4 fake devices train the tiny DP model as
    one 8-device learner, checkpoint to one directory and log the same losses."""
    port, workdir = _free_port(), tmp_path / "run"
    procs = []
    for i in range(2):
        cmd = [
            sys.executable, "-m", "decoupled_diloco.main", "--config=configs/tiny_dense.py",
            f"--workdir={workdir}", "--config.train.steps=6", "--config.train.log_every=1",
            "--config.train.eval_every=0", "--config.train.eval_batches=1",
            "--config.train.checkpoint_every=3", "--config.data.max_corpus_bytes=300000",
            "--config.data.seq_len=64", "--config.train.batch_size=16",
            f"--config.distributed.coordinator_address=127.0.0.1:{port}",
            "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
        ]  # fmt: skip
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(subprocess.Popen(cmd, env=env, **pipes))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    dirs = [workdir, workdir / "process_1"]
    configs = [json.loads((d / "run_config.json").read_text()) for d in dirs]
    assert [c["devices_per_learner"] for c in configs] == [8, 8]  # one world of 8 devices
    assert [c["distributed"]["process_id"] for c in configs] == [0, 1]
    losses = []
    for d in dirs:
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in rows if r["learner"] == 0])
    assert len(losses[0]) == 6 and losses[0] == losses[1]  # the same global steps
    steps = sorted(int(s) for s in os.listdir(workdir / "checkpoints" / "learner_0"))
    assert steps[-1] == 6
    assert not (workdir / "process_1" / "checkpoints").exists()


DRIVER = """
import sys, time
from absl import app
from decoupled_diloco import cli, main
from decoupled_diloco.runtime.learner_loop import LearnerLoop

save, extra = LearnerLoop.save, float(sys.argv.pop(1))


def slower_save(self):  # this host's saves take `extra` seconds longer than the other's
    save(self)
    time.sleep(extra)


LearnerLoop.save = slower_save
app.run(main.main, flags_parser=cli.parse_flags)
"""


@pytest.mark.slow
def test_hosts_of_one_learner_take_duty_bound_saves_at_the_same_step(tmp_path):
    """train.checkpoint_duty < 1 on a learner of 2 processes whose saves take different
    times: each host would space its saves by its own clock, but a save is a collective, so
    they agree on host 0's step count and finish (a host saving while the other steps would
    wait for it forever)."""
    port, workdir = _free_port(), tmp_path / "run"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    procs = []
    for i in range(2):
        cmd = [
            sys.executable, str(driver), "0.08" if i == 1 else "0.0",
            "--config=configs/tiny_dense.py", f"--workdir={workdir}",
            "--config.train.steps=40", "--config.train.eval_every=0",
            "--config.train.eval_batches=1", "--config.train.checkpoint_every=1",
            "--config.train.checkpoint_duty=0.5", "--config.data.max_corpus_bytes=300000",
            "--config.data.seq_len=64", "--config.train.batch_size=16",
            f"--config.distributed.coordinator_address=127.0.0.1:{port}",
            "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
        ]  # fmt: skip
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=os.getcwd())
        procs.append(subprocess.Popen(cmd, env=env, **pipes))
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    steps = sorted(int(s) for s in os.listdir(workdir / "checkpoints" / "learner_0"))
    assert steps[-1] == 40


def test_a_world_of_several_processes_takes_no_sigterm_as_a_ctrl_c(monkeypatch):
    """Its processes would stop after steps of their own (nothing makes them agree) and one
    would wait for the others for ever; one process alone stops in order on a SIGTERM."""
    import signal

    monkeypatch.setattr("jax.process_count", lambda: 2)
    assert entry._stop_signals() == (signal.SIGINT,)
    monkeypatch.setattr("jax.process_count", lambda: 1)
    assert set(entry._stop_signals()) == {signal.SIGINT, signal.SIGTERM}
