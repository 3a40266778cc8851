"""Goodput simulator: analytic cases, model identities, monotonicity, determinism, CLI."""

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from decoupled_diloco.faults import FaultSpec
from decoupled_diloco.simulator import SimParams, simulate
from decoupled_diloco.simulator.core import snapshot_interval_s
from decoupled_diloco.simulator.params import plausible_ranges
from decoupled_diloco.simulator.timeline import fragment_loss
from decoupled_diloco.simulator.trace import drop_failures_while_down

SHORT = SimParams(horizon_days=2.0)
# Timings of a toy CPU run: every number below is exact arithmetic on these.
CPU = SimParams(
    horizon_days=1000.0 / 86400,
    detect_s=0.0,
    reconfig_s=2.0,
    restart_s=0.0,
    restore_s=5.0,
    step_s=3.0,
    checkpoint_interval_s=30.0,
    checkpoint_cost_s=0.0,
    sync_period_s=8.0,
    fragments=4,
)
ONE_CRASH = FaultSpec(crashes=((0, 100.0),), restart_delay_s=20.0)


@pytest.mark.parametrize("method, learners", [("dp", 1), ("elastic_dp", 1), ("decoupled", 4)])
def test_no_failures_means_full_goodput_and_uptime(method, learners):
    p = dataclasses.replace(SHORT, chip_mtbf_years=1e12, step_noise_std=0.0)
    r = simulate(method, 40_000, learners, p)
    assert r.failures == 0
    assert r.goodput == pytest.approx(1.0) and r.uptime == 1.0 and r.downtime_seconds == 0.0


def test_dp_single_crash_exact():
    """Stall from crash to restart + restore; the work since the last checkpoint is lost."""
    r = simulate("dp", 2, 2, CPU, ONE_CRASH)
    horizon = 1000.0
    assert r.failures == 1 and r.downtime_seconds == pytest.approx(20.0 + 5.0)
    lost = 2 * (100.0 % 30.0)  # chip-seconds since the checkpoint at t = 90
    assert r.goodput == pytest.approx((2 * (horizon - 25.0) - lost) / (2 * horizon))


def test_work_lost_is_charged_at_the_efficiency_it_ran_at():
    """A synchronous job of a fast and a 2x slower learner runs at efficiency 0.75 (the fast
    one idles half its steps); the 20 chip-seconds since the checkpoint it loses held 0.75
    of work too (they were subtracted whole, the idle share twice)."""
    spec = FaultSpec(crashes=((0, 100.0),), restart_delay_s=20.0, speed_factors=(1.0, 2.0))
    r = simulate("dp", 2, 2, CPU, spec)
    assert r.sync_efficiency == pytest.approx(0.75)
    lost = 2 * (100.0 % 30.0)
    assert r.goodput == pytest.approx(0.75 * (2 * (1000.0 - 25.0) - lost) / 2000.0)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("checkpoint_cost_s", float("inf"), "checkpoint_cost_s must be finite"),
        ("step_s", float("inf"), "step_s must be finite"),
        ("horizon_days", float("inf"), "horizon_days must be finite"),
        ("slow_factor", float("inf"), "slow_factor must be finite"),
        ("step_noise_std", 1e300, "step_noise_std must be at most 2"),
        ("slow_factor", 1e5, "slow_factor must be at most 10000"),
        ("seed", -5, r"seed must be an integer in \[0, 2\*\*63\)"),  # (wrapped to 2**63 - 5)
        ("fragments", 10**12, "fragments must be at most 10,000"),  # (a MemoryError)
        ("step_s", 1e-300, r"step_s .1e-300 s. leaves .* past the 2\*\*53"),  # (a bad cast)
    ],
)
def test_infinite_or_unlivable_timings_are_refused(field, value, message):
    """They made the goodput NaN (not JSON) or a knob do nothing; an infinite chip MTBF (no
    failures) and replacement time (no spares) stay allowed."""
    with pytest.raises(ValueError, match=message):
        simulate("dp", 4, 4, dataclasses.replace(SHORT, **{field: value}))
    p = dataclasses.replace(SHORT, chip_mtbf_years=float("inf"), replace_s=float("inf"))
    assert simulate("dp", 4, 4, dataclasses.replace(p, step_noise_std=0.0)).goodput > 0.9999


