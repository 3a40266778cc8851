r"""Where quality goes: from synchronous DiLoCo to Decoupled DiLoCo, one change at a time.

    pip install -e .   # once
    python experiments/quality_ladder.py --quick      # 12 arms, 1 seed, 120 steps: ~8 min
    python experiments/quality_ladder.py              # 12 arms x seeds 0,1, 300 steps: ~50 min
    python experiments/quality_ladder.py --outer=0.7,0.9   # the rungs with DiLoCo's outer step
    python experiments/quality_ladder.py --scale=mid  # the 31M `mid` model (a GPU: ~1 h)
    python experiments/quality_ladder.py --set=data.source=shakespeare   # another corpus
    python experiments/quality_ladder.py --latency_s=0.5 --speed_noise=0.1  # late replies

Every rung keeps the one below and changes one thing (M = 4 learners, equal tokens: each
processes a quarter of DP's batch per step, for the same number of steps; not under --smoke,
whose batch every learner takes):

  dp         one learner, the whole batch (the reference)
  diloco     DiLoCo: P = 1, K = M, τ = 0, learners wait for every merge, plain mean
  streaming  + P = 6 fragments on staggered schedules (H = 12 for each)
  overlap    + τ = 2: a merge is applied 2 steps after its offer (still waited for), the
             steps since the offer carried on top of it (`diloco.apply` "rebase")
  land       + learners land on the merge and send those steps with their next offer
             (`diloco.apply` "land", since 2026-11-28; ladders measured before have no
             such rung and rebase on every rung above it)
  no_wait    + max_wait = 0: never wait; apply a merge when it is there
  quorum1    + K = 1: a round closes as soon as one learner reached a new slot
  grace      + the adaptive grace window (γ = 1), which lets more learners into a round
  tokens     + token weights
  rda        + radial-directional averaging
  mixing     + learners take half of each merge's move (α = 0.5) (since 2026-11-26; ladders
             measured before end at `rda`)
  outer_lr   + outer lr 0.75: configs/tiny_decoupled.py as shipped (since 2026-11-27; ladders
             measured before end at `mixing`)

Every rung below the last uses synchronous DiLoCo's outer step (lr 1.0, no momentum);
--outer=lr,momentum puts one outer step on every rung and leaves out the last. All use the
shipped merge normalisation (roster) and momentum clock (work). The
table gives each rung's final eval loss (mean ± sample std over seeds), its ratio to DP and
to the rung below (per seed, then averaged), the spread of its seeds ((max − min) / mean),
learners per merge, and offers dropped. With --scale=mid the per-learner batch is 32 x 256
tokens and runs last 1000 steps (300 with --quick), on whatever devices exist.
"""

import math

import arm_config
import harness
from absl import flags
from arm_config import LADDER_FULL, LADDER_QUICK

from decoupled_diloco import cli

harness.define_flags("experiments/results/quality_ladder", "0,1")
flags.DEFINE_list(
    "outer", [], "Outer lr and momentum of every DiLoCo rung (then without the `outer_lr` "
    "rung). Default: synchronous DiLoCo's (1.0, 0.0), then tiny_decoupled's lr on the last rung.",
)  # fmt: skip


def _outer_ok(values: list[str]) -> bool:
    try:
        return not values or (len(values) == 2 and all(float(x) >= 0 for x in values))
    except ValueError:
        return False


flags.register_validator("outer", _outer_ok, "--outer takes lr,momentum (two numbers >= 0)")
flags.DEFINE_float(
    "latency_s", 0.0, "One-way link latency of every learner of the DiLoCo rungs (seconds): "
    "replies then land steps late, as when a syncer or a network is slow.",
)  # fmt: skip
flags.DEFINE_float("speed_noise", 0.0, "Per-step speed noise of the DiLoCo rungs' learners.")

QUICK, FULL = LADDER_QUICK, LADDER_FULL
M = 4

# (name, label, overrides added to the rung below)
RUNGS = [
    ("diloco", "DiLoCo (P=1, K=M, wait)", {
        "diloco.fragments": 1, "diloco.overlap": 0, "diloco.max_wait": -1.0,
        "diloco.quorum": M, "diloco.grace_gamma": 0.0, "diloco.weights": "uniform",
        "diloco.merge": "mean", "diloco.embedding_merge": "mean", "diloco.alpha": 0.0,
        "diloco.outer_lr": 1.0, "diloco.outer_momentum": 0.0, "diloco.apply": "rebase"}),
    ("streaming", "+ P=6 fragments", {"diloco.fragments": 6}),
    ("overlap", "+ overlap tau=2", {"diloco.overlap": 2}),
    ("land", "+ land on merges (apply=land)", {"diloco.apply": "land"}),
    ("no_wait", "+ never wait (max_wait 0)", {"diloco.max_wait": 0.0}),
    ("quorum1", "+ K=1", {"diloco.quorum": 1}),
    ("grace", "+ grace window", {"diloco.grace_gamma": 1.0}),
    ("tokens", "+ token weights", {"diloco.weights": "tokens"}),
    ("rda", "+ RDA", {"diloco.merge": "rda"}),
    ("mixing", "+ mixing alpha 0.5", {"diloco.alpha": 0.5}),
    ("outer_lr", "+ outer lr {shipped:g} (tiny_decoupled)", {"diloco.outer_lr": None}),
]  # fmt: skip


