r"""Does Decoupled DiLoCo train as well as synchronous DiLoCo? The quality targets, checked.

    python experiments/quality_targets.py --scale=mid   # the 31M `mid` model (a GPU: ~30 min, est.)
    python experiments/quality_targets.py               # tiny CPU scale, 10 arms x 2 seeds: ~31 min
    python experiments/quality_targets.py --set=data.source=shakespeare   # another corpus

The few arms the targets compare (M = 4 learners, equal tokens), each run for --seeds:

  dp              one learner, the whole batch
  streaming_sync  Streaming DiLoCo, synchronous: P = 6, K = M, τ = 0, learners wait for
                  every merge, plain mean, uniform weights, outer lr 1.0 (DiLoCo's)
  decoupled       configs/tiny_decoupled.py as shipped: K = 1, grace, token weights, RDA,
                  never waits (τ = 2), mixing α = 0.5 (since 2026-11-26; the arm before:
                  --set=diloco.alpha=0.0), outer lr 0.75 without momentum (since 2026-11-27;
                  before: 1.0, the arm decoupled_lr1), learners land on merges
                  (`diloco.apply` "land", since 2026-11-28; before: the arm decoupled_rebase)
  decoupled_km    the same with quorum K = M
  decoupled_nag   the same as `decoupled` with DiLoCo's outer Nesterov (lr 0.7, momentum 0.9),
                  which needs that mixing when learners never wait (README, "How outer lr
                  and momentum relate to M, K, P and H")
  streaming_sync_nag  streaming_sync with DiLoCo's outer Nesterov (no mixing: DiLoCo as
                  published): what the outer step costs without any asynchrony
  decoupled_mom   `decoupled` with Nesterov momentum 0.5 at half its lr (0.375): the same
                  steady-state step per round of work, lr / (1 − μ), as `decoupled`'s
                  (README, "How outer lr and momentum relate to M, K, P and H")
  streaming_sync_mom  streaming_sync with momentum 0.5 at its own step: (0.5, 0.5), the twin
                  of decoupled_mom
  decoupled_lr1   `decoupled` with outer lr 1.0, synchronous DiLoCo's step and the shipped one
                  until 2026-11-27 (experiments/README.md, section 0; not a target)
  decoupled_rebase  `decoupled` with `diloco.apply` "rebase", the steps since an offer carried
                  on top of its merge: the shipped rule until 2026-11-28 (not a target)

and prints each target with its measured value and whether it is met (ratios per seed,
then averaged; seed spread = (max − min) / mean of the final eval loss). Targets (issue 12):
  every scale  seed spread of `decoupled` ≤ 1% of its loss
  mid          decoupled ≤ 1.02x streaming_sync and ≤ 1.05x dp; decoupled_km within 1% of
               decoupled; outer momentum >= 0.5 no worse than momentum 0: decoupled_mom
               and decoupled_nag each no worse than decoupled
  cpu          decoupled ≤ 1.03x streaming_sync; decoupled_nag ≤ 1.05x streaming_sync
Also printed, without a threshold: decoupled_nag ÷ streaming_sync_nag and decoupled_mom ÷
streaming_sync_mom (the asynchrony's cost under each momentum outer step), and
streaming_sync_nag ÷ streaming_sync, streaming_sync_mom ÷ streaming_sync (each outer step's
own cost at this length, without asynchrony), decoupled_lr1 and decoupled_rebase ÷
streaming_sync and ÷ decoupled. (The synchronous arms rebase: with τ = 0 the rules are the
same, and that keeps their bits.)
Lengths: 300 steps at batch 16 per learner on CPU (the quality ladder's), 1000 steps at
32 x 256 tokens per learner with --scale=mid (arm_config.MID).
"""

import arm_config
import harness
from absl import flags
from arm_config import LADDER_FULL, LADDER_QUICK

from decoupled_diloco import cli

harness.define_flags("experiments/results/quality_targets", "0,1")

M = 4
# Synchronous Streaming DiLoCo, with synchronous DiLoCo's outer step (lr 1.0; tiny_decoupled's
# 0.75 costs a learner that takes the whole merge 1.1%: experiments/README.md, section 0).
SYNC = {"diloco.quorum": M, "diloco.overlap": 0, "diloco.max_wait": -1.0,
        "diloco.grace_gamma": 0.0, "diloco.weights": "uniform", "diloco.merge": "mean",
        "diloco.embedding_merge": "mean", "diloco.alpha": 0.0,
        "diloco.outer_lr": 1.0, "diloco.apply": "rebase"}  # fmt: skip
