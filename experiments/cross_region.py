r"""Experiment 9 — cross-region: learners behind slow, high-latency links; wall time, bandwidth.

    python experiments/cross_region.py                # 4 arms x seeds 0,1, 200 steps: ~12 min
    python experiments/cross_region.py --quick        # 4 arms, 48 steps x batch 8, 1 seed: ~1.5 min
    python experiments/cross_region.py --step_s=1.0   # the step time of the bandwidth table
    python experiments/cross_region.py --scale=tpu    # TPU slices via Ray (not runnable here)

Runtimes are for an idle 2-core machine (flags: experiments/harness.py).
Measured arms: data-parallel (configs/tiny_dense_4x.py, M x the learners' batch per step),
Decoupled DiLoCo with every learner next to the syncer, and configs/cross_region.py (2
learners 150 ms / 10 Mbit/s away) in fp32 and int4. DP itself is run on one machine; its
cross-region wall time is modelled: measured DP wall + steps x (ring all-reduce bytes /
far bandwidth + 2 (M−1) x far latency).
Bandwidth each method needs, per learner (DP: per replica), at a step time of --step_s:
  DP        ring all-reduce of fp32 gradients every step: 2 (M−1)/M x 4 N bytes
  Decoupled every fragment offered and received once per H steps: 2 x b x N / H bytes
            (b = 4 fp32, 2 bf16, 0.5 int4)
computed for the tiny model (M = 4, H = 12) and for gemma_2b at the paper's setting
(M = 4, H = 24); measured = the run's bytes_communicated / (learners x steps).
The paper: 1.7 vs 104 Gbit/s at a 1 s step. Writes cross_region.{md,png,json} into --out.
"""

import harness
from absl import flags

from decoupled_diloco import cli

harness.define_flags("experiments/results/cross_region", "0,1")
flags.DEFINE_float("step_s", 1.0, "Step time (s) at which the bandwidth table is computed.")
flags.register_validator("step_s", lambda s: 0 < s < float("inf"), "--step_s: seconds, > 0")
M = 4
FAR_LATENCY_S, FAR_BPS = 0.15, 10e6  # configs/cross_region.py FAR
PARAMS = {"tiny": (139_840, 12), "gemma_2b": (2_614_636_800, 24)}  # (N, H)
WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int4": 0.5}


def arms() -> list[harness.Arm]:
    learner_batch = (harness.FULL if harness.is_full() else harness.QUICK)["train.batch_size"]
    near = {"faults.link_latency_s": [], "faults.link_bandwidth_bps": []}
    return [
        harness.Arm(
            "dp", "tiny_dense_4x", {"train.batch_size": M * learner_batch}, "data-parallel"
        ),  # fmt: skip
        harness.Arm("near", "cross_region", near, "Decoupled, all near"),
        harness.Arm("far", "cross_region", {}, "Decoupled, 2 far (fp32)"),
        harness.Arm(
            "far_int4", "cross_region", {"diloco.compression": "int4"}, "Decoupled, 2 far (int4)"
        ),  # fmt: skip
    ]


def dp_bytes(n: int, m: int = M) -> float:
    return 2 * (m - 1) / m * 4 * n


def bandwidth_table(step_s: float) -> str:
    body = []
    for model, (n, h) in PARAMS.items():
        cells = [f"{dp_bytes(n) * 8 / step_s / 1e9:.3g}"]
        cells += [f"{2 * b * n / h * 8 / step_s / 1e9:.3g}" for b in WIRE_BYTES.values()]
        body.append([f"{model} ({n:,} params, H={h})"] + cells)
    body.append(["paper (1 s step)", "104", "-", "-", "1.7"])
    header = ["model", "DP fp32"] + [f"Decoupled {w}" for w in WIRE_BYTES]
    return (
        f"Bandwidth needed per learner (Gbit/s, in + out) at a {step_s:g} s step, M = {M}:\n\n"
        + harness.table(header, body)
    )


def markdown(results, step_s: float) -> str:
    body = []
    for name, runs in harness.by_arm(results).items():
        s = [r.summary for r in runs]
        per_step = [x["bytes_communicated"] / (x["learners"] * x["steps"]) for x in s]
        if name == "dp":  # (the model the arm trained: tiny, `mid` or --set model.*)
            per_step = [dp_bytes(harness.param_count(r)) for r in runs]
            comm = [b * 8 / FAR_BPS + 2 * (M - 1) * FAR_LATENCY_S for b in per_step]
            model = [x["wall_seconds"] + x["steps"] * c for x, c in zip(s, comm, strict=True)]
            wall = harness.fmt(model, 0)
        else:
            wall = "-"
        body.append(
            [
                runs[0].arm.label,
                harness.fmt([x["final_eval_loss"] for x in s]),
                harness.fmt([x["wall_seconds"] for x in s], 0),
                wall,
                harness.fmt([b / 1e3 for b in per_step], 1),
                harness.fmt([b * 8 / step_s / 1e9 for b in per_step], 5),
                harness.fmt([x.get("mean_learners_per_merge", 0) for x in s], 2),
            ]
        )
    header = ["arm", "final eval loss", "wall (s), measured", "wall (s), DP across regions "
              "(model)", "kB / learner step", f"Gbit/s at {step_s:g} s step",
              "learners / merge"]  # fmt: skip
    return (
        f"Cross-region ({harness.mode_note()}); DP bytes are the ring all-reduce model.\n\n"
        + harness.table(header, body)
        + "\n"
        + bandwidth_table(step_s)
    )


def main(argv):
    del argv
    import matplotlib.pyplot as plt

    out = harness.setup()
    results = harness.run_arms(arms, out)
    fig, (t, a, b) = plt.subplots(1, 3, figsize=(16, 4.2))
    harness.plot_curves(t, results)
    harness.plot_curves(a, results, x="time")
    labels = ["DP fp32"] + [f"Decoupled {w}" for w in WIRE_BYTES]
    n, h = PARAMS["gemma_2b"]
    gbps = [dp_bytes(n) * 8 / flags.FLAGS.step_s / 1e9]
    gbps += [2 * w * n / h * 8 / flags.FLAGS.step_s / 1e9 for w in WIRE_BYTES.values()]
    b.bar(labels, gbps, color=[f"C{i}" for i in range(len(labels))])
    b.set_yscale("log")
    b.set_ylabel(f"Gbit/s per learner at a {flags.FLAGS.step_s:g} s step (gemma_2b)")
    b.grid(alpha=0.3, axis="y")
    fig.suptitle("Cross-region: eval loss vs wall time; bandwidth needed")
    harness.write(out, "cross_region", markdown(results, flags.FLAGS.step_s), fig, results)


if __name__ == "__main__":
    cli.run_script(main)
