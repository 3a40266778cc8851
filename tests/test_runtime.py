"""End-to-end runs of the local runtime: DP training, exact resume, DiLoCo equivalences,
quorum behaviour and real concurrency of learners on disjoint device subsets."""

import json
import os
import threading
import time

import jax
import numpy as np
import pytest
from conftest import threads_left

from decoupled_diloco import config as config_lib
from decoupled_diloco.checkpoint import Checkpointer
from decoupled_diloco.runtime.local import LocalRuntime


def _read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _run(cfg, workdir, **kw):
    return LocalRuntime(config_lib.validate(cfg), str(workdir), verbose=False, **kw).run()


def _final_params(workdir, name="learner_0"):
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints", name))
    state, meta = ckpt.restore(None)
    ckpt.close()
    return state, meta


def test_data_parallel_run_learns_on_the_real_corpus(small_config, tmp_path):
    cfg = small_config(**{"train.steps": 40, "train.learning_rate": 1e-2, "train.eval_every": 20})
    summary = _run(cfg, tmp_path)
    rows = _read(tmp_path / "metrics.jsonl")
    first_loss = rows[0]["loss"]
    assert first_loss > 5.0  # ~ln(256) at init
    assert summary["final_eval_loss"] < first_loss - 1.5
    for key in ("step", "tokens", "loss", "learning_rate", "tokens_per_second"):
        assert key in rows[-2], key
    # Every row a rate, the first too (it read 0: a run of log_every steps showed none).
    assert all(r["tokens_per_second"] > 0 for r in rows if "tokens_per_second" in r)
    assert any("eval_loss" in r for r in rows)
    for key in ("final_eval_loss", "steps", "tokens", "wall_seconds"):
        assert key in summary
    assert summary["steps"] == 40 and summary["tokens"] == 40 * 8 * 64


@pytest.mark.slow
def test_kill_and_resume_matches_an_uninterrupted_run(small_config, tmp_path):
    cfg = small_config(**{"train.steps": 10, "train.checkpoint_every": 4})
    _run(cfg, tmp_path / "straight")
    # Killed after step 6: the last checkpoint is step 4, so steps 5-6 are redone.
    assert _run(cfg, tmp_path / "killed", halt_after=6) is None
    _run(cfg, tmp_path / "killed")
    a, meta_a = _final_params(tmp_path / "straight")
    b, meta_b = _final_params(tmp_path / "killed")
    assert meta_a["step"] == meta_b["step"] == 10
    assert meta_a["data"] == meta_b["data"]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The redone steps 5-6 are logged once: metrics.jsonl reads like the uninterrupted run's.
    with open(tmp_path / "killed" / "metrics.jsonl", encoding="utf-8") as f:
        steps = [r["step"] for r in map(json.loads, f) if r["learner"] == 0]
    assert steps == list(range(1, 11))


@pytest.mark.parametrize(
    "schedule",
    [
        {"diloco.sync_every": 1, "diloco.fragments": 1, "diloco.overlap": 0},
        # Streaming with overlap: each merge of Θ = θ_s is applied τ steps later by rebasing
        # onto it, from device-staged arrays (θ_s + θ_{s+τ} − θ_s: plain training again).
        {"diloco.sync_every": 4, "diloco.fragments": 2, "diloco.overlap": 2},
    ],
    ids=["h1", "h4_p2_tau2"],
)
def test_diloco_with_one_learner_and_outer_lr1_matches_plain_training(
    small_config, tmp_path, schedule
):
    plain = _run(small_config(), tmp_path / "plain")
    diloco = _run(
        small_config(
            **{
                **schedule,
                "diloco.quorum": 1,
                "diloco.max_wait": -1.0,
                "diloco.outer_lr": 1.0,
                "diloco.outer_momentum": 0.0,
                "diloco.merge": "mean",
                "diloco.weights": "uniform",
                "diloco.grace_gamma": 0.0,
            }
        ),
        tmp_path / "diloco",
    )
    rounds = 12 // schedule["diloco.sync_every"]  # 12 steps (small_config)
    assert diloco["merges"] >= rounds * schedule["diloco.fragments"]
    assert abs(plain["final_eval_loss"] - diloco["final_eval_loss"]) < 1e-4
    a, _ = _final_params(tmp_path / "plain")
    b, _ = _final_params(tmp_path / "diloco")
    pa, pb = (s["params"] if isinstance(s, dict) else s[1] for s in (a, b))
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=1e-5)