def test_elastic_single_crash_exact():
    """Everyone pauses detect + reconfig; the survivor runs alone; the returned learner is
    re-added once its idle chip-seconds equal the re-add pause's cost (ski rental)."""
    r = simulate("elastic_dp", 2, 2, CPU, ONE_CRASH)
    # back at 120; idle 1 chip * (t - 120) == 1 running chip * 2 s -> pause [122, 124).
    useful = 2 * 100.0 + 1 * (122.0 - 102.0) + 2 * (1000.0 - 124.0) - 2 * (100.0 % 3.0)
    assert r.goodput == pytest.approx(useful / 2000.0)
    assert r.downtime_seconds == pytest.approx(4.0) and r.recoveries == 2


def test_decoupled_single_crash_exact():
    """Only the crashed learner stops; it loses its unmerged work and rejoins after restore."""
    r = simulate("decoupled", 2, 2, CPU, ONE_CRASH)
    lost = fragment_loss(8.0, 4)(100.0)
    assert 0 < lost < 8.0
    assert r.goodput == pytest.approx((2000.0 - (125.0 - 100.0) - lost) / 2000.0)
    assert r.uptime == 1.0 and r.failures == 1


def test_dp_snapshot_stalls_are_lost_work():
    """Cycles of 30 s compute + 2 s snapshot stall: the crash at 100 s (3 cycles = 96 s
    done) loses 100 - 90 s; after the restart at 125 s every cycle loses its 2 s stall."""
    r = simulate("dp", 2, 2, dataclasses.replace(CPU, checkpoint_cost_s=2.0), ONE_CRASH)
    useful = 2 * 90.0 + 2 * (1000.0 - 125.0) * 30.0 / 32.0
    assert r.goodput == pytest.approx(useful / 2000.0)


def test_young_interval_beats_shorter_and_longer_snapshot_intervals():
    """Snapshots every sqrt(2 * cost * MTBF) (Young) balance stalls against rollbacks."""
    p = dataclasses.replace(SHORT, horizon_days=1.0, step_noise_std=0.0, checkpoint_cost_s=2.0)
    young = snapshot_interval_s(p, 1_200_000 / p.chip_mtbf_s)
    assert young == pytest.approx(np.sqrt(2 * 2.0 * p.chip_mtbf_s / 1_200_000))
    g = [
        simulate("dp", 1_200_000, 1, dataclasses.replace(p, checkpoint_interval_s=i)).goodput
        for i in (young / 3, young, 3 * young)
    ]
    assert g[1] > max(g[0], g[2]), g
    assert simulate("dp", 1_200_000, 1, p).goodput == g[1]  # 0 means Young's interval


def test_small_clusters_have_no_repair_floor():
    """A replaced slice is back in replace_s, so with many learners on a small cluster only
    the step-time jitter inside a learner is left; charging the job the slice's 8 h repair
    instead (no spares) takes ~slice_chips * 8 h / MTBF = 5.8% off every elastic cell."""
    p = dataclasses.replace(SHORT, step_noise_std=0.0)
    spares = simulate("decoupled", 150_000, 16, p).goodput
    assert spares > 0.99
    repair = simulate("decoupled", 150_000, 16, dataclasses.replace(p, replace_s=8 * 3600.0))
    assert spares - repair.goodput == pytest.approx(64 * 8 * 3600 / p.chip_mtbf_s, abs=0.01)
    noisy = simulate("decoupled", 150_000, 16, SHORT).goodput  # 1% jitter per slice and step
    assert 0.95 < noisy < spares