NESTEROV = {"diloco.outer_lr": 0.7, "diloco.outer_momentum": 0.9}
MIX = {"diloco.alpha": 0.5}  # learners take half of each merge's move (diloco/learner.py)
SYNC_STEP = SYNC["diloco.outer_lr"]
WHOLE_STEP = {"diloco.outer_lr": 1.0}  # the decoupled arm with synchronous DiLoCo's step


def momentum_half(step: float) -> dict:
    """Nesterov momentum 0.5 with the same steady-state step lr / (1 − μ) as an arm's
    (lr `step`, momentum 0)."""
    return {"diloco.outer_lr": step * 0.5, "diloco.outer_momentum": 0.5}


def arms() -> list[harness.Arm]:
    b = (LADDER_FULL if harness.is_full() else LADDER_QUICK)["train.batch_size"]
    base = {"diloco.learners": M, "devices_per_learner": 2, "train.batch_size": b}
    return [
        harness.Arm("dp", "tiny_dense", {"train.batch_size": M * b}, "data-parallel"),
        harness.Arm("streaming_sync", "tiny_decoupled", base | SYNC, "Streaming, synchronous"),
        harness.Arm("decoupled", "tiny_decoupled", base, "Decoupled K=1 (tiny_decoupled)"),
        harness.Arm(
            "decoupled_km", "tiny_decoupled", base | {"diloco.quorum": M}, "Decoupled K=M"
        ),  # fmt: skip
        harness.Arm(
            "decoupled_nag",
            "tiny_decoupled",
            base | NESTEROV | MIX,
            "Decoupled K=1, outer (0.7, 0.9), alpha 0.5",
        ),  # fmt: skip
        harness.Arm(
            "streaming_sync_nag",
            "tiny_decoupled",
            base | SYNC | NESTEROV,
            "Streaming, synchronous, outer (0.7, 0.9)",
        ),  # fmt: skip
        harness.Arm(
            "decoupled_mom",
            "tiny_decoupled",
            base | momentum_half(arm_config.shipped_outer_lr()),
            "Decoupled K=1, outer momentum 0.5, the same step",
        ),  # fmt: skip
        harness.Arm(
            "streaming_sync_mom",
            "tiny_decoupled",
            base | SYNC | momentum_half(SYNC_STEP),
            "Streaming, synchronous, outer (0.5, 0.5)",
        ),  # fmt: skip
        harness.Arm(
            "decoupled_lr1",
            "tiny_decoupled",
            base | WHOLE_STEP,
            "Decoupled K=1, outer lr 1.0",
        ),  # fmt: skip
        harness.Arm(
            "decoupled_rebase",
            "tiny_decoupled",
            base | {"diloco.apply": "rebase"},
            "Decoupled K=1, apply=rebase",
        ),  # fmt: skip
    ]


def spread(runs) -> float | None:
    """(max − min) / mean of the final eval loss over seeds; None for one seed."""
    losses = [r.summary["final_eval_loss"] for r in runs]
    return (max(losses) - min(losses)) / harness.stat(losses)[0] if len(losses) > 1 else None


def targets(groups: dict) -> list[tuple[str, list[float] | float, str, bool]]:
    """(target, measured: per-seed ratios or one number, threshold, met) for this scale."""

    def ratio(a: str, b: str) -> list[float]:
        return harness.loss_ratio(groups[a], groups[b])

    mean = lambda values: harness.stat(values)[0]  # noqa: E731
    out = []
    s = spread(groups["decoupled"]) if "decoupled" in groups else None
    if s is not None:
        out.append(("seed spread of decoupled", s, "≤ 0.01", s <= 0.01))
    mid = flags.FLAGS.scale == "mid"
    checks = [  # (numerator, denominator, threshold, comparison)
        ("decoupled", "streaming_sync", 1.02 if mid else 1.03, "max"),
        ("decoupled_nag", "streaming_sync", None if mid else 1.05, "max"),
        ("decoupled", "dp", 1.05 if mid else None, "max"),
        ("decoupled_km", "decoupled", 0.01 if mid else None, "within"),
        ("decoupled_nag", "decoupled", 1.0 if mid else None, "max"),
        ("decoupled_mom", "decoupled", 1.0 if mid else None, "max"),
        ("decoupled_nag", "streaming_sync_nag", None, "max"),
        ("decoupled_mom", "streaming_sync_mom", None, "max"),
        ("streaming_sync_nag", "streaming_sync", None, "max"),
        ("streaming_sync_mom", "streaming_sync", None, "max"),
        ("decoupled_lr1", "streaming_sync", None, "max"),
        ("decoupled_lr1", "decoupled", None, "max"),
        ("decoupled_rebase", "streaming_sync", None, "max"),
        ("decoupled_rebase", "decoupled", None, "max"),
    ]
    for a, b, limit, kind in checks:
        if a not in groups or b not in groups or not ratio(a, b):
            continue
        r = ratio(a, b)
        if limit is None:
            out.append((f"{a} ÷ {b}", r, "(no target at this scale)", True))
        elif kind == "within":
            out.append((f"{a} ÷ {b}", r, f"within 1 ± {limit}", abs(mean(r) - 1) <= limit))
        else:
            out.append((f"{a} ÷ {b}", r, f"≤ {limit}", mean(r) <= limit))
    return out