def per_learner_batch() -> int:
    return (FULL if harness.is_full() else QUICK)["train.batch_size"]


def arms() -> list[harness.Arm]:
    b = per_learner_batch()
    out = [harness.Arm("dp", "tiny_dense", {"train.batch_size": M * b}, "data-parallel")]
    over = {"diloco.learners": M, "devices_per_learner": 2, "train.batch_size": b}
    rungs = RUNGS
    if flags.FLAGS.outer:  # one outer step on every rung: the last rung would change nothing
        lr, mu = (float(x) for x in flags.FLAGS.outer)
        fixed = {"diloco.outer_lr": lr, "diloco.outer_momentum": mu}
        rungs = [(n, label, change | fixed) for n, label, change in RUNGS[:-1]]
    if flags.FLAGS.latency_s:
        over["faults.link_latency_s"] = [flags.FLAGS.latency_s] * M
    if flags.FLAGS.speed_noise:
        over["faults.speed_noise"] = flags.FLAGS.speed_noise
    shipped = arm_config.shipped_outer_lr()
    for name, label, change in rungs:
        over = over | {k: shipped if v is None else v for k, v in change.items()}  # None: shipped
        out.append(harness.Arm(name, "tiny_decoupled", dict(over), label.format(shipped=shipped)))
    return out


def spread(runs) -> str:
    losses = [r.summary["final_eval_loss"] for r in runs]
    if len(losses) < 2:
        return "-"
    mean = harness.stat(losses)[0]  # (nan where a seed diverged: max and min would skip it)
    return f"{(max(losses) - min(losses)) / mean if math.isfinite(mean) else mean:.3f}"


def markdown(results) -> str:
    groups = harness.by_arm(results)
    dp = groups.get("dp", [])
    # The rung each one climbs from (the ladder's order, whichever ran: --arms, --smoke).
    ladder = [a.name for a in arms() if a.name != "dp"]
    below_of = dict(zip(ladder[1:], ladder[:-1], strict=True))
    body = []
    for name, runs in groups.items():
        s = [r.summary for r in runs]
        is_dp, below = name == "dp", groups.get(below_of.get(name))
        body.append([
            runs[0].arm.label,
            harness.fmt([x["final_eval_loss"] for x in s]),
            harness.fmt(harness.loss_ratio(runs, dp), 4),
            "-" if below is None else harness.fmt(harness.loss_ratio(runs, below), 4),
            spread(runs),
            "-" if is_dp else harness.fmt([x["mean_learners_per_merge"] for x in s], 2),
            "-" if is_dp else harness.fmt([x.get("dropped_offers", 0) for x in s], 0),
        ])  # fmt: skip
    header = ["rung", "final eval loss", "÷ DP", "÷ rung below", "seed spread",
              "learners / merge", "dropped offers"]  # fmt: skip
    if flags.FLAGS.outer:
        outer = "outer lr {}, momentum {} on every rung".format(*flags.FLAGS.outer)
    else:
        outer = "outer lr 1.0, momentum 0.0 up to the last rung"
    lag = flags.FLAGS.latency_s, flags.FLAGS.speed_noise
    faults = f"; link latency {lag[0]} s, speed noise {lag[1]}" if any(lag) else ""
    note = (
        f"The ladder ({harness.mode_note()}); {outer}{faults}; "
        f"{harness.tokens_per_run(results)}; eval loss in nats per token on "
        "the same held-out sequences. Ratios per seed, then averaged; seed spread = (max − "
        "min) / mean of the final loss.\n\n"
    )
    return note + harness.table(header, body)


def main(argv):
    del argv
    import matplotlib.pyplot as plt

    out = harness.setup()
    results = harness.run_arms(arms, out, quick=QUICK, full=FULL)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    harness.plot_curves(axes[0], results)
    axes[0].set_title("eval loss vs tokens")
    groups = harness.by_arm(results)
    names = [n for n in groups if n != "dp"]
    harness.plot_bars(axes[1], names,
                      [harness.loss_ratio(groups[n], groups.get("dp", [])) for n in names],
                      "final eval loss ÷ DP", harness.arm_colors(results, names))  # fmt: skip
    axes[1].set_ylim(bottom=0)
    axes[1].set_title("each rung adds one change to the one before")
    fig.suptitle("From DiLoCo to Decoupled DiLoCo, one change at a time")
    harness.write(out, "quality_ladder", markdown(results), fig, results)


if __name__ == "__main__":
    cli.run_script(main)
