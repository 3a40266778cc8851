r"""Experiment 6 — wire precision of offers and replies: fp32, bf16, int8, int4, 2-bit, 1-bit.

    python experiments/precision.py            # 8 arms x seeds 0,1, 200 steps: ~24 min
    python experiments/precision.py --quick    # 8 arms, 48 steps x batch 8, 1 seed: ~2.5 min
    python experiments/precision.py --scale=tpu   # TPU slices via Ray (not runnable here)

Runtimes are for an idle 2-core machine (flags: experiments/harness.py).
configs/tiny_decoupled.py (M = 4, K = 1, grace, RDA) with `diloco.compression` in
none | bf16 | int8 | int4 | int2 | int1 for offers (replies lossless), plus int4 and int1
in both directions (`diloco.reply_compression` too). The paper: int4 ≈ lossless; 2-bit and
1-bit degrade badly. Writes precision.{md,png,json} into --out.
"""

import harness

from decoupled_diloco import cli

harness.define_flags("experiments/results/precision", "0,1")
LABEL = {"none": "fp32"}
FORMATS = ("none", "bf16", "int8", "int4", "int2", "int1")
BOTH_WAYS = ("int4", "int1")  # offers and merged replies in the same format
PAPER = {"none": "reference", "bf16": "-", "int8": "-", "int4": "≈ lossless"}
PAPER |= {"int2": "degrades badly", "int1": "degrades badly"}


def arms() -> list[harness.Arm]:
    """Offers in each format (replies lossless, the default), then some formats both ways.

    Offers are outer gradients, and a learner keeps what its lossy offer did not deliver
    (learner.py: error feedback), so offers tolerate low precision; replies are parameters,
    whose rounding error nobody feeds back.
    """
    out = [
        harness.Arm(f, "tiny_decoupled", {"diloco.compression": f}, LABEL.get(f, f))
        for f in FORMATS
    ]
    both = {"diloco.compression": None, "diloco.reply_compression": None}
    for f in BOTH_WAYS:
        over = {k: f for k in both}
        out.append(harness.Arm(f"{f}_both", "tiny_decoupled", over, f"{f} both ways"))
    return out


def markdown(results) -> str:
    groups = harness.by_arm(results)
    ref = groups.get("none", [])
    body = []
    for name, runs in groups.items():
        s = [r.summary for r in runs]
        losses = [x["final_eval_loss"] for x in s]
        bpt = [x["bytes_per_token"] for x in s]
        body.append(
            [
                runs[0].arm.label,
                harness.fmt(losses),
                harness.fmt(harness.loss_ratio(runs, ref), 3),
                harness.fmt(bpt, 1),
                harness.fmt(
                    harness.paired(
                        runs,
                        ref,
                        lambda a, b: a.summary["bytes_per_token"] / b.summary["bytes_per_token"],
                    ),
                    3,
                ),  # fmt: skip
                PAPER.get(name, PAPER.get(name.removesuffix("_both"), "-")),
            ]
        )
    header = ["wire format (offers; replies fp32 unless both ways)", "final eval loss",
              "ratio to fp32", "bytes / token", "bytes vs fp32", "paper"]  # fmt: skip
    return f"Communication precision ({harness.mode_note()}).\n\n" + harness.table(header, body)


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
    fig.suptitle("Wire precision of offers and merged fragments")
    harness.write(out, "precision", markdown(results), fig, results)


if __name__ == "__main__":
    cli.run_script(main)
