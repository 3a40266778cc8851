r"""Experiment 7 — fragmentation: layer vs tensor vs balanced and P; quality and per-step bandwidth.

    python experiments/fragmentation.py            # 4 arms x seeds 0,1, 200 steps: ~17 min
    python experiments/fragmentation.py --quick    # 3 arms (P = 5), 48 steps, 1 seed: ~2 min
    python experiments/fragmentation.py --scale=tpu   # TPU slices via Ray (not runnable here)
    python experiments/fragmentation.py --plan_only   # the gemma_2b plans alone: seconds

Runtimes are for an idle 2-core machine (flags: experiments/harness.py).
configs/tiny_decoupled.py (M = 4, K = 1, H = 12) with a 4-block model (so that strided
layer groups exist) and `diloco.fragment_strategy` in layer | tensor | balanced at P = 5,
plus (full mode) balanced at P = 10: the P axis (the embedding is always its own fragment).
Bandwidth per learner step:
  plan      from the fragment plan: the fp32 bytes of the fragments due at each of the
            H step offsets (offer + reply, one learner); peak and mean over a period.
  measured  merges.jsonl bytes_in + bytes_out binned by wall time into windows of one
            median learner step; peak (99th percentile, robust to bursts after stalls)
            and mean per window, over the middle 80% of the run.
The paper: equal quality for all three; balanced has the flattest bandwidth (peak ≈ mean).
Writes fragmentation.{md,png,json} into --out.

The paper's own setting, gemma_2b at P = H = 24 (one fragment due per step), is planned from
abstract shapes (nothing is allocated or run): per strategy the planned traffic per step,
with the balanced plan's embedding whole (as before it took part in the packing: 5.4x the
mean at its step) and in row slices over several fragments (diloco/fragment_members.py).
Writes fragmentation_plan.{md,png} (also with --plan_only, which runs nothing else).
"""

import harness
import numpy as np
from absl import flags

from decoupled_diloco import cli

harness.define_flags("experiments/results/fragmentation", "0,1")
flags.DEFINE_bool("plan_only", False, "Only the gemma_2b plans at P = 24 (no runs): seconds.")
STRATEGIES = ("layer", "tensor", "balanced")
PLAN_PRESET, PLAN_P = "gemma_2b", 24  # the paper's setting: P = H = 24


def arms() -> list[harness.Arm]:
    settings = [(s, 5) for s in STRATEGIES] + ([("balanced", 10)] if harness.is_full() else [])
    out = []
    for s, p in settings:
        over = {"model.num_layers": 4, "diloco.fragments": p, "diloco.fragment_strategy": s}
        out.append(harness.Arm(f"{s}_P{p}", "tiny_decoupled", over, f"{s}, P={p}"))
    return out


def plan_bandwidth(r) -> tuple[float, float, list[float]]:
    """(peak, mean, per-offset) fp32 bytes per learner step from the run's fragment plan."""

    from decoupled_diloco import config as config_lib
    from decoupled_diloco import models
    from decoupled_diloco.diloco.fragments import model_plan

    run = config_lib.validate(r.config)  # the config the (possibly cached) run used
    shapes = models.flatten_params(models.param_shapes(run.model))
    return _per_step(model_plan(run.model, run.diloco), shapes)


def _per_step(plan, shapes) -> tuple[float, float, list[float]]:
    per_step = [0.0] * plan.sync_every
    for size, offset in zip(plan.fragment_bytes(shapes), plan.offsets, strict=True):
        per_step[offset] += 2 * size  # fp32 offer + reply (fragment_bytes: 4 bytes/element)
    return max(per_step), sum(per_step) / len(per_step), per_step


def gemma_plans() -> dict[str, tuple[float, float, list[float], int]]:
    """Label -> (peak, mean, per-step bytes, embedding fragments) of gemma_2b at P = H = 24,
    from abstract shapes."""

    from decoupled_diloco import models
    from decoupled_diloco.diloco.fragments import make_fragment_plan

    cfg = models.get_model_config(PLAN_PRESET)
    flat = models.flatten_params(models.param_shapes(cfg))
    shapes = {k: tuple(v.shape) for k, v in flat.items()}
    out = {}
    # (tensor cannot plan P = 24 here: gemma_2b has 12 tensor kinds besides the embedding)
    arms = [("layer", "layer", False), ("balanced, embedding whole", "balanced", False),
            ("balanced, embedding in row slices", "balanced", True)]  # fmt: skip
    for label, strategy, split in arms:
        plan = make_fragment_plan(shapes, PLAN_P, strategy, PLAN_P, split_embedding=split)
        out[label] = (*_per_step(plan, shapes), len(plan.embedding_fragments))
    return out


