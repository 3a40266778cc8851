r"""Experiment 1 — quality at equal tokens: DP vs DiLoCo vs Streaming vs Decoupled DiLoCo.

    pip install -e .   # once
    python experiments/quality_equal_tokens.py            # 11 arms x seeds 0,1, 200 steps: ~35 min
    python experiments/quality_equal_tokens.py --quick    # 11 arms, 48 steps, 1 seed: ~4 min
    python experiments/quality_equal_tokens.py --arms=dp,decoupled_m4,dp_moe,decoupled_moe_m4
    python experiments/quality_equal_tokens.py --scale=tpu   # TPU slices (not runnable here)
    python experiments/quality_equal_tokens.py --arms=dp,decoupled_m4,decoupled_m8 \
        --inner_lrs=0.003,0.006,0.012 --out=experiments/results/quality_lr_sweep  # ~20 min

With --inner_lrs every arm runs at each peak inner lr, and a second table compares each arm
at its best lr with its family's DP at DP's best lr: short CPU runs are far from converged,
so a method that effectively takes larger steps (RDA amplifies the consensus direction of
diverse offers; merges of fewer learners move Θ further) can look better or worse than DP
for its step size rather than for the method. Tuning each arm's lr separates the two.

Runtimes are for an idle 2-core machine; shared flags (--seeds, --set, --fresh, ...) are in
experiments/harness.py. Every arm processes 64 sequences (--quick: 32) x 128 tokens of the
Python stdlib corpus per step in total, for 200 steps (--quick: 48), so all see equal tokens
at equal steps and share the learning-rate schedule; all are scored on the same 256 held-out
sequences (--quick: 64). Decoupled, DiLoCo and Streaming arms are scored on the global
(syncer) model; each run's seed also seeds its data order.

Dense (the tiny Gemma-style model), each family's ratio is to its own data-parallel run:
  dp              configs/tiny_dense_4x.py: one learner over 8 devices, the whole batch
  diloco          configs/tiny_diloco.py: M = 4, P = 1, K = M, synchronous, plain mean
  streaming       configs/tiny_streaming.py: M = 4, P = 6, K = M, tau = 1, alpha = 0.5
  decoupled_m2/4/8  configs/tiny_decoupled.py: M = 2, 4, 8 (K = 1, grace, token weights, RDA)
  decoupled_m4_mean the same at M = 4 with the plain mean and uniform weights
MoE (the same with model.preset = tiny_moe: 4 experts, top-2, every layer):
  dp_moe          configs/tiny_moe.py at the whole batch
  diloco_moe, streaming_moe   tiny_diloco / tiny_streaming with the MoE model
  decoupled_moe_m4            configs/tiny_moe_decoupled.py (M = 4)
Writes into --out:
  quality_equal_tokens.md    final eval loss per arm (mean ± sample std over seeds), ratio to
                             its family's DP (per seed, then averaged), merges, bytes per token
  quality_equal_tokens.json  every summary;  quality_equal_tokens.png  eval loss vs tokens

Bytes per token, each byte counted once when it crosses between learners (or replicas) and
the syncer; traffic inside one learner's mesh exists in every method and is not counted.
DiLoCo family: the syncer's offers in + replies out, over all tokens of all learners
(summary `bytes_per_token`). DP over the same 4 groups of devices as replicas: a ring
all-reduce of fp32 gradients every step moves 2·(N−1)/N·S bytes out of each of N replicas
(S = 4 bytes x params), i.e. 2·(N−1)·S per step for the step's tokens.
"""

import math

import harness
from absl import flags

from decoupled_diloco import cli

harness.define_flags("experiments/results/quality_equal_tokens", "0,1")
flags.DEFINE_list(
    "inner_lrs",
    [],
    "Peak inner AdamW lrs to sweep: every arm runs at each (arm@lr<value>), and a table of "
    "each arm's best lr is added, its ratio taken to its family's DP at DP's best lr.",
)
DP_REPLICAS = 4  # DP's all-reduce is modelled over the device groups of the M = 4 learners
FAMILIES = {"dense": ("", "tiny_dense_4x"), "moe": ("_moe", "tiny_moe")}  # suffix, DP config


def total_batch() -> int:
    """Sequences per step summed over learners, in every arm: 64 (--quick 32), i.e. the
    mode's per-learner batch for M = 4 learners."""
    return 4 * (harness.FULL if harness.is_full() else harness.QUICK)["train.batch_size"]


