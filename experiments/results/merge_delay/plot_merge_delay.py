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
OTHERS = [  # at 1 s
    ("outer lr 0.75, α 0 (seed 0)", D + "lat_1.0_lr075", "v"),
    ("rebase, α 0.75 (2 seeds)", D + "lat_1.0_a075", "^"),
]


def ratios(by_seed: dict[int, float]) -> list[float]:
    return [loss / REF[seed] for seed, loss in sorted(by_seed.items())]


# Right panel: the same ratio against the mean age of the other learners' work a learner
# lacks, (steps per offer) / 2 + merge delay, at α = 0.5. Merge delays: summary.json's
# `mean_merge_delay_steps` where the run has it, else merge_delays.json (collect_delays.py),
# else the delays this folder's README measured for the runs of 2026-11-26 (their metrics
# were not kept).
AGE_RUNS = {  # label -> folders
    "H 12, on time": ["lat0_a05"],
    "H 18, on time": ["lat0_h18"],
    "H 24, on time": ["lat0_h24"],
    "H 12, 1 s links": ["lat_1.0_a05_now"],
    "H 12, 1 s links, α 0.75": ["lat_1.0_a075"],
    "H 12, 1 s links (code of 11-26)": ["lat_1.0_a05", "lat_1.0_a05_s1"],
    "H 12, 2 s links (code of 11-26)": ["lat_2.0_a05"],
    "H 12, on time, outer lr 0.75": ["lat0_lr075"],
    "H 12, 1 s links, outer lr 0.75": ["lat_1.0_lr075_a05"],
}
README_DELAYS = {"lat_1.0_a05": {0: 9.9}, "lat_1.0_a05_s1": {1: 10.5}, "lat_2.0_a05": {0: 17.6}}


def ages(folder: str) -> dict[int, tuple[float, float]]:
    """seed -> (mean age in steps, loss ÷ synchronous streaming) of a folder's runs."""
    path = HERE / folder / "quality_targets.json"
    if not path.exists():
        return {}
    collected = json.loads((HERE / "merge_delays.json").read_text()).get(folder, {})
    out = {}
    for r in json.loads(path.read_text()):
        s, seed = r["summary"], r["seed"]
        delay = s.get("mean_merge_delay_steps") or collected.get(str(seed))
        delay = delay or README_DELAYS.get(folder, {}).get(seed)
        if delay is not None:
            out[seed] = (s["mean_offer_steps"] / 2 + delay, s["final_eval_loss"] / REF[seed])
    return out


def age_panel(ax) -> None:
    for (label, folders), marker in zip(AGE_RUNS.items(), "osD^vPX<>", strict=True):
        points = [p for folder in folders for p in ages(folder).values()]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(xs, ys, marker=marker, label=label)
    ax.scatter([6.0], [1.0], marker="*", s=80, color="black",
               label="synchronous streaming (H 12, τ 0)")  # fmt: skip
    ax.set_xlabel("mean age of the others' work a learner lacks (steps per offer / 2 + delay)")
    ax.set_ylabel("final eval loss ÷ synchronous streaming")
    ax.set_title("by seed: a late merge or a longer H (α = 0.5 unless marked)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def main() -> None:
    fig, (ax, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    age_panel(right)
    for (alpha, points), color in zip(LINES.items(), ("tab:red", "tab:blue"), strict=True):
        xs = sorted(points)
        means = [sum(ratios(points[x])) / len(points[x]) for x in xs]
        ax.plot(xs, means, "-o", color=color, label=f"rebase, α {alpha}")
        for x in xs:
            ax.scatter([x] * len(points[x]), ratios(points[x]), color=color, s=12, alpha=0.5)
    for label, rel, marker in OTHERS:
        ys = ratios(runs(rel))
        ax.scatter([1.0] * len(ys), ys, marker=marker, color="gray", label=label)
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
