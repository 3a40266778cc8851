r"""Experiment 10 — goodput under failures: simulator table beside CPU runs under chaos.

    python experiments/goodput_failures.py            # simulator + 2 arms x seeds 0,1: ~14 min
    python experiments/goodput_failures.py --quick    # simulator --quick + 2 runs: ~5 min
    python experiments/goodput_failures.py --scale=tpu   # TPU slices via Ray (not runnable here)

Runtimes are for an idle 2-core machine (flags: experiments/harness.py).
Part 1 runs experiments/goodput_table.py (the simulator at 150k-2.4M chips; --quick: its
--quick) into <out>/simulator and includes its table. Part 2 runs configs/chaos_crashes.py
(Decoupled DiLoCo M = 4 x batch 16, K = 1, and data-parallel at batch 64; the same seeded
crashes hit both) and sets each run's measured goodput beside the simulator's prediction for
the very same FaultSpec (`simulate(..., fault_spec=spec)`), with the run's own step time, H,
P, K, checkpoint interval and wall time as the simulator's timings.
  full     200 steps; 64 chips of 20 min MTBF (a crash every ~19 s), restarts after 6 s,
           DP checkpoints every 50 steps; at most 300 s of wall time per run
  --quick  140 steps; 64 chips of 8 min MTBF (a crash every ~7.5 s), restarts after 4 s,
           DP checkpoints every 40 steps; at most 200 s per run
The wall-clock cap (at --scale=cpu only; --budget_s overrides it) matters for DP: when crashes
come faster than it gets from one checkpoint to the next, it redoes the same steps without end.
Writes goodput_failures.{md,png,json} into --out.
"""

import hashlib
import json
import pathlib
import subprocess
import sys

import harness
import numpy as np

from decoupled_diloco import cli, paths

harness.define_flags("experiments/results/goodput_failures", "0,1")
# Lengths keep configs/chaos_crashes.py's batches (DP: 4x a learner's) and eval set.
FULL = {"train.steps": 200, "train.warmup_steps": 20, "train.eval_every": 25}
QUICK = {
    "train.steps": 140,
    "train.eval_every": 20,
    "train.checkpoint_every": 40,
    "faults.chip_mtbf_hours": 8 / 60,
    "faults.restart_delay_s": 4.0,
}
BUDGET_S = {"full": 300.0, "quick": 200.0, "smoke": 60.0}  # wall-clock cap per run


def budget_s() -> float:
    return harness.run_budget(BUDGET_S)


def arms() -> list[harness.Arm]:
    return [
        harness.Arm("decoupled", "chaos_crashes:decoupled", {}, "Decoupled DiLoCo (M=4, K=1)"),
        harness.Arm("dp", "chaos_crashes:dp", {}, "data-parallel"),
    ]


def step_seconds(r) -> float:
    steps = [x for x in harness.rows(r.rundir, "metrics.jsonl") if x.get("learner") == 0]
    dt = np.diff([x["time"] for x in steps]) / np.maximum(np.diff([x["step"] for x in steps]), 1)
    return float(np.median(dt)) if len(dt) else 0.1


def rejoin_seconds(r, restart_delay_s: float) -> float:
    """Mean time a crashed learner took to train again beyond the schedule's restart delay
    (restore, re-init, first step): the simulator's restore_s."""
    events = harness.rows(r.rundir, "events.jsonl")
    downs = {}
    extra = []
    for e in events:
        if e["event"] == "learner_down":
            downs[e["learner"]] = e["time"]
        elif e["event"] == "rejoin" and e["learner"] in downs:
            extra.append(e["time"] - downs.pop(e["learner"]) - restart_delay_s)
    return max(float(np.mean(extra)), 0.0) if extra else 0.0


def predicted(r) -> dict:
    """The simulator's goodput and uptime for this run's FaultSpec and timings."""
    from decoupled_diloco import faults
    from decoupled_diloco.simulator import SimParams, simulate

    c = r.config  # the config the (possibly cached) run used
    spec = faults.fault_spec_from_dict(c.faults.to_dict())
    step_s = step_seconds(r)
    m = c.diloco.learners
    params = SimParams(
        seed=r.seed,
        horizon_days=r.summary["wall_seconds"] / 86400,
        step_s=step_s,
        detect_s=0.0,
        restart_s=0.0,
        restore_s=rejoin_seconds(r, spec.restart_delay_s),
        checkpoint_interval_s=max(c.train.checkpoint_every, 1) * step_s,
        checkpoint_cost_s=0.0,  # orbax saves asynchronously (~0.05 s, machine-notes.md)
        sync_period_s=max(c.diloco.sync_every, 1) * step_s,
        fragments=c.diloco.fragments,
        quorum=c.diloco.quorum,
    )
    method = "decoupled" if c.diloco.sync_every else "dp"
    res = simulate(method, m * spec.chips_per_learner, m, params, fault_spec=spec)
    return {"goodput": res.goodput, "uptime": res.uptime, "failures": res.failures}