def arms() -> list[harness.Arm]:
    out = []
    b = total_batch()
    for family, (sfx, dp_config) in FAMILIES.items():
        moe = {"model.preset": "tiny_moe"} if family == "moe" else {}
        tag = "MoE " if family == "moe" else ""
        four = {"train.batch_size": b // 4}
        out += [
            harness.Arm(
                f"dp{sfx}", dp_config, {"train.batch_size": b}, f"{tag}data-parallel", family
            ),  # fmt: skip
            harness.Arm(
                f"diloco{sfx}", "tiny_diloco", moe | four, f"{tag}DiLoCo (P=1, K=M)", family
            ),  # fmt: skip
            harness.Arm(
                f"streaming{sfx}",
                "tiny_streaming",
                moe | four,
                f"{tag}Streaming DiLoCo (P=6, K=M)",
                family,
            ),  # fmt: skip
        ]
        for m in (2, 4, 8) if family == "dense" else (4,):
            over = {"diloco.learners": m, "devices_per_learner": 8 // m, "train.batch_size": b // m}
            config = "tiny_moe_decoupled" if family == "moe" else "tiny_decoupled"
            out.append(harness.Arm(f"decoupled{sfx}_m{m}", config, over,
                                   f"{tag}Decoupled DiLoCo (M={m})", family))  # fmt: skip
        if family == "dense":  # the paper's merge (RDA, token weights) vs the plain mean
            plain = {"diloco.merge": "mean", "diloco.weights": "uniform"}
            out.append(harness.Arm("decoupled_m4_mean", "tiny_decoupled", four | plain,
                                   "Decoupled DiLoCo (M=4), mean, uniform weights",
                                   family))  # fmt: skip
    lrs = [float(x) for x in flags.FLAGS.inner_lrs]
    if not lrs:
        return out
    return [
        harness.Arm(
            f"{a.name}@lr{lr:g}",
            a.config,
            a.overrides | {"train.learning_rate": lr},
            f"{a.label}, lr {lr:g}",
            a.model,
        )
        for a in out
        for lr in lrs
    ]


def base_name(arm_name: str) -> str:
    """`decoupled_m4@lr0.006` -> `decoupled_m4` (the arm without its swept lr)."""
    return arm_name.split("@lr")[0]


def best_runs(results) -> dict[str, list]:
    """Base arm -> the runs of its swept lr with the lowest mean final eval loss."""
    best: dict[str, tuple[float, list]] = {}
    for name, runs in harness.by_arm(results).items():
        mean = harness.stat([r.summary["final_eval_loss"] for r in runs])[0]
        # A diverged lr (nan: a seed's loss is nan) is never best while another lr is finite:
        # nan < x is False, so a nan met first would otherwise stay "best" for good.
        mean = mean if math.isfinite(mean) else math.inf
        if base_name(name) not in best or mean < best[base_name(name)][0]:
            best[base_name(name)] = (mean, runs)
    return {base: runs for base, (_, runs) in best.items()}


def best_lr_table(results) -> str:
    """Per arm, its best swept lr; ratio to its family's DP at DP's own best lr (per seed,
    then averaged): every method at its tuned lr."""
    best = best_runs(results)
    body = []
    for runs in best.values():
        dp = best.get("dp" + FAMILIES[runs[0].arm.model][0], [])
        losses = [r.summary["final_eval_loss"] for r in runs]
        body.append(
            [
                runs[0].arm.label.rsplit(", lr", 1)[0],
                f"{runs[0].config.train.learning_rate:g}",
                harness.fmt(losses),
                harness.fmt(harness.loss_ratio(runs, dp), 4),
            ]
        )
    header = ["arm", "best inner lr", "final eval loss", "ratio to its DP at DP's best lr"]
    return "\n\nEach arm at its best swept inner lr:\n\n" + harness.table(header, body)


def dp_allreduce_bytes_per_token(params: int, replicas: int, tokens_per_step: int) -> float:
    """Ring all-reduce of fp32 gradients across `replicas`, every byte counted once.

    Each replica sends 2·(N−1)/N·S bytes per step (reduce-scatter + all-gather, S = 4·params),
    so N replicas move 2·(N−1)·S per step while processing `tokens_per_step` tokens in all.
    """
    return 2 * (replicas - 1) * 4 * params / tokens_per_step if replicas > 1 else 0.0


def param_count(r) -> int:
    import jax

    from decoupled_diloco import config as config_lib
    from decoupled_diloco import models

    model = config_lib.validate(r.config).model
    abstract = models.param_shapes(model)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))


