r"""Experiment 3 — quorum K in {1, M/2, M} x grace on/off x gamma: merge sizes, goodput, quality.

    python experiments/quorum_grace.py            # 6 arms x seeds 0,1, 200 steps: ~20 min
    python experiments/quorum_grace.py --quick    # 5 arms, 48 steps x batch 8, 1 seed: ~2 min
    python experiments/quorum_grace.py --scale=tpu   # TPU slices via Ray (not runnable here)

Runtimes are for an idle 2-core machine (flags: experiments/harness.py).
configs/tiny_decoupled.py (M = 4 learners x 2 fake devices, P = 6, H = 12, tau = 2) with
the heterogeneous speeds of the paper (half the learners 18% slower, 10% per-step noise)
so that waiting for a quorum costs something. Arms: K = 1 with gamma in {0, 0.5, 1}
(--quick: {0, 1}), K = M/2 with gamma in {0, 1}, and K = M. With K < M learners never wait
(max_wait = 0): K only decides how many fresh offers a merge needs; the grace window then
keeps collecting for gamma x the slack of the tau overlap steps. K = M is the synchronous
baseline: learners wait at t + tau until the merge is there (max_wait = -1, the design
brief's timing rule), so its goodput shows the cost of waiting for the slowest learner; a
round then closes only when every live learner has offered, so grace adds nothing there.
Writes quorum_grace.{md,png,json} into --out (default experiments/results/quorum_grace).
"""

import harness

from decoupled_diloco import cli

harness.define_flags("experiments/results/quorum_grace", "0,1")
M = 4
SPEEDS = {"faults.slow_fraction": 0.5, "faults.slow_factor": 1.18, "faults.speed_noise": 0.10}


def arms() -> list[harness.Arm]:
    full = harness.is_full()
    out = []
    for k in (1, M // 2):
        for g in (0.0, 0.5, 1.0) if full and k == 1 else (0.0, 1.0):
            over = SPEEDS | {"diloco.quorum": k, "diloco.grace_gamma": g, "diloco.max_grace": 2.0}
            label = f"K={k}, " + (f"grace γ={g:g}" if g else "no grace")
            out.append(harness.Arm(f"K{k}_g{g:g}", "tiny_decoupled", over, label))
    over = SPEEDS | {"diloco.quorum": M, "diloco.grace_gamma": 0.0, "diloco.max_wait": -1.0}
    out.append(harness.Arm(f"K{M}", "tiny_decoupled", over, f"K={M} (all, synchronous)"))
    return out


def merge_stats(r) -> tuple[float, float]:
    """Mean quorum wait and mean grace (s) over the run's merges."""
    merges = harness.rows(r.rundir, "merges.jsonl")
    if not merges:
        return float("nan"), float("nan")
    n = len(merges)
    return sum(x["quorum_wait"] for x in merges) / n, sum(x["grace"] for x in merges) / n


def markdown(results) -> str:
    body = []
    for runs in harness.by_arm(results).values():
        s = [r.summary for r in runs]
        waits = [merge_stats(r) for r in runs]
        body.append(
            [
                runs[0].arm.label,
                harness.fmt([x["mean_learners_per_merge"] for x in s], 2),
                harness.fmt([x["merges"] for x in s], 0),
                harness.fmt([w for w, _ in waits], 2),
                harness.fmt([g for _, g in waits], 2),
                harness.fmt([x["goodput"] for x in s], 1, 100),
                harness.fmt([x["final_eval_loss"] for x in s]),
                harness.fmt([x["wall_seconds"] for x in s], 0),
            ]
        )
    header = ["arm", "learners / merge", "merges", "quorum wait (s)", "grace (s)",
              "goodput (%)", "final eval loss", "wall (s)"]  # fmt: skip
    return (
        f"Quorum and grace, M = {M}, half the learners 18% slower + 10% noise "
        f"({harness.mode_note()}).\n\n" + harness.table(header, body)
    )


def main(argv):
    del argv
    import matplotlib.pyplot as plt

    out = harness.setup()
    results = harness.run_arms(arms, out)
    groups = list(harness.by_arm(results).values())
    names = [g[0].arm.label for g in groups]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    harness.plot_bars(a, names, [[r.summary["mean_learners_per_merge"] for r in g] for g in groups],
                      "learners per merge")  # fmt: skip
    harness.plot_bars(b, names, [[r.summary["final_eval_loss"] for r in g] for g in groups],
                      "final eval loss")  # fmt: skip
    harness.start_below_lowest(b, [r.summary["final_eval_loss"] for r in results], 0.97)
    fig.suptitle(f"Quorum K and grace window (M = {M}, heterogeneous speeds)")
    harness.write(out, "quorum_grace", markdown(results), fig, results)


if __name__ == "__main__":
    cli.run_script(main)
