"""The protocol's device operations compile before training, not at step boundaries.

A fragment's on-device copy (an offer) and its merge update (add / mix, whole leaves and
row slices of the embedding) each compile once per shape and sharding. Compiled where
first used, they stall the learner's thread at its first boundaries while the device
idles; `Replica.precompile` compiles them beforehand, and the learner loop calls it as a
learner joins. Each test uses a model width no other test uses, so the compilation cache
of the process is cold for it whatever ran before.
"""

import json
import subprocess
import sys
import threading
import time
import traceback

import jax
import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco import sharding
from decoupled_diloco.diloco import compression
from decoupled_diloco.diloco.fragments import model_plan
from decoupled_diloco.diloco.learner import Learner, materialize
from decoupled_diloco.diloco.messages import Merged, Snapshot
from decoupled_diloco.diloco.updates import rebase_delta
from decoupled_diloco.models import flatten_params, init_params
from decoupled_diloco.runtime.local import LocalRuntime
from decoupled_diloco.train.replica import Replica

_compiles: list[tuple[str, str]] = []  # (thread name, frames of decoupled_diloco code)
_recording = threading.Event()


def _listen(event: str, seconds: float, **kwargs) -> None:
    if _recording.is_set() and event.endswith("backend_compile_duration"):
        frames = [f.name for f in traceback.extract_stack() if "decoupled_diloco" in f.filename]
        _compiles.append((threading.current_thread().name, " ".join(frames)))


jax.monitoring.register_event_duration_secs_listener(_listen)


@pytest.fixture
def compiles():
    _compiles.clear()
    _recording.set()
    yield _compiles
    _recording.clear()


def _sliced(small_config, d_model: int, **overrides):
    """A tiny model of width `d_model` whose plan cuts the embedding in row slices."""
    run = config_lib.validate(
        small_config(
            **{
                "model.d_model": d_model,
                "model.ffw_hidden": 4 * d_model,
                "diloco.learners": 2,
                "diloco.fragments": 12,
                "diloco.sync_every": 12,
                **overrides,
            }
        )
    )
    plan = model_plan(run.model, run.diloco)
    assert any("[" in n for names in plan.names for n in names)  # row slices included
    return run, plan


def _at_boundaries(compiles) -> list:
    """The compilations a copy, an update or a rebase staged on the devices caused where it
    ran."""
    ops = {"fragment_copies", "apply", "land", "rebase_delta", "outer_gradient"}
    return [c for c in compiles if ops & set(c[1].split())]


def _protocol_ops(replica: Replica, plan, land: bool = False) -> None:
    """Every fragment's copy, add and mix, as the learner's boundaries run them, and its
    rebase computed on the devices (`MergeStager` with `diloco.device_rebase`), which must
    give the host rebase's bits; `land`: two landings on θ itself (x = 0, Θ_new = θ: θ
    stays, R = 0), the second onto the first's R, whose copies and outer gradient follow."""
    host = replica.host_params()
    rng = np.random.default_rng(0)
    for names in plan.names:
        copies = replica.to_host(replica.fragment_copies(names))
        zeros = {k: np.zeros_like(v) for k, v in copies.items()}
        replica.apply("add", zeros, 0.5)
        replica.apply("mix", copies, 0.5)
        if land:
            for _ in range(2):
                replica.land(zeros, replica.place(copies), 0.5)
        new, sent = ({k: rng.standard_normal(v.shape).astype(np.float32)
                      for k, v in copies.items()} for _ in range(2))  # fmt: skip
        for v in (sent, None):
            placed = [replica.place(a) for a in (new, copies)] + [v and replica.place(v)]
            on_device = replica.to_host(replica.rebase_delta(*placed))
            on_host = rebase_delta(copies, new, v)
            for k in on_host:
                np.testing.assert_array_equal(on_device[k], on_host[k], err_msg=k)
        # An offer's v = G − θ from a G on the devices, as `materialize` computes it.
        on_device = replica.to_host(replica.outer_gradient(names, replica.place(new)))
        theta = replica.to_host(replica.fragment_copies(names))
        for k in names:
            np.testing.assert_array_equal(on_device[k], np.subtract(new[k], theta[k]), err_msg=k)
    after = replica.host_params()
    for k in host:  # adding 0 and mixing θ with itself leave θ as it was
        np.testing.assert_array_equal(after[k], host[k])