def test_every_assumption_is_marked_and_has_a_plausible_range():
    """params.py marks each default as the paper's, sourced, or an assumption; every
    assumption carries the (low, high) range experiments/goodput_sensitivity.py sweeps."""
    ranges = plausible_ranges()
    for f in dataclasses.fields(SimParams):
        if f.metadata["help"].startswith("[assumption"):
            assert f.name in ranges, f.name
        if f.name in ranges:
            low, high = ranges[f.name]
            assert low <= f.default <= high and low < high, (f.name, f.default, ranges[f.name])
    assert {"detect_s", "reconfig_s", "restart_s", "restore_s", "replace_s"} <= ranges.keys()
    assert {"checkpoint_cost_s", "step_noise_std", "chip_mtbf_years"} <= ranges.keys()


def test_syncer_crash_costs_uptime_not_goodput():
    spec = FaultSpec(syncer_crashes=(300.0,), syncer_restart_delay_s=40.0)
    r = simulate("decoupled", 3, 3, CPU, spec)
    assert r.goodput == pytest.approx(1.0) and r.downtime_seconds == pytest.approx(40.0)


def test_syncer_crashes_count_as_failures_as_in_the_run_ledger():
    """The run's ledger counts a syncer crash among its failures (accounting.failure of
    ("syncer", shard)); the simulator left them out (a review found `failures` compared in
    experiments/goodput_failures.py). One inside another's outage never happens (the
    schedule drops it), a zero-delay one still does; DP has no syncer."""
    spec = FaultSpec(crashes=((0, 100.0),), syncer_crashes=(300.0, 320.0, 500.0, 900.0),
                     syncer_restart_delay_s=40.0)  # fmt: skip
    assert simulate("decoupled", 3, 3, CPU, spec).failures == 1 + 3
    instant = dataclasses.replace(spec, syncer_restart_delay_s=0.0)
    assert simulate("decoupled", 3, 3, CPU, instant).failures == 1 + 4
    assert simulate("dp", 3, 3, CPU, spec).failures == 1


def test_a_run_down_throughout_has_uptime_zero_not_below():
    """The syncer is down from 0.03 s to past the 0.3 s horizon: the down pieces summed to
    0.30000000000000004 s and the uptime came out -2.2e-16 (a review found it)."""
    p = dataclasses.replace(CPU, horizon_days=0.3 / 86400)
    spec = FaultSpec(syncer_crashes=(0.03,), syncer_restart_delay_s=10.0,
                     membership=((0, 0.2, float("inf")),))  # fmt: skip
    r = simulate("decoupled", 1, 1, p, spec)
    assert r.uptime == 0.0 and r.downtime_seconds == r.horizon_s == 0.3


@pytest.mark.parametrize("seed", [0, 1])
def test_one_learner_is_exactly_elastic_dp(seed):
    """M = 1, K = 1: the learner is an elastic job over all its units, so every number
    matches, provided that losing *all* units at once costs the same: elastic DP falls back
    to its last checkpoint, a learner to its last offer of each fragment -- identical for
    one fragment offered every checkpoint interval. (With slices, all-dead never happens.)"""
    p = dataclasses.replace(SHORT, seed=seed)
    a = simulate("decoupled", 300_000, 1, p).to_dict()
    b = simulate("elastic_dp", 300_000, 1, p).to_dict()
    assert a.pop("method") == "decoupled" and b.pop("method") == "elastic_dp"
    assert a == b
    spec = FaultSpec(seed=seed, chip_mtbf_hours=0.2, chips_per_learner=4)
    p = dataclasses.replace(CPU, fragments=1, sync_period_s=CPU.checkpoint_interval_s)
    a = simulate("decoupled", 4, 1, p, spec)
    b = simulate("elastic_dp", 4, 1, p, spec)
    assert a.goodput == b.goodput and a.uptime == b.uptime and a.failures == b.failures > 0


def test_m_learners_match_elastic_dp_on_n_over_m_chips():
    """The paper's rule of thumb holds in expectation (learners are independent elastic jobs)."""
    p = dataclasses.replace(SHORT, horizon_days=4.0)
    dec = np.mean(
        [
            simulate("decoupled", 1_200_000, 4, dataclasses.replace(p, seed=s)).goodput
            for s in range(2)
        ]
    )
    ela = np.mean(
        [
            simulate("elastic_dp", 300_000, 1, dataclasses.replace(p, seed=s)).goodput
            for s in range(2)
        ]
    )
    assert abs(dec - ela) < 0.01


