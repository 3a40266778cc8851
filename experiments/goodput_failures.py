r"""Experiment 10 — goodput under failures: simulator table beside CPU runs under chaos.

    python experiments/goodput_failures.py            # simulator 5 seeds + 300-step runs: ~20 min
    python experiments/goodput_failures.py --quick    # simulator --quick + 140-step runs: ~6 min
    python experiments/goodput_failures.py --scale=tpu   # TPU slices via Ray (not runnable here)

Part 1 runs experiments/goodput_table.py (the simulator at 150k-2.4M chips) into
<out>/simulator and includes its table. Part 2 runs configs/chaos_crashes.py (Decoupled
DiLoCo M = 4, K = 1 and data-parallel; 64 chips of 20 min MTBF, the same seeded crashes)
and sets each run's measured goodput beside the simulator's prediction for the very same
FaultSpec (`simulate(..., fault_spec=spec)`), with the run's own step time, H, P, K,
checkpoint interval and wall time as the simulator's timings. --quick uses the shorter,
crashier settings of experiments/chaos_crashes.py --quick.
Writes goodput_failures.{md,png,json} into --out.
"""

import pathlib
import subprocess
import sys

import harness
import numpy as np
from absl import app

harness.define_flags("experiments/results/goodput_failures", "0,1")
# As experiments/chaos_crashes.py --quick: 64 chips of 8 min MTBF fail every ~7.5 s.
QUICK = {
    "train.steps": 140,
    "train.eval_every": 20,
    "train.checkpoint_every": 40,
    "faults.chip_mtbf_hours": 8 / 60,
    "faults.restart_delay_s": 4.0,
}
REJOIN_S = 2.0  # restore + first step of a restarted learner (s), taken as the sim's restore_s


def arms() -> list[harness.Arm]:
    return [
        harness.Arm("decoupled", "chaos_crashes:decoupled", {}, "Decoupled DiLoCo (M=4, K=1)"),
        harness.Arm("dp", "chaos_crashes:dp", {}, "data-parallel"),
    ]


def step_seconds(r) -> float:
    steps = [x for x in harness.rows(r.rundir, "metrics.jsonl") if x.get("learner") == 0]
    dt = np.diff([x["time"] for x in steps]) / np.maximum(np.diff([x["step"] for x in steps]), 1)
    return float(np.median(dt)) if len(dt) else 0.1


def predicted(r) -> dict:
    """The simulator's goodput and uptime for this run's FaultSpec and timings."""
    from decoupled_diloco import faults
    from decoupled_diloco.simulator import SimParams, simulate

    c = harness.build_config(r.arm, r.seed, "cpu", harness.length_overrides(QUICK))
    spec = faults.fault_spec_from_dict(c.faults.to_dict())
    step_s = step_seconds(r)
    m = c.diloco.learners
    params = SimParams(
        seed=r.seed,
        horizon_days=r.summary["wall_seconds"] / 86400,
        step_s=step_s,
        detect_s=0.0,
        restart_s=0.0,
        restore_s=REJOIN_S,
        checkpoint_interval_s=max(c.train.checkpoint_every, 1) * step_s,
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
    if FLAGS.quick or FLAGS.smoke:
        cmd.append("--quick")
    if not (sim_out / "goodput.md").exists() or FLAGS.fresh:
        print("simulator:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return (sim_out / "goodput.md").read_text()


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
                harness.fmt([x["wall_seconds"] for x in s], 0),
            ]
        )
    header = ["arm", "goodput (%) measured", "goodput (%) simulator", "uptime (%) measured",
              "uptime (%) simulator", "failures", "failures (sim)", "final eval loss",
              "wall (s)"]  # fmt: skip
    md = (
        "## Simulator (experiments/goodput_table.py)\n\n" + sim_md
        + f"\n## CPU runs under the chaos schedule ({harness.mode_note()})\n\n"
        + harness.table(header, body)
    )  # fmt: skip
    return md, preds


def main(argv):
    del argv
    import matplotlib.pyplot as plt

    out = harness.setup()
    sim_md = simulator_table(out)
    results = harness.run_arms(arms(), out, QUICK)
    md, preds = markdown(results, sim_md)
    groups = harness.by_arm(results)
    names = [g[0].arm.label for g in groups.values()]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
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
    harness.plot_curves(b, results, x="time")
    fig.suptitle("Goodput under the chaos crash schedule: measured vs simulated")
    harness.write(out, "goodput_failures", md, fig, results)


if __name__ == "__main__":
    app.run(main)