# (devices, overrides): data-parallel (leaves replicated), and fsdp x tensor over 4 (leaves
# and the embedding's row slices split over devices both ways).
MESHES = {
    "data": (2, {}),
    "sharded": (4, {"mesh.fsdp": 2, "mesh.tensor": 2, "mesh.data": 1}),
}


@pytest.mark.parametrize(("background", "mesh", "d_model"),
                         [(False, "data", 48), (True, "sharded", 88),
                          # (the other two pairings: slow, ~7 s each; CI runs them)
                          pytest.param(True, "data", 40, marks=pytest.mark.slow),
                          pytest.param(False, "sharded", 80, marks=pytest.mark.slow)])  # fmt: skip
@pytest.mark.slow
def test_precompiled_fragments_compile_nothing_at_a_boundary(small_config, compiles, background,
                                                             mesh, d_model):  # fmt: skip
    devices, overrides = MESHES[mesh]
    run, plan = _sliced(small_config, d_model=d_model, **overrides)
    replica = Replica(run.model, run.train, sharding.make_mesh(jax.devices()[:devices], run.mesh))
    replica.init_from_rng(jax.random.key(0))
    replica.precompile(plan.names, ("add", "mix", "land"), 0.5, background=background)
    compiles.clear()
    _protocol_ops(replica, plan, land=True)
    assert _at_boundaries(compiles) == []
    assert set(replica.held) == {k for names in plan.names for k in names}  # landed


@pytest.mark.slow
def test_without_precompiling_each_fragment_compiles_at_its_first_boundary(small_config,
                                                                          compiles):  # fmt: skip
    """The control: the listener sees the compilations `precompile` moves."""
    run, plan = _sliced(small_config, d_model=56)
    replica = Replica(run.model, run.train, sharding.make_mesh(jax.devices()[:2], run.mesh))
    replica.init_from_rng(jax.random.key(0))
    compiles.clear()
    _protocol_ops(replica, plan)
    where = {frame for _, frames in compiles for frame in frames.split()}
    assert {"fragment_copies", "apply"} <= where
    assert len(compiles) >= 3 * len(plan.names)  # copy, add, mix of every fragment at least


def _applied_kinds(cfg, plan, params) -> tuple[set[str], set[str]]:
    """Kinds of the updates a learner applies while training and in its final sync: merges
    holding its offer (at the offer's own step, and later), one holding none, and a
    restored syncer's snapshot."""
    learner = Learner(0, cfg, plan, 10, clock=lambda: 0.0)
    learner.start([Snapshot({p: 0 for p in range(plan.num_fragments)}, params, 0.0)])
    version, training, final = 0, set(), set()
    for wait in (0, cfg.overlap + 1):  # merged at the offer's own step, then τ + 1 later
        while not (due := learner.due_offers()):
            learner.stepped()
        for ticket in due:
            theta = {k: params[k] for k in plan.names[ticket.fragment]}
            materialize(ticket, {k: v - 1 for k, v in theta.items()})
        for _ in range(wait):
            learner.stepped()
        version += 1
        replies = [Merged(t.fragment, version, compression.encode(params_of(plan, t.fragment,
                   params), "none"), (0,), 0.0, merged={0: (0, t.step)}) for t in due]  # fmt: skip
        learner.handle(replies)
        training |= {u.kind for u in learner.apply_due()}
        final |= {u.kind for u in learner.apply_due(final=True)}  # what τ held back
    version += 1
    other = Merged(0, version, compression.encode(params_of(plan, 0, params), "none"), (1,), 0.0,
                   merged={1: (0, 5)})  # fmt: skip
    learner.handle([other])
    training |= {u.kind for u in learner.apply_due()}
    restored = Snapshot({p: 0 for p in range(plan.num_fragments)}, params, 0.0, epoch=1)
    training |= {u.kind for u in learner.handle([restored])}
    return training, final