def _decoupled(small_config, **over):
    base = {
        "diloco.learners": 4,
        "diloco.sync_every": 4,
        "diloco.fragments": 2,
        "diloco.overlap": 1,
        "diloco.quorum": 1,
        "diloco.grace_gamma": 0.0,
        "train.steps": 16,
    }
    base.update(over)
    return small_config(**base)


@pytest.mark.slow
def test_k1_merges_keep_flowing_past_a_stalled_learner(small_config, tmp_path):
    cfg = _decoupled(small_config, **{"faults.speed_factors": [1.0, 1.0, 1.0, 8.0]})
    summary = _run(cfg, tmp_path)
    merges = _read(tmp_path / "merges.jsonl")
    leave = {
        e["learner"]: e["time"] for e in _read(tmp_path / "events.jsonl") if e["event"] == "leave"
    }
    # The others never waited for the straggler: they finished long before it did...
    assert max(leave[0], leave[1], leave[2]) < leave[3]
    # ...and every scheduled round (16 steps / H=4 x 2 fragments) merged without waiting for
    # it; its few late offers ride along with a round at most.
    before = [m for m in merges if m["time"] < leave[3]]
    assert len(before) >= 8
    assert sum(3 not in m["learners"] for m in before) >= 5
    assert summary["steps"] == 16
    # Every step of every learner reached Θ exactly once, per fragment (final_sync).
    merged: dict = {}
    for m in merges:
        for lr, n in zip(m["learners"], m["c_steps"], strict=True):
            merged[lr, m["fragment"]] = merged.get((lr, m["fragment"]), 0) + n
    assert merged == {(lr, p): 16 for lr in range(4) for p in range(2)}


@pytest.mark.slow
def test_quorum_m_waits_for_every_learner(small_config, tmp_path):
    cfg = _decoupled(
        small_config,
        **{
            "diloco.quorum": 4,
            "diloco.max_wait": -1.0,
            "diloco.final_sync": False,
            "faults.speed_factors": [1.0, 1.0, 1.0, 3.0],
        },
    )
    _run(cfg, tmp_path)
    merges = _read(tmp_path / "merges.jsonl")
    assert merges
    assert all(sorted(m["learners"]) == [0, 1, 2, 3] for m in merges)


@pytest.mark.slow
def test_learners_run_concurrently_on_disjoint_devices(small_config, tmp_path, monkeypatch):
    from decoupled_diloco.train.replica import Replica

    intervals = {}
    lock = threading.Lock()
    original = Replica.step
    barrier = threading.Barrier(2)
    steps: dict = {}

    def timed(self, batch):
        key = min(d.id for d in self.mesh.devices.flat)  # one replica per learner
        steps[key] = steps.get(key, 0) + 1
        if steps[key] == 3:  # both compiled: start the timed steps together
            barrier.wait(timeout=300)
        t0 = time.perf_counter()
        out = original(self, batch)
        jax.block_until_ready(self.state)  # the step's compute, not just its dispatch
        with lock:
            intervals.setdefault(key, []).append((t0, time.perf_counter()))
        return out

    monkeypatch.setattr(Replica, "step", timed)
    cfg = _decoupled(small_config, **{"diloco.learners": 2, "train.steps": 20})
    run = config_lib.validate(cfg)
    rt = LocalRuntime(run, str(tmp_path), verbose=False)
    rt.run()
    devs = [set(d.id for d in mesh.devices.flat) for mesh in rt.meshes]
    assert len(devs[0]) == len(devs[1]) == 4 and not devs[0] & devs[1]
    # Time during which both learners were inside a step at once.
    a, b = (intervals[k][3:] for k in sorted(intervals))  # steps after the barrier
    both = sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)
    busy = min(sum(x1 - x0 for x0, x1 in a), sum(y1 - y0 for y0, y1 in b))
    assert both > 0.3 * busy, (both, busy)


