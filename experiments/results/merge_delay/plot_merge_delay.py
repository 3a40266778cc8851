"""Draws merge_delay.png from the JSON tables of this folder and its siblings (run from anywhere).

x: the one-way latency of every learner's link to the syncer (`faults.link_latency_s`),
y: `decoupled` (tiny model, outer (1.0, 0.0), 1000 steps) final eval loss ÷ synchronous
streaming of the same seed (`../quality_targets_1000steps`); lines: the mean over the seeds
that ran, dots: each seed; one line per mixing α. The single-seed variants at 1 s are
marked apart.
"""

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def losses(rel: str, arm: str = "decoupled") -> dict[int, float]:
    rows = json.loads((ROOT / rel / "quality_targets.json").read_text())
    return {r["seed"]: r["summary"]["final_eval_loss"] for r in rows if r["arm"] == arm}


def runs(*rels: str) -> dict[int, float]:
    out = {}
    for rel in rels:
        out |= losses(rel)
    return out


REF = losses("quality_targets_1000steps", "streaming_sync")
MIX = "quality_targets_1000steps_mixing/"
D = "merge_delay/"
LINES = {  # alpha -> {latency s: runs}
    0.0: {
        0.0: runs("quality_targets_1000steps"),
        1.0: runs(D + "lat_1.0", D + "lat_1.0_s1"),
        2.0: runs(D + "lat_2.0"),
    },
    0.5: {
        0.0: runs(MIX + "plain_rebase_a05", MIX + "plain_rebase_a05_s1"),
        1.0: runs(D + "lat_1.0_a05", D + "lat_1.0_a05_s1"),
        2.0: runs(D + "lat_2.0_a05"),
    },
}
OTHERS = [("outer lr 0.75, α 0", D + "lat_1.0_lr075", "v")]  # at 1 s, seed 0


def ratios(by_seed: dict[int, float]) -> list[float]:
    return [loss / REF[seed] for seed, loss in sorted(by_seed.items())]


def main() -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (alpha, points), color in zip(LINES.items(), ("tab:red", "tab:blue"), strict=True):
        xs = sorted(points)
        means = [sum(ratios(points[x])) / len(points[x]) for x in xs]
        ax.plot(xs, means, "-o", color=color, label=f"rebase, α {alpha}")
        for x in xs:
            ax.scatter([x] * len(points[x]), ratios(points[x]), color=color, s=12, alpha=0.5)
    for label, rel, marker in OTHERS:
        ax.scatter([1.0], ratios(runs(rel)), marker=marker, color="gray", label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([0.0, 1.0, 2.0])
    ax.set_xticklabels(["0\n(merge delay ~τ)", "1 s\n(~10 steps)", "2 s\n(~18 steps)"])
    ax.set_xlabel("one-way link latency of every learner (merge delay in steps)")
    ax.set_ylabel("final eval loss ÷ synchronous streaming")
    ax.set_title("Decoupled K = 1, tiny CPU model, 1000 steps: late merges, mixed or whole")
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "merge_delay.png", dpi=120)


if __name__ == "__main__":
    main()
