r"""Experiment 2 — number of learners M in {2, 4, 8, 16}: quality and goodput at equal tokens.

    python experiments/learners_sweep.py            # 5 arms x seeds 0,1, 200 steps: ~18 min
    python experiments/learners_sweep.py --quick    # 5 arms, 48 steps, 1 seed: ~2.5 min
    python experiments/learners_sweep.py --scale=tpu   # TPU slices via Ray (not runnable here)

Runtimes are for an idle 2-core machine (flags: experiments/harness.py). Every arm processes
64 (--quick: 32) sequences x 128 tokens per step in total (DP: one learner; M learners:
64 / M each), so at equal steps all see equal tokens (not under --smoke, whose batch every
learner takes), and all are scored on the same held-out sequences (256; --quick 64).
Decoupled arms are configs/tiny_decoupled.py (K = 1, grace, token weights, RDA) with M
learners; M <= 8 get 8 / M fake devices each, M = 16 shares the 8 devices round-robin
(devices_per_learner=1).
Writes learners_sweep.{md,png,json} into --out (default experiments/results/learners_sweep).
"""

import harness

from decoupled_diloco import cli

harness.define_flags("experiments/results/learners_sweep", "0,1")
# The simulator's goodput at 1.2M chips, chip MTBF 1 year (design.md §4), for reference.
PAPER_GOODPUT = {2: 0.70, 4: 0.82, 8: 0.88, 16: 0.93}


def total_batch() -> int:
    """Sequences per step summed over learners (every arm): 64, --quick 32."""
    return 64 if harness.is_full() else 32


def arms() -> list[harness.Arm]:
    out = [
        harness.Arm(
            "dp",
            "tiny_dense_4x",
            {"train.batch_size": total_batch()},
            "data-parallel",
        )
    ]
    for m in (2, 4, 8, 16):
        over = {
            "diloco.learners": m,
            "devices_per_learner": max(8 // m, 1),
            "train.batch_size": total_batch() // m,
        }
        out.append(harness.Arm(f"M{m}", "tiny_decoupled", over, f"Decoupled M={m}"))
    return out


def markdown(results) -> str:
    groups = harness.by_arm(results)
    body = []
    for name, runs in groups.items():
        s = [r.summary for r in runs]
        losses = [x["final_eval_loss"] for x in s]
        ratio = harness.loss_ratio(runs, groups.get("dp", []))
        m = runs[0].arm.overrides.get("diloco.learners", 1)
        body.append(
            [
                runs[0].arm.label,
                harness.fmt(losses),
                harness.fmt(ratio, 3) if name != "dp" else "1",
                harness.fmt([x["mean_learners_per_merge"] for x in s], 2) if name != "dp" else "-",
                harness.fmt([x["goodput"] for x in s], 1, 100),
                f"{100 * PAPER_GOODPUT[m]:.0f}" if m in PAPER_GOODPUT else "-",
                harness.fmt([x["tokens"] for x in s], 0),
                harness.fmt([x["wall_seconds"] for x in s], 0),
            ]
        )
    header = ["arm", "final eval loss", "ratio to DP", "learners / merge", "goodput (%)",
              "paper goodput @1.2M chips (sim)", "tokens", "wall (s)"]  # fmt: skip
    tokens = harness.tokens_per_run(results)
    if harness.equal_tokens(results) is not None:  # (not under --smoke: see equal_tokens)
        tokens = f"{total_batch()} sequences per step in total for every arm, {tokens}"
    return (
        f"Number of learners ({harness.mode_note()}); {tokens}; no faults, so goodput here "
        "is only the merge accounting.\n\n" + harness.table(header, body)
    )


def main(argv):
    del argv
    import matplotlib.pyplot as plt

    out = harness.setup()
    results = harness.run_arms(arms, out)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    harness.plot_curves(a, results)
    groups = harness.by_arm(results)
    harness.plot_bars(
        b, [g[0].arm.label for g in groups.values()],
        [[r.summary["final_eval_loss"] for r in g] for g in groups.values()], "final eval loss",
    )  # fmt: skip
    harness.start_below_lowest(b, [r.summary["final_eval_loss"] for r in results], 0.95)
    fig.suptitle("Number of learners at equal tokens")
    harness.write(out, "learners_sweep", markdown(results), fig, results)


if __name__ == "__main__":
    cli.run_script(main)