def markdown(results) -> str:
    groups = harness.by_arm(results)
    body = []
    for runs in groups.values():
        arm, s = runs[0].arm, [r.summary for r in runs]
        # In an lr sweep, the ratio is to the family's DP at the same lr.
        dp_name = "dp" + FAMILIES[arm.model][0] + arm.name[len(base_name(arm.name)) :]
        params = param_count(runs[0])
        tokens_per_step = s[0]["tokens"] / s[0]["steps"]  # all learners together
        dp_bpt = dp_allreduce_bytes_per_token(params, DP_REPLICAS, tokens_per_step)
        is_dp = not runs[0].config.diloco.sync_every
        bpt = [dp_bpt] * len(s) if is_dp else [x["bytes_per_token"] for x in s]
        body.append(
            [
                arm.label,
                f"{params:,}",
                harness.fmt([x["final_eval_loss"] for x in s]),
                harness.fmt(harness.loss_ratio(runs, groups.get(dp_name, [])), 4),
                "-" if is_dp else harness.fmt([x["merges"] for x in s], 0),
                "-" if is_dp else harness.fmt([x["mean_learners_per_merge"] for x in s], 2),
                harness.fmt(bpt, 1) + (" (model)" if is_dp else ""),
                harness.fmt([v / dp_bpt for v in bpt], 3),
                harness.fmt([x["wall_seconds"] for x in s], 0),
            ]
        )
    header = ["arm", "params", "final eval loss", "ratio to its DP", "merges",
              "learners / merge", "bytes / token", "bytes vs DP", "wall (s)"]  # fmt: skip
    # Every run's tokens, not the first's: a --smoke run (every learner at the smoke batch),
    # a --budget_s cap or a crash leaves arms at different tokens, and the note says so.
    tokens = harness.tokens_per_run(results)
    if harness.equal_tokens(results) is not None:
        tokens += f", {total_batch()} sequences per step in total"
    note = (
        f"Quality at equal tokens ({harness.mode_note()}): {tokens}; "
        "stdlib corpus, byte-level; eval loss in "
        "nats/byte on the same held-out sequences for every arm. Ratio = arm / its family's "
        "data-parallel run (dense: DP; MoE: MoE DP), per seed, then averaged. DP bytes/token: "
        f"ring all-reduce of fp32 gradients over {DP_REPLICAS} replicas (the M = 4 learners' "
        "device groups).\n\n"
    )
    return note + harness.table(header, body)


def main(argv):
    del argv
    import matplotlib.pyplot as plt

    out = harness.setup()
    results = harness.run_arms(arms, out)
    sweep = bool(flags.FLAGS.inner_lrs)
    fig, axes = plt.subplots(1, 3 if sweep else 2, figsize=(18 if sweep else 12, 4.5))
    for ax, family in zip(axes, FAMILIES, strict=False):
        runs = [r for r in results if r.arm.model == family]
        if sweep:  # the curves of each arm at its best lr
            runs = [r for best in best_runs(runs).values() for r in best]
        harness.plot_curves(ax, runs)
        ax.set_title(f"{family}: eval loss vs tokens" + (" (best lr)" if sweep else ""))
    text = markdown(results)
    if sweep:
        _plot_lr_sweep(axes[2], results)
        text += best_lr_table(results)
    fig.suptitle("Quality at an equal token budget")
    harness.write(out, "quality_equal_tokens", text, fig, results)


def _plot_lr_sweep(ax, results) -> None:
    """Final eval loss (mean over seeds) against the inner lr, one line per base arm."""
    lines: dict[str, list[tuple[float, float]]] = {}
    for name, runs in harness.by_arm(results).items():
        mean = harness.stat([r.summary["final_eval_loss"] for r in runs])[0]
        lines.setdefault(base_name(name), []).append((runs[0].config.train.learning_rate, mean))
    for i, (base, pts) in enumerate(lines.items()):
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, ys, marker="o", color=f"C{i % 10}", label=base)
    ax.set_xscale("log")
    ax.set_xlabel("peak inner lr")
    ax.set_ylabel("final eval loss (nats/byte)")
    ax.set_title("inner lr sweep")
    ax.legend(fontsize=7)


if __name__ == "__main__":
    cli.run_script(main)