def test_one_learner_h1_with_outer_momentum_matches_a_reference_loop(small_config, tmp_path):
    """DiLoCo with one learner and H = 1: after every inner step the syncer takes a Nesterov
    step and the learner continues from Θ (keeping its AdamW state). A reference loop written
    here, from the jitted train step and numpy, must give the same Θ; it would not if the
    learner never applied merges (with outer momentum Θ ≠ θ after every step)."""
    from decoupled_diloco.data import make_iterator
    from decoupled_diloco.train.replica import Replica

    lr, mu, steps = 0.8, 0.5, 6
    cfg = small_config(
        **{
            "train.steps": steps,
            "diloco.sync_every": 1,
            "diloco.fragments": 1,
            "diloco.overlap": 0,
            "diloco.max_wait": -1.0,
            "diloco.outer_lr": lr,
            "diloco.outer_momentum": mu,
            "diloco.merge": "mean",
            "diloco.grace_gamma": 0.0,
        }
    )
    run = config_lib.validate(cfg)
    rt = LocalRuntime(run, str(tmp_path), verbose=False)
    rt.run()
    mesh = rt.meshes[0]
    theta = rt.global_params()

    replica = Replica(run.model, run.train, mesh)
    replica.init_from_rng(jax.random.key(run.train.seed))
    data = make_iterator(run.data, "train", run.train.batch_size, 0, 1)
    ref = replica.host_params()
    buf = {k: np.zeros_like(v) for k, v in ref.items()}
    for _ in range(steps):
        replica.set_params(ref)
        replica.step(next(data))
        local = replica.host_params()
        for k in ref:
            delta = ref[k] - local[k]
            buf[k] = np.float32(mu) * buf[k] + delta
            ref[k] = ref[k] - np.float32(lr) * (delta + np.float32(mu) * buf[k])
    for k in theta:
        np.testing.assert_allclose(theta[k], ref[k], rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("shards", [2])
@pytest.mark.slow
def test_sharded_syncer_merges_every_fragment(small_config, tmp_path, shards):
    cfg = _decoupled(small_config, **{"diloco.fragments": 4, "diloco.syncer_shards": shards})
    summary = _run(cfg, tmp_path)
    merges = _read(tmp_path / "merges.jsonl")
    assert {m["fragment"] for m in merges} == {0, 1, 2, 3}
    assert np.isfinite(summary["final_eval_loss"])


def _learners_alive() -> int:
    import gc

    from decoupled_diloco.runtime.learner_loop import LearnerLoop

    gc.collect()
    return sum(isinstance(o, LearnerLoop) for o in gc.get_objects())


@pytest.mark.parametrize("halt_after", [None, 5], ids=["finished", "killed"])
@pytest.mark.slow
def test_a_run_leaves_no_thread_and_no_learner_behind(small_config, tmp_path, halt_after):
    """Every thread a run starts (data readers, outboxes, links and the time on their wire,
    stagers) ends with it, and with them the learners and their device state: a sweep of
    runs in one process (a notebook, the experiment harness, this test suite) would else
    keep every run's state alive until the process exits."""
    cfg = small_config(**{"train.steps": 8, "diloco.learners": 2, "diloco.sync_every": 2,
                          "diloco.fragments": 2, "diloco.overlap": 1,
                          "train.checkpoint_every": 4,
                          "faults.link_latency_s": [0.05, 0.05],
                          "faults.unit": "steps", "faults.crashes": [[1, 3]],
                          "faults.restart_delay_s": 0.2})  # fmt: skip
    before, alive = set(threading.enumerate()), _learners_alive()
    _run(cfg, tmp_path, halt_after=halt_after)
    left = threads_left(before)
    assert left == [] and _learners_alive() == alive


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux: /proc/self/maps")
@pytest.mark.slow
def test_runs_in_one_process_do_not_pile_up_memory_mappings(small_config, tmp_path):
    """What a run compiled and allocated goes with it. A process has at most
    vm.max_map_count (65530) mappings: when every run kept ~1100 (2 learners; a 16-learner
    run ~8000), the 7th run of the learners sweep could not map its executables, and this
    suite's process died of a segfault after some 60 in-process runs."""

    def mappings() -> int:
        import gc

        gc.collect()  # a finished run is unreachable; its reference cycles go here
        with open("/proc/self/maps", encoding="utf-8") as f:
            return sum(1 for _ in f)

    cfg = small_config(**{"train.steps": 4, "diloco.learners": 2, "diloco.sync_every": 2,
                          "diloco.fragments": 2})  # fmt: skip
    counts = []
    for i in range(3):
        _run(cfg, tmp_path / str(i))
        counts.append(mappings())
    assert counts[2] - counts[1] < 200, counts


@pytest.mark.slow
def test_launch_hands_a_finished_runs_learners_back_at_once(small_config, tmp_path):
    """The run's learners sit in reference cycles; `launch.run` collects them before it
    returns, so their device memory is free for the caller's next run (not whenever the
    cyclic collector next runs: it is off here, as it may be for long stretches)."""
    import gc

    from decoupled_diloco.runtime import launch
    from decoupled_diloco.runtime.learner_loop import LearnerLoop

    def learners() -> int:  # without collecting: garbage not yet collected counts
        return sum(isinstance(o, LearnerLoop) for o in gc.get_objects())

    cfg = small_config(**{"train.steps": 4, "diloco.learners": 2, "diloco.sync_every": 2})
    before = _learners_alive()
    gc.disable()
    try:
        launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
        left = learners()
    finally:
        gc.enable()
    assert left == before


@pytest.mark.slow
def test_a_run_whose_evaluation_fails_stops_its_threads_before_it_raises(
    small_config, tmp_path, monkeypatch
):
    """The main thread's own failure (an evaluation of Θ) stops the run as a learner's
    failure does: its learners stop at their next boundary and save, and no thread of the
    run trains on, or holds its state, after the error reached the caller."""
    from decoupled_diloco.runtime import local
    from decoupled_diloco.train.evaluate import Evaluator

    class Failing(Evaluator):
        def __call__(self, params):
            raise RuntimeError("evaluation failed")

    monkeypatch.setattr(local, "Evaluator", Failing)
    cfg = small_config(**{"train.steps": 40, "train.eval_every": 4, "diloco.learners": 2,
                          "diloco.sync_every": 2, "train.checkpoint_every": 4})  # fmt: skip
    before, alive = set(threading.enumerate()), _learners_alive()
    with pytest.raises(RuntimeError, match="evaluation failed"):
        _run(cfg, tmp_path)
    left = threads_left(before)
    assert left == [] and _learners_alive() == alive
    # They stopped early and saved where they stopped (the lead at or past the failed
    # evaluation's step 4; a learner that had taken no step has nothing to save).
    saved = [_final_params(tmp_path, f"learner_{m}")[1]["step"] for m in (0, 1)
             if os.listdir(tmp_path / "checkpoints" / f"learner_{m}")]  # fmt: skip
    assert saved and max(saved) >= 4 and max(saved) < 40, saved


def test_a_learner_that_fails_to_build_leaves_no_thread_behind(small_config, tmp_path, monkeypatch):
    from decoupled_diloco.runtime import local

    class Broken(local.LearnerLoop):
        def __init__(self, m, *args, **kw):
            if m == 1:
                raise RuntimeError("learner 1 cannot be built")
            super().__init__(m, *args, **kw)

    monkeypatch.setattr(local, "LearnerLoop", Broken)
    cfg = small_config(**{"diloco.learners": 2, "diloco.sync_every": 2})
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="cannot be built"):
        _run(cfg, tmp_path)
    assert threads_left(before) == []


