"""Learners and baselines spanning several hosts, in the parts a CPU can check: the Ray
driver restarting a slice's processes together, the hosts of one learner agreeing on
every wall-clock decision (each decision is a collective they must all make), the shapes
of their broadcasts (and, slow, their messages over real JAX collectives between two CPU
processes), and the global batch that their rows make."""

import itertools
import threading

import numpy as np
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
    driver.status, driver._died_at = [{"step": 0, "done": False}], {}
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


# --- the hosts of one learner: every wall-clock decision is host 0's ------------------
class _Slice:
    """The collectives of a 2-host learner, one thread per host: each host's receive and
    agree is a broadcast of host 0's value that both must make, in the same order (a
    host going round a loop once more than the other waits in vain: a hang on a slice)."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=10)
        self.value, self.calls = None, [[], []]

    def broadcast(self, host: int, kind: str, value):
        self.calls[host].append(kind)
        if host == 0:
            self.value = (kind, value)
        self.barrier.wait()
        kind0, out = self.value
        self.barrier.wait()  # both have read it before host 0 sets the next one
        assert kind0 == kind, f"host {host} {kind} met host 0's {kind0}"
        return out


class _HostLink:
    """One host's end of a learner whose syncer never answers (its offers stay in flight):
    the outbox and link `finish` and `step_boundary` use, over the shared `_Slice`. Each
    receive costs its timeout on this host's clock, plus `extra` (a slower host)."""

    def __init__(self, host: int, group: _Slice, clock: dict, extra: float = 0.0):
        self.host, self.group, self.clock, self.extra = host, group, clock, extra
        self.link = self

    def offer(self, ticket, copies) -> None:
        pass

    def send(self, msg) -> None:
        pass

    def flush(self, timeout: float = 600.0, deliver_timeout: float | None = None) -> bool:
        return True

    def receive(self, timeout: float) -> list:
        assert self.clock["t"] < 100.0, "the wait never ended"
        self.clock["t"] += timeout + self.extra
        return self.group.broadcast(self.host, "receive", [])

    def agree(self, decision: bool) -> bool:
        return self.group.broadcast(self.host, "agree", bool(decision))


def _on_two_hosts(body) -> _Slice:
    """Runs body(host, group) on two threads; re-raises the first host's failure."""
    group, errors = _Slice(), []

    def run(host):
        try:
            body(host, group)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(h,)) for h in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return group


def test_the_hosts_of_a_learner_end_their_final_sync_together():
    """The final sync waits up to final_wait from after the learner's last save, going
    round a receive at a time; each host saves its share and receives in its own time: by
    its own clock the faster one would go round more often."""
    from test_learner_protocol import Scripted

    from decoupled_diloco.runtime.boundary import finish

    def body(host, group):
        s = Scripted(final_sync=True, final_wait=3.0)
        for _ in range(3):
            s.step()
        s.proto.frags[0].in_flight, s.proto.frags[0].wanted = None, True
        link = _HostLink(host, group, s.clock, extra=0.1 * host)
        save = lambda: s.clock.__setitem__("t", s.clock["t"] + 0.5 * host)  # noqa: E731
        finish(s.proto, s.replica, link, link.receive, lambda: s.clock["t"], on_left=save,
               agree=link.agree)  # fmt: skip

    group = _on_two_hosts(body)
    assert group.calls[0] == group.calls[1] and group.calls[0].count("receive") >= 10


def test_the_hosts_of_a_learner_wait_for_a_merge_alike():
    """A boundary waiting up to max_wait for its merge: the slower host's clock runs ahead."""
    from test_learner_protocol import Scripted

    from decoupled_diloco.runtime.boundary import step_boundary

    def body(host, group):
        s = Scripted(max_wait=2.0)
        link = _HostLink(host, group, s.clock, extra=1.5 * host)
        for _ in range(2):
            s.replica.step()
            s.proto.stepped()
        step_boundary(s.proto, s.replica, link, link.receive, lambda: s.clock["t"],
                      agree=link.agree)  # fmt: skip
        assert s.proto.unresolved() == [0]

    group = _on_two_hosts(body)
    assert group.calls[0] == group.calls[1] and group.calls[0].count("receive") >= 2