def per_seed(runs, key: str, digits: int) -> str:
    """A summary figure per seed, e.g. `mean_offer_steps` (steps of work per merged offer: H
    while offers leave on schedule, more when they waited for a late merge of their
    fragment), `mean_merge_delay_steps` (from an offer to the boundary applying its merge:
    τ when merges come back in time), `mean_offer_seconds` (from an offer to its merge) or
    `lock_wait_ms` (how late a thread of the run's process ran Python again,
    runtime/gil.py). "-" where a seed's is 0 or missing (data-parallel has no merges;
    synchronous arms apply each merge at its offer's own step: no delay)."""
    values = [r.summary.get(key) for r in runs]
    return "-" if not all(values) else " / ".join(f"{v:.{digits}f}" for v in values)


def markdown(results) -> str:
    groups = harness.by_arm(results)
    dp = groups.get("dp", [])
    arms_rows = [
        [runs[0].arm.label, harness.fmt([r.summary["final_eval_loss"] for r in runs]),
         harness.fmt(harness.loss_ratio(runs, dp), 4),
         "-" if spread(runs) is None else f"{spread(runs):.3f}",
         per_seed(runs, "mean_offer_steps", 1), per_seed(runs, "mean_merge_delay_steps", 1),
         per_seed(runs, "mean_offer_seconds", 2), per_seed(runs, "lock_wait_ms", 2)]
        for runs in groups.values()
    ]  # fmt: skip
    target_rows = [
        [name, f"{value:.4f}" if isinstance(value, float) else harness.fmt(value, 4),
         " / ".join(f"{v:.4f}" for v in value) if isinstance(value, list) else "-", limit,
         "-" if "no target" in limit else ("met" if ok else "**not met**")]
        for name, value, limit, ok in targets(groups)
    ]  # fmt: skip
    note = (
        f"Quality targets ({harness.mode_note()}); {harness.tokens_per_run(results)}; eval loss "
        "in nats per token on the same held-out sequences.\n\n"
    )
    header = ["arm", "final eval loss", "÷ DP", "seed spread", "steps per offer",
              "merge delay (steps)", "offer to merge (s)", "lock wait (ms)"]  # fmt: skip
    arm_table = harness.table(header, arms_rows)
    header = ["target", "measured (mean)", "per seed", "threshold", "verdict"]
    return note + arm_table + "\n" + harness.table(header, target_rows)


def main(argv):
    del argv
    import matplotlib.pyplot as plt

    out = harness.setup()
    results = harness.run_arms(arms, out, quick=LADDER_QUICK, full=LADDER_FULL)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    harness.plot_curves(axes[0], results)
    axes[0].set_title("eval loss vs tokens")
    groups = harness.by_arm(results)
    names = [n for n in groups if n != "streaming_sync"]
    refs = groups.get("streaming_sync", [])
    harness.plot_bars(axes[1], names, [harness.loss_ratio(groups[n], refs) for n in names],
                      "final eval loss ÷ synchronous streaming",
                      harness.arm_colors(results, names))  # fmt: skip
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set_title("each arm against synchronous Streaming DiLoCo")
    fig.suptitle("Decoupled DiLoCo against its synchronous twin, at equal tokens")
    harness.write(out, "quality_targets", markdown(results), fig, results)


if __name__ == "__main__":
    cli.run_script(main)