EVAL_MANY_BATCHES = """
from decoupled_diloco import cli
cli.xla_flags(8)
import jax, numpy as np
from decoupled_diloco import models, sharding
from decoupled_diloco.data.config import DataConfig
from decoupled_diloco.train.evaluate import Evaluator
cfg = models.get_model_config("tiny")
mesh = sharding.make_mesh(jax.devices()[:8])
rng = np.random.default_rng(0)
batches = [rng.integers(0, 256, (32, 129), dtype=np.int32) for _ in range(100)]
ev = Evaluator(cfg, DataConfig(), mesh, 32, 0, batches)
params = models.init_params(cfg, jax.random.key(0))
print("loss", ev(params))
"""


@pytest.mark.slow
def test_an_evaluation_of_many_batches_on_a_mesh_completes():
    """100 batches of 32 x 128 tokens on 8 CPU devices: launched all at once, XLA:CPU (at
    most 32 programs per device in flight) aborted the process after 60 s ("Termination
    timeout for all reduce"), so a run with train.eval_batches=100 died without a summary
    (the test then takes ~65 s instead of ~8). Run in its own
    process: an abort must fail this test, not end the test run."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", EVAL_MANY_BATCHES], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-1500:]
    values = dict(
        line.split() for line in out.stdout.splitlines() if line[:5] in ("loss ", "first")
    )
    assert np.isfinite(float(values["loss"])) and float(values["loss"]) > 0


@pytest.mark.slow  # (the default suite is kept under ~10 min on 2 cores)
def test_a_lost_ctrl_c_stops_the_run_at_the_next_watch(small_config, tmp_path, monkeypatch):
    """A Ctrl-C whose KeyboardInterrupt a finalizer swallowed (tests/test_cli.py) is pending:
    the main thread's watch raises it, and the run stops as at a Ctrl-C (it trained on)."""
    from decoupled_diloco import cli
    from decoupled_diloco.runtime.learner_loop import RunInterruptedError

    monkeypatch.setattr(cli, "_PENDING_INTERRUPT", threading.Event())
    cli._PENDING_INTERRUPT.set()
    run = config_lib.validate(small_config(**{"train.steps": 400}))
    with pytest.raises(RunInterruptedError, match="interrupted at learner steps"):
        LocalRuntime(run, str(tmp_path), verbose=False).run()
    assert not cli._PENDING_INTERRUPT.is_set()  # handled