def test_goodput_falls_with_chips_and_rises_with_learners():
    chips = (150_000, 600_000, 2_400_000)
    for method, m in [("dp", 1), ("elastic_dp", 1), ("decoupled", 4)]:
        g = [simulate(method, n, m, SHORT).goodput for n in chips]
        assert g[0] > g[1] > g[2], (method, g)
    g = [simulate("decoupled", 1_200_000, m, SHORT).goodput for m in (1, 2, 4, 8, 16)]
    assert all(a < b for a, b in zip(g, g[1:], strict=False)), g
    dp, elastic = (simulate(k, 1_200_000, 1, SHORT).goodput for k in ("dp", "elastic_dp"))
    assert dp < elastic < g[1]


def test_uptime_needs_quorum():
    full = simulate("decoupled", 1_200_000, 4, SHORT)
    strict = simulate("decoupled", 1_200_000, 4, dataclasses.replace(SHORT, quorum=4))
    assert full.uptime > 0.99 > strict.uptime
    assert strict.goodput == full.goodput  # learners never wait for the quorum


def test_determinism_per_seed():
    a = simulate("decoupled", 600_000, 8, SHORT)
    b = simulate("decoupled", 600_000, 8, SHORT)
    c = simulate("decoupled", 600_000, 8, dataclasses.replace(SHORT, seed=1))
    assert a == b and a.goodput != c.goodput


def test_heterogeneous_learners_synchronous_vs_decoupled():
    """4 fast + 4 slow (18%) + 10% noise, no failures: synchronous DP idles the fast ones
    (the paper's K = 8 run: 84%); decoupled learners never wait (100%)."""
    spec = FaultSpec(seed=0, slow_fraction=0.5, slow_factor=1.18, speed_noise=0.1)
    dp = simulate("dp", 8, 8, CPU, spec)
    dec = simulate("decoupled", 8, 8, CPU, spec)
    assert 0.80 < dp.goodput < 0.88 and dec.goodput == 1.0


def test_step_noise_hurts_big_synchronous_jobs_more():
    p = dataclasses.replace(SHORT, chip_mtbf_years=1e12, step_noise_std=0.05, chip_speed_std=0.02)
    dp = simulate("dp", 600_000, 1, p).goodput
    dec = simulate("decoupled", 600_000, 16, p).goodput
    assert dp < dec < 1.0


def test_drop_failures_while_down_matches_brute_force():
    rng = np.random.default_rng(0)
    t = np.sort(rng.uniform(0, 100, 400))
    u = rng.integers(0, 20, 400)
    keep = drop_failures_while_down(t, u, 7.0)
    down_until = {}
    for i in range(len(t)):
        ok = t[i] >= down_until.get(u[i], -np.inf)
        assert keep[i] == ok
        if ok:
            down_until[u[i]] = t[i] + 7.0


def test_failure_count_matches_chip_mtbf():
    r = simulate("dp", 1_200_000, 1, SHORT)
    expected = 1_200_000 * 2 / 365
    assert abs(r.failures - expected) < 5 * np.sqrt(expected)


def test_million_chips_over_weeks_is_fast():
    t0 = time.perf_counter()
    r = simulate("decoupled", 1_200_000, 8, SimParams(horizon_days=28.0))
    assert time.perf_counter() - t0 < 10.0
    assert r.failures > 80_000 and 0.8 < r.goodput < 0.95


