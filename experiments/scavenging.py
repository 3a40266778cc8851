r"""Experiment 8 — scavenging: base M = 4, temporarily 8 or 16 learners; wall time to a target loss.

    python experiments/scavenging.py            # 300 steps, seeds 0,1: ~40 min on 2 busy cores
    python experiments/scavenging.py --quick    # 90 steps, 1 seed: ~6 min
    python experiments/scavenging.py --scale=tpu   # TPU slices via Ray (not runnable here)

configs/scavenging.py: learners 0-3 are members throughout; in the "+4" arm learners 4-7
join at JOIN_S and leave at LEAVE_S of wall time, in the "+12" arm learners 4-15 (16
learners share the 8 fake devices). "base" is the same config with M = 4 and no extra
learners. Target loss = the base arm's final eval loss (mean over seeds); the table gives
each arm's wall time until the global model's eval loss first reached it (linear
interpolation between evaluations). Caveat at CPU scale: extra learners here share the
same 2 cores instead of adding chips, so they cannot add compute; on TPU they do.
Writes scavenging.{md,png,json} into --out.
"""

import math

import harness
from absl import app

harness.define_flags("experiments/results/scavenging", "0,1")
QUICK = {"train.steps": 72, "train.warmup_steps": 7, "train.eval_every": 8, "train.eval_batches": 4}
WINDOWS = {"full": (20.0, 60.0), "quick": (15.0, 45.0), "smoke": (1.0, 600.0)}  # join, leave s


def arms() -> list[harness.Arm]:
    FLAGS = harness.flags.FLAGS
    join, leave = WINDOWS["smoke" if FLAGS.smoke else "quick" if FLAGS.quick else "full"]
    common = {"train.eval_every": 25}
    out = [
        harness.Arm(
            "base",
            "scavenging",
            common | {"diloco.learners": 4, "faults.membership": []},
            "base M=4",
        ),  # fmt: skip
    ]
    for extra in (4, 12):
        m = 4 + extra
        member = [(i, join, leave) for i in range(4, m)]
        over = common | {"diloco.learners": m, "faults.membership": member}
        out.append(harness.Arm(f"plus{extra}", "scavenging", over, f"M=4 + {extra} scavenged"))
    return out


def time_to(curve, target: float) -> float:
    """First wall time at which the eval loss reaches `target`, interpolated (nan: never)."""
    prev = None
    for t, _, loss in curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return t
            (t0, l0) = prev
            return t0 + (t - t0) * (l0 - target) / (l0 - loss)
        prev = (t, loss)
    return float("nan")


def reach_time(times: list[float]) -> str:
    """Mean ± std over the seeds that reached the target, and how many did not."""
    reached = [t for t in times if math.isfinite(t)]
    if not reached:
        return "not reached"
    missed = len(times) - len(reached)
    return harness.fmt(reached, 0) + (f" ({missed} of {len(times)} not reached)" if missed else "")


def markdown(results) -> str:
    groups = harness.by_arm(results)
    target = harness.stat([r.summary["final_eval_loss"] for r in groups["base"]])[0]
    body = []
    for runs in groups.values():
        s = [r.summary for r in runs]
        body.append(
            [
                runs[0].arm.label,
                reach_time([time_to(harness.eval_curve(r), target) for r in runs]),
                harness.fmt([x["final_eval_loss"] for x in s]),
                harness.fmt([x["tokens"] for x in s], 0),
                harness.fmt([x["mean_learners_per_merge"] for x in s], 2),
                harness.fmt([x["wall_seconds"] for x in s], 0),
            ]
        )
    header = ["arm", f"wall s to loss {target:.3f}", "final eval loss", "tokens",
              "learners / merge", "wall (s)"]  # fmt: skip
    return f"Scavenging ({harness.mode_note()}).\n\n" + harness.table(header, body)


def main(argv):
    del argv
    import matplotlib.pyplot as plt

    out = harness.setup()
    results = harness.run_arms(arms(), out, QUICK)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    harness.plot_curves(ax, results, x="time")
    target = harness.stat([r.summary["final_eval_loss"] for r in results if r.arm.name == "base"])
    ax.axhline(target[0], color="k", ls=":", lw=1)
    ax.set_title("Scavenging: eval loss vs wall time (dotted: target)")
    harness.write(out, "scavenging", markdown(results), fig, results)


if __name__ == "__main__":
    app.run(main)