@pytest.mark.slow  # (the default suite is kept under ~10 min on 2 cores)
def test_a_ctrl_c_while_the_syncer_saves_its_last_merges_waits_for_them(
    small_config, tmp_path, monkeypatch
):
    """The learners are done and the syncer merges and saves the last offers when the user
    presses Ctrl-C: the run waits for that save and ends as interrupted (the same command
    summarises it), not at once with the syncer's last checkpoint lost."""
    import _thread

    from decoupled_diloco.diloco.syncer import Syncer
    from decoupled_diloco.runtime import launch
    from decoupled_diloco.runtime.learner_loop import RunInterruptedError
    from decoupled_diloco.runtime.syncer_loop import SyncerLoop

    flushing, saved = threading.Event(), threading.Event()
    save, flush = SyncerLoop.save, Syncer.flush

    def slow_final_flush(self, now):
        flushing.set()  # the end of the run's syncer loop: its last merges, then its save
        return flush(self, now)

    def slow_save(self):
        if flushing.is_set():
            time.sleep(1.0)  # the user presses Ctrl-C in here
        out = save(self)
        if flushing.is_set():
            saved.set()
        return out

    def press_ctrl_c():
        if flushing.wait(120):
            _thread.interrupt_main()

    monkeypatch.setattr(Syncer, "flush", slow_final_flush)
    monkeypatch.setattr(SyncerLoop, "save", slow_save)
    over = {"diloco.learners": 2, "diloco.sync_every": 4, "train.steps": 8}
    run = config_lib.validate(small_config(**over))
    threading.Thread(target=press_ctrl_c, daemon=True).start()
    try:
        launch.run(run, str(tmp_path), verbose=False)
        outcome = "finished"
    except RunInterruptedError:
        outcome = "interrupted"
    except KeyboardInterrupt:
        outcome = "stopped at once"
    assert outcome == "interrupted" and saved.is_set()
    # The same command has nothing left to train: it evaluates and summarises, with the
    # goodput and uptime of the attempt that trained (its own are of no training).
    summary = launch.run(run, str(tmp_path), verbose=False)
    assert summary["attempt_learner_steps"] == 0 and summary["accounting_attempt"] == 0
    assert summary["uptime"] == 1.0 and 0.3 < summary["goodput"] <= 1.0, summary
    assert summary["resume_lost_steps"] == 0 and summary["rolled_back_merges"] == 0
    stops = (summary["stopped_attempts"], summary["interrupted_attempts"], summary["failures"])
    assert stops == (1, 0, 0)  # the user's stop, every learner's work saved: not a failure