@pytest.mark.parametrize(
    "args, key",
    [
        (("bogus", 100, 1, SHORT), "method"),
        (("dp", 100, 3, SHORT), "chips"),
        (("decoupled", 100, 2, dataclasses.replace(SHORT, quorum=3)), "quorum"),
        (("dp", 100, 1, dataclasses.replace(SHORT, restore_s=-1.0)), "restore_s"),
        (("dp", 100, 1, dataclasses.replace(SHORT, slice_chips=0)), "slice_chips"),
        (("dp", 100, 1, dataclasses.replace(SHORT, horizon_days=0.0)), "horizon_days"),
        (("dp", 6, 2, SHORT, FaultSpec(chips_per_learner=2)), "chips_per_learner"),
        # What one process can hold: arrays per chip and per failure.
        (("dp", 10**9, 1, SHORT), "chips .1,000,000,000. above 100,000,000"),
        (
            ("dp", 1_200_000, 1, dataclasses.replace(SHORT, chip_mtbf_years=1e-4)),
            "failures expected .chips x horizon / chip MTBF. above 20,000,000",
        ),
        # A synchronous job's pace with a schedule: arrays per learner (~36 KB each).
        (("dp", 200_000, 200_000, SHORT, FaultSpec()), "learners .200,000. above 100,000"),
        (("elastic_dp", 200_000, 200_000, SHORT, FaultSpec()), "above 100,000 .* ~7 GB"),
    ],
)
def test_bad_input_names_the_key(args, key):
    with pytest.raises(ValueError, match=key):
        simulate(*args)


def test_cli_json():
    cmd = [sys.executable, "-m", "decoupled_diloco.simulate", "--method=decoupled"]
    cmd += ["--chips=1200000", "--learners=8", "--chip_mtbf_years=1", "--seed=3"]
    cmd += ["--horizon_days=2", "--json"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=root)
    result = json.loads(out.stdout)
    assert {"goodput", "uptime", "downtime_seconds", "failures"} <= result.keys()
    assert 0.8 < result["goodput"] < 0.95 and result["uptime"] > 0.99
    assert result["downtime_seconds"] >= 0 and result["failures"] > 5000 and result["seed"] == 3
    spec = '{"seed": 1, "crashes": [[0, 100.0]], "restart_delay_s": 20.0}'
    cmd = [sys.executable, "-m", "decoupled_diloco.simulate", "--method=dp", "--chips=2"]
    cmd += ["--learners=2", f"--fault_spec={spec}", f"--horizon_days={1000 / 86400}"]
    cmd += ["--detect_s=0", "--restart_s=0", "--restore_s=5", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=root)
    assert json.loads(out.stdout)["downtime_seconds"] == pytest.approx(25.0)
    bad = subprocess.run(
        cmd[:-1] + ["--learners=3"], capture_output=True, text=True, env=env, cwd=root
    )
    assert bad.returncode != 0 and "chips" in bad.stderr + bad.stdout
    # The error alone, not every flag's help above it.
    assert bad.stderr.strip().splitlines() == ["error: chips (2) must be divisible by learners (3)"]
    # A flag the method does not read is an error, not a silent no-op.
    bad = subprocess.run(cmd[:-1] + ["--quorum=2"], capture_output=True, text=True, env=env,
                         cwd=root)  # fmt: skip
    assert bad.stderr.strip().splitlines() == [
        "error: --quorum would be ignored with --method=dp: it does not read it"
    ]


# The paper's goodput at 1.2M chips, chip MTBF 1 year (the design brief's reference numbers).
PAPER_1P2M = {
    ("dp", 1): 27.0,
    ("elastic_dp", 1): 58.0,
    ("decoupled", 2): 70.0,
    ("decoupled", 4): 82.0,
    ("decoupled", 8): 88.0,
    ("decoupled", 16): 93.0,
}


@pytest.mark.parametrize("method, learners", list(PAPER_1P2M), ids=lambda x: str(x))
def test_paper_goodput_at_1p2m_chips(method, learners):
    """Regression on the headline table, every parameter at its default: 3 simulated days
    (~14k failures; seed 0: 25.1, 58.5, 73.2, 83.5, 89.7, 93.1, close to the 14-day, 5-seed
    means in experiments/README.md) must stay within 3.5 points of the paper. Nothing in
    SimParams was fitted to these numbers (params.py says where each default comes from)."""
    p = SimParams(horizon_days=3.0, chip_mtbf_years=1.0)
    r = simulate(method, 1_200_000, learners, p)
    assert 100 * r.goodput == pytest.approx(PAPER_1P2M[method, learners], abs=3.5)