def params_of(plan, p: int, params: dict) -> dict:
    return {k: params[k] for k in plan.names[p]}


@pytest.mark.parametrize("apply", ["rebase", "land", "overwrite"])
@pytest.mark.parametrize("method", ["none", "int8"])
@pytest.mark.parametrize("overlap", [0, 2])
def test_update_kinds_are_the_kinds_learners_apply(small_config, apply, method, overlap):
    run = config_lib.validate(small_config(**{"diloco.learners": 2, "diloco.sync_every": 4,
                                              "diloco.fragments": 2, "diloco.apply": apply,
                                              "diloco.compression": method,
                                              "diloco.overlap": overlap,
                                              "diloco.alpha": 0.5}))  # fmt: skip
    plan = model_plan(run.model, run.diloco)
    shapes = flatten_params(jax.eval_shape(lambda: init_params(run.model, jax.random.key(0))))
    params = {n: np.zeros(shapes[n].shape, np.float32) for names in plan.names for n in names}
    training, final = _applied_kinds(run.diloco, plan, params)
    assert training == set(Learner.update_kinds(run.diloco, training=True))
    assert training | final == set(Learner.update_kinds(run.diloco))


@pytest.mark.parametrize("apply", ["rebase", "land"])
@pytest.mark.slow
def test_a_decoupled_run_compiles_no_protocol_op_on_a_learner_thread(small_config, compiles,
                                                                     tmp_path, apply,
                                                                     monkeypatch):  # fmt: skip
    """The learner loop precompiles as a learner joins: through its steps (offers and merges
    of every fragment) no copy or update compiles on a learner's thread. (The final sync's
    exact rebases, which training with τ > 0 never applies, compile there if it needs
    them.) With `land`, every learner set steps aside and offered them."""
    run, _ = _sliced(small_config, d_model=72, **{"diloco.overlap": 1, "diloco.quorum": 1,
                                                  "diloco.max_wait": 0.0,
                                                  "diloco.apply": apply})  # fmt: skip
    landed, land = [], Replica.land

    def counted(self, *args, **kwargs):
        landed.append(self)
        return land(self, *args, **kwargs)

    monkeypatch.setattr(Replica, "land", counted)
    summary = LocalRuntime(run, str(tmp_path), verbose=False).run()
    assert len(set(map(id, landed))) == (run.diloco.learners if apply == "land" else 0)
    assert summary["merges"] > 0
    assert summary["mean_merge_delay_steps"] > 0  # τ = 1: held merges apply a step later
    assert [c for c in _at_boundaries(compiles) if "_finish" not in c[1].split()] == []
    assert any(t.startswith("precompile") for t, _ in compiles)  # they did compile, before


_RAISES_WHILE_PRECOMPILING = """
import os
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax
from decoupled_diloco import config as config_lib, sharding
from decoupled_diloco.diloco.fragments import model_plan
from decoupled_diloco.train.replica import Replica
c = config_lib.tiny_cpu_config("t", learners=2)
c.model.d_model, c.model.ffw_hidden, c.model.num_layers = 136, 544, 4
c.diloco.fragments = c.diloco.sync_every = 12
c.devices_per_learner = 1
run = config_lib.validate(c)
plan = model_plan(run.model, run.diloco)
replica = Replica(run.model, run.train, sharding.make_mesh(jax.devices()[:1], run.mesh))
replica.precompile(plan.names, ("add", "mix"), 0.5)
raise RuntimeError("the first train step failed")
"""


