"""Learners and baselines spanning several hosts, in the parts a CPU can check: the Ray
driver restarting a slice's processes together, the hosts of one learner agreeing on
every wall-clock decision (each decision is a collective they must all make), and the
global batch that their rows make."""

import itertools

import pytest


class _Process:
    """A Ray actor's process: Ray restarts a killed one under a new pid."""

    pids = itertools.count(100)

    def __init__(self):
        self.pid = next(self.pids)

    def restart(self) -> None:
        self.pid = next(self.pids)


def _driver(hosts: int):
    ray_runtime = pytest.importorskip("decoupled_diloco.runtime.ray.runtime")
    driver = ray_runtime.RayRuntime.__new__(ray_runtime.RayRuntime)  # its pid bookkeeping
    driver.pids, driver._restarting, driver.hosts = {}, set(), [hosts]
    driver.learners = {(0, h): _Process() for h in range(hosts)}
    return ray_runtime, driver


def _poll(driver) -> None:
    for (m, h), process in driver.learners.items():
        driver._seen_pid(("learner", m, h), process.pid, "node")


@pytest.mark.parametrize("hosts", [2, 4])
def test_a_slice_restarts_once_when_one_of_its_hosts_does(hosts, monkeypatch):
    """One host's process dies and comes back: the driver takes the slice's other hosts
    down once (they run one program), and their restarts are not failures that take the
    slice down again (they did, without end: no learner on a multi-host slice rejoined)."""
    ray_runtime, driver = _driver(hosts)
    kills = []

    def kill(actor, no_restart):
        assert not no_restart
        kills.append(next(h for (_, h), p in driver.learners.items() if p is actor))
        actor.restart()

    monkeypatch.setattr(ray_runtime.ray, "kill", kill)
    _poll(driver)
    driver.learners[(0, 0)].restart()  # host 0 fails on its own
    for _ in range(6):
        _poll(driver)
    assert sorted(kills) == list(range(1, hosts))
    pids = {k: p.pid for k, p in driver.learners.items()}
    _poll(driver)
    assert kills == sorted(kills) and {k: p.pid for k, p in driver.learners.items()} == pids
    driver.learners[(0, hosts - 1)].restart()  # a later failure restarts the slice again
    for _ in range(3):
        _poll(driver)
    assert sorted(kills[hosts - 1 :]) == list(range(hosts - 1))


def test_a_scheduled_crash_of_a_slice_restarts_each_host_once(monkeypatch):
    """The fault schedule's crash kills every host of the learner: their new processes are
    the restart the driver asked for."""
    ray_runtime, driver = _driver(2)
    kills = []
    monkeypatch.setattr(ray_runtime.ray, "kill", lambda a, no_restart: kills.append(a))
    _poll(driver)
    context = type("Context", (), {"get_node_id": lambda self: "driver's node"})()
    monkeypatch.setattr(ray_runtime.ray, "get_runtime_context", lambda: context)
    for h in range(2):
        driver.pids[("learner", 0, h)] = (driver.learners[(0, h)].pid, "elsewhere")
        driver._kill(("learner", 0, h), driver.learners[(0, h)])
        driver.learners[(0, h)].restart()
    kills.clear()
    for _ in range(4):
        _poll(driver)
    assert kills == []


def test_the_hosts_rows_must_make_the_configured_batch():
    """A host that read the whole batch where it should read its rows (the distributed
    data-parallel baseline did: every process read all B rows, a batch of B x hosts
    duplicated rows) fails its first step by name."""
    import jax
    import numpy as np

    from decoupled_diloco import sharding, transfer

    mesh = sharding.make_mesh(jax.devices()[:2], sharding.MeshConfig())
    rows = np.zeros((8, 5), np.int32)
    batch = transfer.batch_to_device(rows, sharding.batch_sharding(mesh), global_rows=8)
    assert batch.shape == (8, 5)
    with pytest.raises(ValueError, match="train.batch_size=16: each host must read only"):
        transfer.batch_to_device(rows, sharding.batch_sharding(mesh), global_rows=16)
