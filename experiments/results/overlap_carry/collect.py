"""Makes overlap_carry.md (the table) and overlap_carry.png (ratios to synchronous streaming of
the same lr and seed) from runs.json.

    python collect.py
"""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    with open(os.path.join(HERE, "runs.json"), encoding="utf-8") as f:
        runs = json.load(f)
    sync = {(r["lr"], r["seed"]): r["eval_loss"] for r in runs if r["arm"] == "streaming"}
    lines = [
        "| inner lr | arm | apply rule | seed | eval loss | ÷ synchronous streaming "
        "(τ = 0, same lr, seed) | goodput | merge delay (steps) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    bars = []
    for r in runs:
        base = sync.get((r["lr"], r["seed"]))
        ratio = r["eval_loss"] / base if base else None
        cell = f"{ratio:.4f}" if ratio else "-"
        goodput = "-" if r["goodput"] is None else f"{r['goodput']:.3f}"
        lines.append(
            f"| {r['lr']} | {r['arm']} | {r['rule']} | {r['seed']} | "
            f"{r['eval_loss']:.4f} | {cell} | {goodput} | "
            f"{r['merge_delay_steps']:.1f} |"
        )
        if ratio and r["arm"] != "streaming":
            bars.append((f"lr {r['lr']} s{r['seed']} {r['arm']}\n{r['rule']}", ratio, r["arm"]))
    with open(os.path.join(HERE, "overlap_carry.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(bars) + 1.2))
    colors = {"overlap": "C0", "decoupled": "C1", "decoupled 1 s links": "C2"}
    for i, (_, ratio, arm) in enumerate(bars):
        ax.barh(i, (ratio - 1) * 100, color=colors.get(arm, "C3"))
        ax.text(
            max((ratio - 1) * 100, 0) + 0.1,
            i,
            f"{(ratio - 1) * 100:+.2f}%",
            va="center",
            fontsize=7,
        )
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("final eval loss vs synchronous streaming (τ = 0), same inner lr and seed (%)")
    ax.set_title("What carrying the steps since an offer costs (tiny, 1000 steps, CPU)", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "overlap_carry.png"), dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