@pytest.mark.slow
def test_a_process_that_fails_while_precompiling_exits_with_its_error():
    """The precompile thread is joined at exit: torn down mid-compilation, XLA would abort
    the process (exit 134, the error's traceback lost among its own)."""
    proc = subprocess.run([sys.executable, "-c", _RAISES_WHILE_PRECOMPILING],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "RuntimeError: the first train step failed" in proc.stderr


class _SlowLocks(dict):
    """Stands in for replica._PRECOMPILING: each fragment's compile lock, once taken, holds
    its compile `seconds` longer; `most` is the most fragments inside their locks at once."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.now, self.most = seconds, 0, 0
        self._count = threading.Lock()

    def setdefault(self, key, default=None):
        return super().setdefault(key, _SlowLock(self))


class _SlowLock:
    def __init__(self, locks: _SlowLocks):
        self.locks, self.lock = locks, threading.Lock()

    def __enter__(self):
        self.lock.acquire()
        with self.locks._count:
            self.locks.now += 1
            self.locks.most = max(self.locks.most, self.locks.now)
        time.sleep(self.locks.seconds)

    def __exit__(self, *exc):
        with self.locks._count:
            self.locks.now -= 1
        self.lock.release()


def _slow_compiles(monkeypatch, seconds: float) -> _SlowLocks:
    """Makes every fragment's `precompile` take `seconds` more, inside its lock."""
    locks = _SlowLocks(seconds)
    monkeypatch.setattr("decoupled_diloco.train.replica._PRECOMPILING", locks)
    return locks


@pytest.mark.slow
def test_fragments_compile_side_by_side_and_waits_for_them_are_counted(small_config,
                                                                       monkeypatch):  # fmt: skip
    """On a host with cores to spare the background precompile compiles fragments at once,
    and a fragment op that has to wait for its compile adds the wait to its thread's
    `compile_waited` (learner rows report the learner's: start-up, not the step's cost);
    another thread's waits are its own, and once compiled no more is added."""
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    locks = _slow_compiles(monkeypatch, 0.3)
    run, plan = _sliced(small_config, d_model=32)
    replica = Replica(run.model, run.train, sharding.make_mesh(jax.devices()[:1], run.mesh))
    replica.init_from_rng(jax.random.key(0))
    replica.precompile(plan.names, ("add", "mix"), 0.5)
    assert replica.compile_waited() == 0.0
    theirs = []

    def other_thread():  # a stager's, say: its waits are its own
        replica.fragment_copies(plan.names[0])
        theirs.append(replica.compile_waited())

    other = threading.Thread(target=other_thread)
    other.start()
    other.join()
    assert theirs[0] >= 0.2 and replica.compile_waited() == 0.0, theirs
    replica.fragment_copies(plan.names[-1])
    waited = replica.compile_waited()
    assert waited >= 0.2, waited
    for names in plan.names:
        replica.fragment_copies(names)
    assert locks.most >= 2, locks.most  # side by side
    before = replica.compile_waited()
    replica.fragment_copies(plan.names[0])
    assert replica.compile_waited() == before


@pytest.mark.slow
def test_learner_rows_report_the_wait_for_compiles(small_config, tmp_path, monkeypatch):
    """A learner whose first offers wait for their fragments' compile says so in its rows
    (the bench's window must not hold it: scripts/bench_accelerator.py --warmup). One
    compile thread, as on a 2-core host, so the offers do wait whatever the host."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    _slow_compiles(monkeypatch, 0.4)
    run, _ = _sliced(small_config, d_model=64, **{"train.steps": 24, "train.log_every": 1})
    LocalRuntime(run, str(tmp_path), verbose=False).run()
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        rows = [r for r in map(json.loads, f) if "loss" in r and "learner" in r]
    for m in {r["learner"] for r in rows}:
        waits = [r.get("compile_wait_s", 0.0) for r in rows if r["learner"] == m]
        assert max(waits) >= 0.3, (m, waits)
        assert waits == sorted(waits), (m, waits)  # seconds since the learner started
