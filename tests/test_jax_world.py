"""jax_world.py: every JAX world is stated explicitly, one per slice (a learner's own
fate), whatever MEGASCALE_* (a multislice request) says; and the data-parallel path joins the
world of its `distributed.*` keys."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from decoupled_diloco import jax_world
from decoupled_diloco.runtime.ray import cluster as ray_cluster

# What a multislice queued resource of 2 slices sets on the hosts of slice 1.
MULTISLICE_ENV = {
    "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.10",
    "MEGASCALE_NUM_SLICES": "2",
    "MEGASCALE_SLICE_ID": "1",
    "MEGASCALE_PORT": "8080",
}


def _node(slice_id: str, worker: int, ip: str, alive: bool = True) -> dict:
    return {
        "Alive": alive,
        "NodeManagerAddress": ip,
        "Resources": {"TPU": 4.0, slice_id: 1.0, f"node:{ip}": 1.0},
        "Labels": {ray_cluster.WORKER_ID_LABEL: str(worker)},
    }


def test_each_slice_is_its_own_world_whatever_megascale_says(monkeypatch):
    for k, v in MULTISLICE_ENV.items():
        monkeypatch.setenv(k, v)
    # 2 slices x 4 hosts; listed out of order, with a dead old worker 0 of dd-1 still listed.
    nodes = [_node("dd-1", 3, "10.0.1.3"), _node("dd-1", 0, "10.0.9.9", alive=False)]
    nodes += [_node("dd-0", w, f"10.0.0.{10 + w}") for w in range(4)]
    nodes += [_node("dd-1", w, f"10.0.1.{w}") for w in (2, 0, 1)]
    worlds = {}
    for slice_id in ("dd-0", "dd-1"):
        address = ray_cluster.slice_coordinator(nodes, slice_id)
        worlds[slice_id] = [jax_world.slice_world(address, 4, h) for h in range(4)]
    for slice_id, coordinator in (("dd-0", "10.0.0.10:8482"), ("dd-1", "10.0.1.0:8482")):
        kwargs = [w.initialize_kwargs() for w in worlds[slice_id]]
        assert [k["num_processes"] for k in kwargs] == [4] * 4  # one slice's hosts, not 8
        assert [k["process_id"] for k in kwargs] == [0, 1, 2, 3]  # not 4..7 on slice 1
        assert {k["coordinator_address"] for k in kwargs} == {coordinator}
        assert all(k["cluster_detection_method"] == "deactivate" for k in kwargs)
    assert ray_cluster.slice_coordinator(nodes[:2], "dd-1") is None  # worker 0 not (re)joined
    assert jax_world.slice_world("10.0.0.10", 1, 0) == jax_world.SINGLE
    with pytest.raises(ValueError, match="host 4"):
        jax_world.slice_world("10.0.0.10", 4, 4)
    with pytest.raises(ValueError, match="worker 0"):
        jax_world.slice_world(None, 4, 1)


def test_initialize_passes_explicit_arguments_and_scrubs_megascale(monkeypatch):
    for k, v in MULTISLICE_ENV.items():
        monkeypatch.setenv(k, v)
    calls = []
    world = jax_world.World("10.0.1.0:8482", 4, 2)
    jax_world.initialize(world, timeout_s=77, init=lambda **kw: calls.append(kw))
    assert calls == [
        dict(
            coordinator_address="10.0.1.0:8482",
            num_processes=4,
            process_id=2,
            cluster_detection_method="deactivate",
            initialization_timeout=77,
        )
    ]
    assert not [k for k in os.environ if k.startswith("MEGASCALE_")]
    for k, v in MULTISLICE_ENV.items():  # a single-host slice: no world, still scrubbed
        monkeypatch.setenv(k, v)
    jax_world.initialize(jax_world.SINGLE, init=lambda **kw: calls.append(kw))
    assert len(calls) == 1 and not [k for k in os.environ if k.startswith("MEGASCALE_")]
    with pytest.raises(RuntimeError, match="world of 8 processes as process 6"):
        jax_world.check(world, 8, 6)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_processes=0), "num_processes must be >= 1"),
        (dict(num_processes=2, process_id=2, coordinator_address="h:1"), r"process_id must"),
        (dict(num_processes=2), "coordinator_address"),
        (dict(num_processes=2, coordinator_address="10.0.0.2"), "coordinator_address"),
        (dict(coordinator_address="10.0.0.2:8482"), "num_processes is 1"),
        (dict(initialization_timeout=0), "initialization_timeout"),
    ],
)
def test_distributed_config_is_validated(fields, message):
    with pytest.raises(ValueError, match=message):
        jax_world.DistributedConfig(**fields).validate()


_CHILD = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from decoupled_diloco import jax_world
    host, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax_world.initialize(jax_world.slice_world("127.0.0.1", 2, host, port), timeout_s=120)
    import jax
    from jax.experimental import multihost_utils
    slices = multihost_utils.process_allgather(np.int32(os.environ["SLICE"]))
    # A file, written and closed before shutdown: Gloo writes to the same stdout, and a
    # block-buffered pipe is not flushed if the runtime's shutdown ends the process.
    with open(out_path, "w") as f:
        json.dump({
            "count": jax.process_count(), "index": jax.process_index(),
            "devices": jax.device_count(), "local": jax.local_device_count(),
            "slices_in_world": sorted(int(s) for s in np.ravel(slices)),
            "megascale": sorted(k for k in os.environ if k.startswith("MEGASCALE_")),
        }, f)
    jax.distributed.shutdown()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_slices_of_two_processes_form_two_worlds_on_cpu(tmp_path):
    """Real jax.distributed on CPU: 4 processes told by MEGASCALE_* that they are one 2-slice
    multislice job form two worlds of 2 processes (2 fake devices each)."""
    procs = []
    for s in range(2):
        port = _free_port()
        for host in range(2):
            env = {
                **os.environ,
                **MULTISLICE_ENV,
                "MEGASCALE_SLICE_ID": str(s),
                "MEGASCALE_COORDINATOR_ADDRESS": "127.0.0.1",
                "SLICE": str(s),
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            }
            out_path = tmp_path / f"slice{s}_host{host}.json"
            log_path = tmp_path / f"slice{s}_host{host}.log"
            cmd = [sys.executable, "-c", _CHILD, str(host), str(port), str(out_path)]
            # Output to a file, not a pipe: the children are waited for one by one, and a
            # child whose pipe fills (gRPC retry logs under load) would block the barrier
            # the one being waited for is in.
            with open(log_path, "w") as log:
                p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            procs.append((s, host, out_path, log_path, p))
    for s, host, out_path, log_path, p in procs:
        p.wait(timeout=180)
        log = log_path.read_text()[-3000:]
        assert p.returncode == 0, log
        assert out_path.exists(), f"slice {s} host {host} wrote no result:\n{log}"
        got = json.loads(out_path.read_text())
        assert got == {
            "count": 2,
            "index": host,
            "devices": 4,
            "local": 2,
            "slices_in_world": [s, s],
            "megascale": [],
        }
