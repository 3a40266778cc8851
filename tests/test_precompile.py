"""The protocol's device operations compile before training, not at step boundaries.

A fragment's on-device copy (an offer) and its merge update (add / mix, whole leaves and
row slices of the embedding) each compile once per shape and sharding. Compiled where
first used, they stall the learner's thread at its first boundaries while the device
idles; `Replica.precompile` compiles them beforehand, and the learner loop calls it as a
learner joins. Each test uses a model width no other test uses, so the compilation cache
of the process is cold for it whatever ran before.
"""

import threading
import traceback

import jax
import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco import sharding
from decoupled_diloco.diloco.fragments import model_plan
from decoupled_diloco.diloco.learner import Learner
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
    """The compilations a copy or an update caused where it ran."""
    return [c for c in compiles if "fragment_copies" in c[1] or "apply" in c[1]]


def _protocol_ops(replica: Replica, plan) -> None:
    """Every fragment's copy, add and mix, as the learner's boundaries run them."""
    host = replica.host_params()
    for names in plan.names:
        copies = replica.to_host(replica.fragment_copies(names))
        zeros = {k: np.zeros_like(v) for k, v in copies.items()}
        replica.apply("add", zeros, 0.5)
        replica.apply("mix", copies, 0.5)
    after = replica.host_params()
    for k in host:  # adding 0 and mixing θ with itself leave θ as it was
        np.testing.assert_array_equal(after[k], host[k])


@pytest.mark.parametrize("background", [False, True])
def test_precompiled_fragments_compile_nothing_at_a_boundary(small_config, compiles, background):
    run, plan = _sliced(small_config, d_model=40 if background else 48)
    mesh = sharding.make_mesh(jax.devices()[:2], run.mesh)
    replica = Replica(run.model, run.train, mesh)
    replica.init_from_rng(jax.random.key(0))
    replica.precompile(plan.names, ("add", "mix"), 0.5, background=background)
    compiles.clear()
    _protocol_ops(replica, plan)
    assert _at_boundaries(compiles) == []


def test_without_precompiling_each_fragment_compiles_at_its_first_boundary(small_config,
                                                                          compiles):  # fmt: skip
    """The control: the listener sees the compilations `precompile` moves."""
    run, plan = _sliced(small_config, d_model=56)
    replica = Replica(run.model, run.train, sharding.make_mesh(jax.devices()[:2], run.mesh))
    replica.init_from_rng(jax.random.key(0))
    compiles.clear()
    _protocol_ops(replica, plan)
    where = " ".join(frames for _, frames in compiles)
    assert "fragment_copies" in where and "apply" in where
    assert len(compiles) >= 3 * len(plan.names)  # copy, add, mix of every fragment at least


def test_update_kinds_cover_what_merges_apply():
    cfg = config_lib.tiny_cpu_config("t", learners=2).diloco
    assert Learner.update_kinds(cfg) == ("add", "mix")  # rebase; exact rebases mix
    cfg.compression = "int8"
    assert Learner.update_kinds(cfg) == ("add",)
    cfg.apply = "overwrite"
    assert Learner.update_kinds(cfg) == ("mix",)


def test_a_decoupled_run_compiles_no_protocol_op_on_a_learner_thread(small_config, compiles,
                                                                     tmp_path):  # fmt: skip
    """The learner loop precompiles as a learner joins: through a whole run (offers, merges
    of every fragment, the final sync), no copy or update compiles on a learner's thread."""
    run, _ = _sliced(small_config, d_model=72, **{"diloco.overlap": 1, "diloco.quorum": 1,
                                                  "diloco.max_wait": 0.0})  # fmt: skip
    summary = LocalRuntime(run, str(tmp_path), verbose=False).run()
    assert summary["merges"] > 0
    assert _at_boundaries(compiles) == []
    assert any(t == "precompile" for t, _ in compiles)  # they did compile, beforehand