def test_a_slow_learner_paces_the_synchronous_job_only_while_it_runs():
    """Learner 0 steps 3x slower. Crashed for good after 10 s of 864, or a member for 100
    s only, it must not set the pace of the whole run (a review found sync_efficiency 0.5
    and 0.625: every learner's factor counted at every time)."""
    p = dataclasses.replace(CPU, horizon_days=0.01, step_s=0.3, reconfig_s=0.0)
    gone = FaultSpec(speed_factors=(3.0, 1.0, 1.0, 1.0), crashes=((0, 10.0),),
                     restart_delay_s=1e5)  # fmt: skip
    r = simulate("elastic_dp", 4, 4, p, gone)
    assert 0.97 < r.sync_efficiency < 0.99  # 10 s of 864 at 6/12, the rest at 3/3
    visiting = FaultSpec(speed_factors=(2.0, 1.0, 1.0, 1.0), membership=((0, 100.0, 200.0),))
    r = simulate("dp", 4, 4, p, visiting)
    assert r.sync_efficiency == pytest.approx((100 * 5 + 764 * 3) / (100 * 8 + 764 * 3), abs=0.01)


@pytest.mark.parametrize("fraction, learners", [(0.5, 1), (0.25, 2), (0.5, 3)])
def test_a_slow_fraction_that_is_no_whole_number_of_learners_is_refused(fraction, learners):
    """Rounded half to even, 0.25 of 2 learners made none slow and 0.75 of 2 both; 0.5 of
    DP's one learner none (a review found the flag silently doing nothing)."""
    p = SimParams(slow_fraction=fraction, slow_factor=1.18, horizon_days=0.01)
    with pytest.raises(ValueError, match=f"slow_fraction \\({fraction}\\) of {learners} learn"):
        simulate("dp", 4 * learners, learners, p)
    with pytest.raises(ValueError, match="faults.slow_fraction of"):
        simulate("dp", learners, learners, SimParams(horizon_days=0.01),
                 FaultSpec(slow_fraction=fraction, slow_factor=1.18))  # fmt: skip
    simulate("dp", 8, 4, dataclasses.replace(p, slow_fraction=0.25))  # one of four: fine


def test_sync_efficiency_of_a_run_shorter_than_a_chip_second():
    """A single slice never waits on another: 1, however short the run (it was divided by
    at least 1 chip-second)."""
    r = simulate("dp", 1, 1, SimParams(horizon_days=1e-6))
    assert r.sync_efficiency == 1.0 and r.goodput > 0.99


def test_cli_refuses_chip_mtbf_flags_with_a_fault_spec():
    """--seed (and the other chip-MTBF knobs) would be silently ignored with --fault_spec,
    whose schedule has its own seed: the CLI says so instead."""
    from decoupled_diloco import simulate as cli

    cli.check_fault_spec_flags(["horizon_days", "restore_s"])  # timings do apply
    with pytest.raises(ValueError, match="--seed would be ignored"):
        cli.check_fault_spec_flags(["seed"])
    with pytest.raises(ValueError, match="--seed, --chip_mtbf_years"):
        cli.check_fault_spec_flags(["chip_mtbf_years", "seed"])
    # What a method does not read with a schedule: each learner is one unit, down from its
    # crash to its restart in the schedule (a review found them silently ignored).
    cli.check_fault_spec_flags(["restart_s", "detect_s", "step_s"], "dp")
    cli.check_fault_spec_flags(["detect_s", "reconfig_s", "step_s"], "elastic_dp")
    cli.check_fault_spec_flags(["step_s", "restore_s"], "decoupled", unit="steps")
    with pytest.raises(ValueError, match="--restart_s would be ignored .* --method=elastic_dp"):
        cli.check_fault_spec_flags(["restart_s"], "elastic_dp")
    with pytest.raises(ValueError, match="--restart_s, --detect_s, --reconfig_s, --step_s"):
        cli.check_fault_spec_flags(["step_s", "reconfig_s", "detect_s", "restart_s"], "decoupled")
    spec = FaultSpec(chip_mtbf_hours=0.2, restart_delay_s=5.0)
    for method, flag in [("elastic_dp", "restart_s"), ("decoupled", "detect_s"),
                         ("decoupled", "reconfig_s"), ("decoupled", "step_s")]:  # fmt: skip
        results = {
            simulate(method, 4, 4, dataclasses.replace(CPU, **{flag: value}), spec).goodput
            for value in (0.01, 200.0)
        }
        assert len(results) == 1, (method, flag)  # so refusing the flag loses nothing
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "decoupled_diloco.simulate", "--method=dp", "--chips=2"]
    cmd += ["--learners=2", '--fault_spec={"seed": 1}', "--seed=3", "--json"]
    bad = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    assert bad.returncode != 0 and "--seed would be ignored with --fault_spec" in bad.stderr