def simulator_table(out: pathlib.Path) -> str:
    sim_out = out / "simulator"
    cmd = [sys.executable, str(pathlib.Path(__file__).parent / "goodput_table.py"),
           f"--out={sim_out}"]  # fmt: skip
    FLAGS = harness.flags.FLAGS
    if not harness.is_full():
        cmd.append("--quick")
    # Reuse the simulator's table only if these very arguments made it with today's code.
    stamp, done = sim_out / "command.json", sim_out / "goodput.md"
    key = {"command": cmd[2:], "code": simulator_fingerprint()}
    try:
        same = json.loads(stamp.read_text()) == key
    except (OSError, ValueError):  # none yet, or damaged
        same = False
    if not (done.exists() and same) or FLAGS.fresh:
        print("simulator:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        paths.write_atomic(stamp, json.dumps(key))
    return done.read_text()


def simulator_fingerprint() -> str:
    """What made the simulator's table besides its arguments: the package (as for the CPU
    runs, harness.code_fingerprint) and the table's scripts."""
    here = pathlib.Path(__file__).parent
    h = hashlib.sha256(harness.code_fingerprint().encode())
    for name in ("goodput_table.py", "goodput_cells.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def markdown(results, sim_md: str) -> tuple[str, dict]:
    body, preds = [], {}
    for name, runs in harness.by_arm(results).items():
        s = [r.summary for r in runs]
        p = [predicted(r) for r in runs]
        preds[name] = p
        body.append(
            [
                runs[0].arm.label,
                harness.fmt([x["goodput"] for x in s], 1, 100),
                harness.fmt([x["goodput"] for x in p], 1, 100),
                harness.fmt([x["uptime"] for x in s], 1, 100),
                harness.fmt([x["uptime"] for x in p], 1, 100),
                harness.fmt([x["failures"] for x in s], 0),
                harness.fmt([x["failures"] for x in p], 0),
                harness.fmt([x["final_eval_loss"] for x in s]),
                harness.fmt([x["steps"] for x in s], 0) + f" / {runs[0].config.train.steps}",
                harness.fmt([x["wall_seconds"] for x in s], 0),
            ]
        )
    header = ["arm", "goodput (%) measured", "goodput (%) simulator", "uptime (%) measured",
              "uptime (%) simulator", "failures", "failures (sim)", "final eval loss",
              "steps done / budget", "wall (s)"]  # fmt: skip
    cap = budget_s()
    stops = (f"its step budget or after {cap:.0f} s of wall time, whichever comes first"
             if cap else "its step budget")  # fmt: skip
    md = (
        "## Simulator (experiments/goodput_table.py)\n\n" + sim_md
        + f"\n## Runs under the chaos schedule ({harness.mode_note()}); a run stops at "
        f"{stops}\n\n" + harness.table(header, body)
    )  # fmt: skip
    return md, preds


def main(argv):
    del argv
    import matplotlib.pyplot as plt

    out = harness.setup()
    results = harness.run_arms(arms, out, QUICK, FULL, budget_s=BUDGET_S)
    sim_md = simulator_table(out)
    md, preds = markdown(results, sim_md)
    groups = harness.by_arm(results)
    names = [g[0].arm.label for g in groups.values()]
    fig, (a, t, b) = plt.subplots(1, 3, figsize=(16, 4.2))
    x = np.arange(len(names))
    meas = [harness.stat([100 * r.summary["goodput"] for r in g])[0] for g in groups.values()]
    sim = [harness.stat([100 * p["goodput"] for p in preds[n]])[0] for n in groups]
    a.bar(x - 0.2, meas, 0.4, label="measured (CPU run)")
    a.bar(x + 0.2, sim, 0.4, label="simulator, same FaultSpec")
    a.set_xticks(x, names, fontsize=8)
    a.set_ylabel("goodput (%)")
    a.set_ylim(0, 105)
    a.legend(fontsize=7)
    a.grid(alpha=0.3, axis="y")
    harness.plot_curves(t, results)
    harness.plot_curves(b, results, x="time")
    fig.suptitle("Goodput under the chaos crash schedule: measured vs simulated")
    harness.write(out, "goodput_failures", md, fig, results)


if __name__ == "__main__":
    cli.run_script(main)
