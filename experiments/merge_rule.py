r"""Experiment 5 — merge rule: plain mean vs RDA (mean on the embedding fragment), M = 8 and 16.

    python experiments/merge_rule.py            # 8 arms x seeds 0,1, 200 steps: ~27 min
    python experiments/merge_rule.py --quick    # 8 arms, 48 steps, 1 seed: ~3 min
    python experiments/merge_rule.py --scale=tpu   # TPU slices via Ray (not runnable here)

Runtimes are for an idle 2-core machine (flags: experiments/harness.py).
configs/tiny_decoupled.py with M = 8 learners x batch 8 or M = 16 x batch 4 (64 sequences
per step either way; one fake device each, 16 learners share the 8 devices), K = 1, grace,
token weights. Arms differ in `diloco.merge` ("mean" or "rda"; the embedding fragment is
merged by the mean in both) and in `diloco.weights` (the paper's token weights
c_tokens^2 / c_steps, or uniform). The paper: RDA beats plain averaging at M = 8 and 16
(plain averaging of nearly orthogonal outer gradients shrinks the update by ~1/sqrt(n)).
Writes merge_rule.{md,png,json} into --out (default experiments/results/merge_rule).
"""

import harness

from decoupled_diloco import cli

harness.define_flags("experiments/results/merge_rule", "0,1")


def arms() -> list[harness.Arm]:
    out = []
    for m in (8, 16):
        for weights in ("tokens", "uniform"):
            for rule in ("mean", "rda"):
                over = {
                    "diloco.learners": m,
                    "devices_per_learner": 1,
                    "train.batch_size": 64 // m,
                    "diloco.merge": rule,
                    "diloco.embedding_merge": "mean",
                    "diloco.weights": weights,
                }
                name = f"M{m}_{rule}" + ("_uniform" if weights == "uniform" else "")
                label = f"M={m}, {rule}" + (", uniform weights" if weights == "uniform" else "")
                out.append(harness.Arm(name, "tiny_decoupled", over, label))
    return out


def markdown(results) -> str:
    groups = harness.by_arm(results)
    body = []
    for name, runs in groups.items():
        s = [r.summary for r in runs]
        base = groups.get(name.replace("_rda", "_mean"), [])
        losses = [x["final_eval_loss"] for x in s]
        diff = harness.paired(runs, base, lambda a, b: a.summary["final_eval_loss"]
                              - b.summary["final_eval_loss"])  # fmt: skip
        norms = [x["delta_norm"] for r in runs for x in harness.rows(r.rundir, "merges.jsonl")
                 if "delta_norm" in x]  # fmt: skip
        body.append(
            [
                runs[0].arm.label,
                harness.fmt(losses),
                harness.fmt(diff) if "_rda" in name else "-",
                harness.fmt([x["mean_learners_per_merge"] for x in s], 2),
                f"{sum(norms) / len(norms):.3f}" if norms else "-",
                harness.fmt([x["wall_seconds"] for x in s], 0),
            ]
        )
    header = ["arm", "final eval loss", "RDA − mean", "learners / merge",
              "mean ‖Δ‖ per merge", "wall (s)"]  # fmt: skip
    return f"Merge rule ({harness.mode_note()}).\n\n" + harness.table(header, body)


def main(argv):
    del argv
    import matplotlib.pyplot as plt

    out = harness.setup()
    results = harness.run_arms(arms, out)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    harness.plot_curves(a, results)
    groups = list(harness.by_arm(results).values())
    harness.plot_bars(b, [g[0].arm.label for g in groups],
                      [[r.summary["final_eval_loss"] for r in g] for g in groups],
                      "final eval loss")  # fmt: skip
    harness.start_below_lowest(b, [r.summary["final_eval_loss"] for r in results], 0.97)
    fig.suptitle("Merge rule: plain mean vs radial-directional averaging")
    harness.write(out, "merge_rule", markdown(results), fig, results)


if __name__ == "__main__":
    cli.run_script(main)