@pytest.mark.parametrize("back, running_again", [(160.0, 170.0), (105.0, 160.0)])
def test_an_elastic_job_that_lost_every_unit_relaunches_as_a_restarted_job_does(
    back, running_again
):
    """Its last unit fails at 100 s: the job runs again restore_s after the unit's
    replacement is back or, if later, detect_s + restart_s after the failure, as a
    non-elastic job (a review found the relaunch added after the replacement, which
    already covers it: elastic DP of one slice fared worse than DP)."""
    from decoupled_diloco.simulator import timeline
    from decoupled_diloco.simulator.trace import BACK, FAIL

    tl = timeline.elastic_timeline(([100.0, back], [FAIL, BACK], [0, 0]), [4], [True], 1000.0,
                                   detect_s=30.0, reconfig_s=5.0, relaunch_s=50.0,
                                   graceful_relaunch_s=20.0, restore_s=10.0, step_s=3.0,
                                   state_loss_s=lambda clock: 0.0)  # fmt: skip
    assert tl.starts == [0.0, running_again] and tl.ends == [100.0, 1000.0]
    p = SimParams(chip_mtbf_years=1e-3, horizon_days=1.0)  # a 64-chip job, ~170 failures
    assert simulate("elastic_dp", 64, 1, p).goodput >= simulate("dp", 64, 1, p).goodput


def test_a_restarting_job_stops_waiting_for_a_crashed_learner_that_leaves():
    """Learner 0 crashes at 100 s (back at 600) and leaves for good at 150: the DP job
    relaunches on the other three then (graceful relaunch + restore), not at 600 (a review
    found the departed learner's return still awaited)."""
    spec = FaultSpec(crashes=((0, 100.0),), restart_delay_s=500.0, membership=((0, 0.0, 150.0),))
    p = dataclasses.replace(CPU, restart_s=2.0)
    r = simulate("dp", 4, 4, p, spec)
    assert r.downtime_seconds == pytest.approx(150.0 + 2.0 + 5.0 - 100.0)
    stays = FaultSpec(crashes=((0, 100.0),), restart_delay_s=500.0)
    assert simulate("dp", 4, 4, p, stays).downtime_seconds == pytest.approx(500.0 + 5.0)


def test_job_that_loses_every_unit_restarts_on_units_already_back():
    """Learner 1 is back but not yet re-added when learner 0 leaves for good: the elastic job
    must restart on learner 1 at once (rejoin = restore_s), not wait for a later event."""
    spec = FaultSpec(crashes=((1, 100.0),), membership=((0, 0.0, 110.0),), restart_delay_s=5.0)
    p = dataclasses.replace(CPU, reconfig_s=50.0)  # the pause after the crash outlasts 110
    r = simulate("elastic_dp", 2, 2, p, spec)
    assert r.downtime_seconds == pytest.approx(115.0 - 100.0)
    useful = 2 * 100.0 - 2 * (100.0 % 3.0) + (1000.0 - 115.0)
    assert r.goodput == pytest.approx(useful / (110.0 + 1000.0))  # learner 0 allocated to 110