def test_a_learner_agrees_on_its_membership_only_where_the_schedule_moves_it():
    """Each step of a multi-host learner asks its hosts to agree on whether it is up (a
    broadcast) only when that can change in time: a crash or a membership window."""
    from decoupled_diloco.fault_spec import FaultSpec
    from decoupled_diloco.faults import FaultSchedule

    quiet = FaultSchedule(FaultSpec(), 3, 3600.0)
    assert not any(quiet.changes(m) for m in range(3))
    busy = FaultSchedule(FaultSpec(crashes=((1, 50.0),), membership=((2, 10.0, 90.0),)), 3,
                         3600.0)  # fmt: skip
    assert [busy.changes(m) for m in range(3)] == [False, True, True]


def test_a_slice_broadcasts_its_messages_in_a_few_shapes(monkeypatch):
    """Host 0's messages reach every host through a broadcast, a program compiled per
    shape: padded to powers of two, messages of many sizes make a handful of shapes (one
    per size was dozens of XLA compiles on the learner's critical path). A boundary with
    nothing (or little) to deliver costs one broadcast, not one for the size and another
    for the bytes."""
    from jax.experimental import multihost_utils

    links = pytest.importorskip("decoupled_diloco.runtime.ray.links")
    shapes = []

    def broadcast(x):
        shapes.append(np.shape(x))
        return x

    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", broadcast)

    class Inner:
        def receive(self, timeout):
            return self.msgs

    inner = Inner()
    link = links.SliceLink(inner)
    for n in range(1, 400, 7):
        inner.msgs = [("merged", n, b"x" * (n * n))]
        assert link.receive(0.0) == inner.msgs
    assert len(set(shapes)) <= 12 and all(s[0] & (s[0] - 1) == 0 for s in shapes)  # of 57 sizes
    shapes.clear()
    for msgs in ([], [("dropped", 3, "superseded")]):
        inner.msgs = msgs
        assert link.receive(0.0) == msgs
    assert len(shapes) == 2  # one broadcast each


SLICE_HOST = """
import hashlib, os, pickle, sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
import numpy as np

host, port = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=host)
from decoupled_diloco.runtime.ray.links import SliceLink


class Inner:
    msgs = []

    def receive(self, timeout):
        return self.msgs


inner = Inner() if host == 0 else None
link, got = SliceLink(inner), []
for n in (0, 1, 3, 40):  # nothing, a short message, one past the first broadcast, many
    msgs = [("merged", k, np.arange(7 * k, dtype=np.float32)) for k in range(n)]
    if inner is not None:
        inner.msgs = msgs
    got.append(link.receive(0.0))
    assert pickle.dumps(got[-1]) == pickle.dumps(msgs), (host, n)
got.append(link.agree(host == 0))
print("RECEIVED", hashlib.sha256(pickle.dumps(got)).hexdigest(), flush=True)
"""


@pytest.mark.slow
def test_a_slices_hosts_receive_host_0s_messages_over_real_jax_collectives(tmp_path):
    """Two JAX processes (jax.distributed on CPU, gloo collectives) as the hosts of one
    learner: each receive hands every host host 0's messages, whatever their size, and
    `agree` host 0's decision (the other tests replace the broadcast)."""
    import os
    import socket
    import subprocess
    import sys

    pytest.importorskip("decoupled_diloco.runtime.ray.links")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "host.py"
    script.write_text(SLICE_HOST)
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, str(script), str(h), str(port)], env=env, **pipes)
             for h in (0, 1)]  # fmt: skip
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    digests = [next(x for x in out.splitlines() if x.startswith("RECEIVED")) for out in outs]
    assert digests[0] == digests[1]
