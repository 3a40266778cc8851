r"""Experiment 4 — heterogeneous learners (4 fast + 4 18% slower): K = M vs K = 1 vs K = 1 + grace.

    python experiments/heterogeneous.py            # 3 arms x seeds 0,1, 200 steps: ~11 min
    python experiments/heterogeneous.py --quick    # 60 steps, 1 seed: ~2 min
    python experiments/heterogeneous.py --scale=tpu   # TPU slices via Ray (not runnable here)

Runtimes are for an idle 2-core machine (flags: experiments/harness.py).
The three arms of configs/heterogeneous.py (8 learners x batch 8, one fake CPU device each):
sync (K = 8 and max_wait = -1: learners wait at t + tau for every merge, the synchronous
baseline), k1 (K = 1, no grace), k1_grace (K = 1 + grace, gamma 1). The paper: 84% / 100% /
100% goodput, and the grace window recovers the quality K = 1 loses.
Writes heterogeneous.{md,png,json} into --out.
"""

import harness

from decoupled_diloco import cli

harness.define_flags("experiments/results/heterogeneous", "0,1")
QUICK = harness.QUICK | {"train.steps": 60, "train.warmup_steps": 6, "train.eval_every": 20}
BATCH = {"train.batch_size": 8}  # per learner: 8 learners see 64 sequences per step
PAPER = {"sync": ("84", "reference"), "k1": ("100", "worse"), "k1_grace": ("100", "= K=8")}
LABELS = {"sync": "K=8 (synchronous)", "k1": "K=1, no grace", "k1_grace": "K=1 + grace"}


def arms() -> list[harness.Arm]:
    return [harness.Arm(a, f"heterogeneous:{a}", BATCH, LABELS[a]) for a in PAPER]


def markdown(results) -> str:
    body = []
    for name, runs in harness.by_arm(results).items():
        s = [r.summary for r in runs]
        body.append(
            [
                LABELS[name],
                harness.fmt([x["goodput"] for x in s], 1, 100),
                PAPER[name][0],
                harness.fmt([x["mean_learners_per_merge"] for x in s], 2),
                harness.fmt([x["final_eval_loss"] for x in s]),
                PAPER[name][1],
                harness.fmt([x["tokens"] for x in s], 0),
                harness.fmt([x["wall_seconds"] for x in s], 0),
            ]
        )
    header = ["arm", "goodput (%)", "paper goodput (%)", "learners / merge", "final eval loss",
              "paper quality", "tokens", "wall (s)"]  # fmt: skip
    return f"Heterogeneous learners ({harness.mode_note()}).\n\n" + harness.table(header, body)


def main(argv):
    del argv
    import matplotlib.pyplot as plt

    out = harness.setup()
    results = harness.run_arms(arms, out, QUICK)
    groups = list(harness.by_arm(results).values())
    names = [g[0].arm.label for g in groups]
    fig, (a, b, t, c) = plt.subplots(1, 4, figsize=(18, 4.2))
    harness.plot_bars(a, names, [[100 * r.summary["goodput"] for r in g] for g in groups],
                      "goodput (%)")  # fmt: skip
    a.axhline(84, color="k", ls=":", lw=1, label="paper K=8: 84%")
    a.legend(fontsize=7)
    harness.plot_bars(b, names, [[r.summary["mean_learners_per_merge"] for r in g] for g in groups],
                      "learners per merge")  # fmt: skip
    harness.plot_curves(t, results)
    harness.plot_curves(c, results, x="time")
    fig.suptitle("Heterogeneous learners: 4 fast + 4 slow (18%), 10% noise")
    harness.write(out, "heterogeneous", markdown(results), fig, results)


if __name__ == "__main__":
    cli.run_script(main)