def write_plans(out) -> None:
    """fragmentation_plan.{md,png}: gemma_2b's planned traffic per step at P = 24."""
    import matplotlib.pyplot as plt

    plans = gemma_plans()
    body = [[label, str(k), f"{peak / 1e6:.0f}", f"{mean / 1e6:.0f}", f"{peak / mean:.2f}"]
            for label, (peak, mean, _, k) in plans.items()]  # fmt: skip
    header = ["plan", "embedding fragments", "peak MB/step", "mean MB/step", "peak/mean"]
    text = (
        f"Planned traffic of {PLAN_PRESET} (2.61e9 parameters) at P = H = {PLAN_P}: one "
        "learner's offer + reply bytes (fp32) per step, from abstract shapes.\n\n"
        + harness.table(header, body)
    )
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, (_, _, per_step, _)) in enumerate(plans.items()):
        ax.step(range(len(per_step)), [x / 1e6 for x in per_step], where="mid", color=f"C{i}",
                label=label)  # fmt: skip
    ax.set_xlabel("step within a sync period (offset)")
    ax.set_ylabel("MB per learner step (offer + reply, fp32)")
    ax.set_title(f"{PLAN_PRESET}, P = {PLAN_P}: planned traffic per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "fragmentation_plan.png", dpi=120)
    plt.close(fig)
    (out / "fragmentation_plan.md").write_text(text)
    print(text, flush=True)


def measured_bandwidth(r) -> tuple[float, float]:
    """(peak, mean) bytes per one-step window, all learners, from merges.jsonl."""
    merges = harness.rows(r.rundir, "merges.jsonl")
    steps = [x for x in harness.rows(r.rundir, "metrics.jsonl") if x.get("learner") == 0]
    dts = np.diff([x["time"] for x in steps]) / np.maximum(np.diff([x["step"] for x in steps]), 1)
    if len(merges) < 3 or len(dts) == 0:
        return float("nan"), float("nan")
    step_s = float(np.median(dts))
    t = np.array([x["time"] for x in merges])
    b = np.array([x["bytes_in"] + x["bytes_out"] for x in merges], dtype=float)
    lo, hi = np.quantile(t, [0.1, 0.9])
    edges = np.arange(lo, hi + step_s, step_s)
    if len(edges) < 2:
        return float("nan"), float("nan")
    hist, _ = np.histogram(t, bins=edges, weights=b)
    return float(np.quantile(hist, 0.99)), float(hist.mean())


def markdown(results) -> tuple[str, dict]:
    body, plans = [], {}
    for name, runs in harness.by_arm(results).items():
        s = [r.summary for r in runs]
        peak, mean, per_step = plan_bandwidth(runs[0])
        plans[name] = per_step
        meas = [measured_bandwidth(r) for r in runs]
        body.append(
            [
                runs[0].arm.label,
                harness.fmt([x["final_eval_loss"] for x in s]),
                f"{peak / 1e3:.0f}",
                f"{mean / 1e3:.0f}",
                f"{peak / mean:.2f}",
                harness.fmt([p / 1e3 for p, _ in meas], 0),
                harness.fmt([m / 1e3 for _, m in meas], 0),
                harness.fmt([p / m for p, m in meas], 2),
            ]
        )
    header = ["arm", "final eval loss", "plan peak kB/step", "plan mean kB/step",
              "plan peak/mean", "measured peak kB/step", "measured mean kB/step",
              "measured peak/mean"]  # fmt: skip
    note = (
        f"Fragmentation, 4-block tiny model, M = 4, H = 12 ({harness.mode_note()}). Plan "
        "columns: one learner's offer + reply bytes (fp32) per step; measured: all learners, "
        "per wall-time window of one median step.\n\n"
    )
    return note + harness.table(header, body), plans


def main(argv):
    del argv
    import matplotlib.pyplot as plt

    out = harness.setup()
    if flags.FLAGS.plan_only:
        write_plans(out)
        return
    results = harness.run_arms(arms, out)
    # (after run_arms: --check_configs runs and writes nothing, here nor in the published
    # folder, and a typo in --arms or --set leaves no folder)
    write_plans(out)
    table, plans = markdown(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, per_step) in enumerate(plans.items()):
        a.step(range(len(per_step)), [x / 1e3 for x in per_step], where="mid", color=f"C{i}",
               label=name)  # fmt: skip
    a.set_xlabel("step within a sync period (offset)")
    a.set_ylabel("kB per learner step (offer + reply, fp32)")
    a.grid(alpha=0.3)
    a.legend(fontsize=7)
    harness.plot_curves(b, results)
    fig.suptitle("Fragmentation: bandwidth per step and quality")
    harness.write(out, "fragmentation", table, fig, results)


if __name__ == "__main__":
    cli.run_script(main)
