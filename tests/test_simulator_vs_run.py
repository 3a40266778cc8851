"""The goodput simulator against real runs of the local runtime under the same FaultSpec.

Two small CPU runs, Decoupled DiLoCo (M = 2, K = 1) and data-parallel (restarts from its
last checkpoint), each hit by step-scheduled crashes, are replayed by `simulate(...,
fault_spec=<the run's spec>)` with the timings the run measured: its mean step time, and
the rejoin (restore) time its events show beyond the schedule's restart delay. The
simulator models training time; it has no notion of the runtime's own overheads on a shared
2-core host (compilation stalls, the final checkpoint, thread scheduling), so the measured
side is taken over the learners' training time too: step time plus outages, i.e. the
allocation less the time a learner was neither stepping nor down. What is compared is what
the simulator claims to model: the outage, the work lost with the crashed state (unmerged
fragments; DP's steps since its checkpoint) and the allocation they are charged against.
~50 s on a quiet machine (compilation mostly comes from the persistent cache), so `slow`.
"""

import json
import os

import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.runtime.local import LocalRuntime
from decoupled_diloco.simulator import SimParams, simulate
from decoupled_diloco.simulator.timeline import fragment_loss

STEPS, H, P = 48, 8, 4  # step budget; sync period and fragments (an offer every 2 steps)
RESTART_S = 3.0  # wall seconds from a crash until the learner is back (the schedule's)
TOLERANCE = 0.02  # goodput (fraction) between the run and the simulator


def tiny_config(learners: int, crashes, checkpoint_every: int = 0):
    c = config_lib.default_config()
    c.name = "sim_vs_run"
    c.model.preset = "tiny"
    c.data.seq_len = 64
    c.data.max_corpus_bytes = 300_000
    c.train.batch_size = 8
    c.train.steps = STEPS
    c.train.warmup_steps = 5
    c.train.eval_every = 0
    c.train.log_every = 10
    c.train.checkpoint_every = checkpoint_every
    c.devices_per_learner = 4
    c.diloco.learners = learners
    if learners > 1:
        c.diloco.sync_every, c.diloco.fragments = H, P
        c.diloco.overlap, c.diloco.quorum = 1, 1
    c.faults.seed = 0
    c.faults.unit = "steps"  # a loaded host crashes at the same training point
    c.faults.crashes = crashes
    c.faults.restart_delay_s = RESTART_S
    # Sleep 5/6 of every step: leaves the CPU to others, and keeps an offer's delivery (the
    # outbox thread; a crash drops what it has not sent) well inside a step on a loaded host.
    c.faults.speed_factors = [6.0] * learners
    return config_lib.validate(c)


def run_and_replay(c, workdir, method: str) -> tuple[float, object, object]:
    """(measured goodput over training time, the simulator's result, the run's ledger)."""
    rt = LocalRuntime(c, str(workdir), verbose=False)
    rt.run()
    led = rt.log.ledger
    with open(os.path.join(workdir, "events.jsonl"), encoding="utf-8") as f:
        events = [json.loads(line) for line in f]
    downs = [e for e in events if e["event"] == "learner_down"]
    backs = [e for e in events if e["event"] == "rejoin"]
    assert len(downs) == len(backs) == len(c.faults.crashes), events
    outage = [b["time"] - a["time"] for a, b in zip(downs, backs, strict=True)]
    rejoin_s = max(sum(outage) / len(outage) - RESTART_S, 0.0)

    step_s = sum(led.step_seconds) / sum(led.steps)
    per_step = [s / n for s, n in zip(led.step_seconds, led.steps, strict=True)]
    useful_steps = led.useful_steps if method == "decoupled" else [STEPS]
    useful = sum(u * s for u, s in zip(useful_steps, per_step, strict=True))
    training = sum(led.step_seconds) + sum(outage)  # each learner's steps and outages
    measured = useful / training

    m = len(led.steps)
    params = SimParams(
        horizon_days=training / m / 86400,
        step_s=step_s,
        detect_s=0.0,
        restart_s=0.0,  # the schedule's restart delay is the relaunch
        restore_s=rejoin_s,
        checkpoint_interval_s=max(c.train.checkpoint_every, 1) * step_s,
        checkpoint_cost_s=0.0,  # its saves are runtime overhead, outside training time
        sync_period_s=H * step_s,
        fragments=P,
    )
    spec = c.faults
    sim = simulate(method, m * spec.chips_per_learner, m, params, fault_spec=spec)
    return measured, sim, led


@pytest.mark.slow
def test_decoupled_run_matches_the_simulator_under_the_same_crashes(tmp_path):
    c = tiny_config(2, [[0, 16], [1, 32]])
    measured, sim, led = run_and_replay(c, tmp_path, "decoupled")
    assert led.failures == sim.failures == 2
    # The work each crash took with it (steps whose fragments had not reached a merge) is
    # what the simulator's fragment-loss model says: per fragment, the steps since its
    # last offer (fragments offered every H steps, staggered by H / P).
    lost = sum(STEPS - u for u in led.useful_steps)
    predicted = sum(fragment_loss(float(H), P)(float(step)) for _, step in c.faults.crashes)
    assert predicted > 4 and lost == pytest.approx(predicted, abs=1.5)
    assert 0.5 < measured < 0.95  # the crashes cost a visible share of the training time
    assert sim.goodput == pytest.approx(measured, abs=TOLERANCE)


@pytest.mark.slow
def test_data_parallel_run_matches_the_simulator_under_the_same_crashes(tmp_path):
    # One crash: the simulator places step k of a schedule at k * step_s, which after an
    # outage no longer is where a restarted job reaches step k.
    c = tiny_config(1, [[0, 20]], checkpoint_every=15)
    measured, sim, led = run_and_replay(c, tmp_path, "dp")
    assert led.failures == sim.failures == 1 and led.steps[0] == STEPS + 5  # redid 16..20
    assert 0.3 < measured < 0.9
    assert sim.goodput == pytest.approx(measured, abs=TOLERANCE)
