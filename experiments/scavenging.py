r"""Experiment 8 — scavenging: base M = 4, temporarily 8 or 16 learners; wall time to a target loss.

    python experiments/scavenging.py            # 3 arms x seeds 0,1, 200 steps: ~11 min
    python experiments/scavenging.py --quick    # 3 arms, 72 steps, 1 seed: ~2.5 min
    python experiments/scavenging.py --scale=tpu   # TPU slices via Ray (not runnable here)

Runtimes are for an idle 2-core machine (flags: experiments/harness.py).
configs/scavenging.py: learners 0-3 are members throughout; in the "+4" arm learners 4-7
join and leave again during the run, in the "+12" arm learners 4-15 (16 learners share the
8 fake devices); batch 8 per learner. "base" is the same config with M = 4 and no extra
learners. It runs first; the extra learners then join at 20% and leave at 70% of its
measured wall time (mean over seeds), so the window lies inside the run on a fast machine
and a slow one alike. (With --arms naming no base, or --smoke, fixed windows are used:
WINDOWS below.) The global model is evaluated every 10 steps
(--quick: 8) so that the time to the target is read off a dense curve. Target loss = the
base arm's final eval loss (mean over seeds); the table gives each arm's wall time until the
global model's eval loss first reached it (linear interpolation between evaluations).
Caveat at CPU scale: extra learners here share the same 2 cores instead of adding chips,
so they cannot add compute; on TPU they do.
Writes scavenging.{md,png,json} into --out.
"""

import math

import harness
from absl import flags

from decoupled_diloco import cli

harness.define_flags("experiments/results/scavenging", "0,1")
BATCH = {"train.batch_size": 8}  # per learner, as configs/scavenging.py
FULL = harness.FULL | BATCH | {"train.eval_every": 10}
QUICK = harness.QUICK | BATCH | {"train.steps": 72, "train.warmup_steps": 7, "train.eval_every": 8}
WINDOWS = {"full": (20.0, 60.0), "quick": (15.0, 45.0), "smoke": (1.0, 600.0)}  # join, leave s
JOIN, LEAVE = 0.2, 0.7  # fractions of the base arm's wall time


def arms(windows: tuple[float, float] | None = None) -> list[harness.Arm]:
    join, leave = windows or WINDOWS[harness.mode()]
    base = {"diloco.learners": 4, "faults.membership": []}
    out = [harness.Arm("base", "scavenging", base, "base M=4")]
    for extra in (4, 12):
        m = 4 + extra
        member = [(i, join, leave) for i in range(4, m)]
        over = {"diloco.learners": m, "faults.membership": member}
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
    # The time to the base arm's loss, where the base arm ran (--arms may leave it out).
    base = groups.get("base")
    target = harness.stat([r.summary["final_eval_loss"] for r in base])[0] if base else None
    body = []
    for runs in groups.values():
        s = [r.summary for r in runs]
        reach = [time_to(harness.eval_curve(r), target) for r in runs] if base else None
        body.append(
            [
                runs[0].arm.label,
                reach_time(reach) if base else "-",
                harness.fmt([x["final_eval_loss"] for x in s]),
                harness.fmt([x["tokens"] for x in s], 0),
                harness.fmt([x["mean_learners_per_merge"] for x in s], 2),
                harness.fmt([x["wall_seconds"] for x in s], 0),
            ]
        )
    to = f"wall s to loss {target:.3f}" if base else "wall s to the base arm's loss"
    header = ["arm", to, "final eval loss", "tokens",
              "learners / merge", "wall (s)"]  # fmt: skip
    return f"Scavenging ({harness.mode_note()}).\n\n" + harness.table(header, body)


def run(out) -> list:
    """The base arm first, then the others with join/leave placed in its wall time."""
    FLAGS = flags.FLAGS
    names = list(FLAGS.arms)
    if FLAGS.check_configs or harness.mode() == "smoke" or (names and "base" not in names):
        return harness.run_arms(arms, out, QUICK, FULL)
    rest = [n for n in names if n != "base"]
    try:  # --arms selects within each phase; restored afterwards
        FLAGS.arms = ["base"]
        base = harness.run_arms(arms, out, QUICK, FULL)
        if names and not rest:
            return base
        wall = sum(r.summary["wall_seconds"] for r in base) / len(base)
        windows = (round(JOIN * wall, 1), round(LEAVE * wall, 1))
        print(f"extra learners join at {windows[0]} s and leave at {windows[1]} s", flush=True)
        FLAGS.arms = rest
        others = harness.run_arms(lambda: [a for a in arms(windows) if a.name != "base"], out,
                                  QUICK, FULL)  # fmt: skip
    finally:
        FLAGS.arms = names
    return base + others


def main(argv):
    del argv
    import matplotlib.pyplot as plt

    out = harness.setup()
    results = run(out)
    fig, (t, ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    harness.plot_curves(t, results)
    harness.plot_curves(ax, results, x="time")
    base = [r.summary["final_eval_loss"] for r in results if r.arm.name == "base"]
    for a in (t, ax) if base else ():
        a.axhline(harness.stat(base)[0], color="k", ls=":", lw=1)
    fig.suptitle("Scavenging: eval loss vs tokens and vs wall time (dotted: target)")
    harness.write(out, "scavenging", markdown(results), fig, results)


if __name__ == "__main__":
    cli.run_script(main)
