"""Collects the overlap-spacing runs (README.md here) into runs.json, overlap_spacing.md and
overlap_spacing.png.

    python experiments/results/overlap_spacing/collect.py NAME=RUN_DIR ...   # collect
    python experiments/results/overlap_spacing/collect.py                    # redraw

RUN_DIR is a run folder of the quality ladder or quality_targets (summary.json,
run_config.json, metrics.jsonl); NAME labels it, e.g. "P6_tau2=/tmp/x/runs/overlap_s0".
"""

import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).parent


def read_run(name: str, folder: pathlib.Path) -> dict:
    summary = json.loads((folder / "summary.json").read_text())
    d = json.loads((folder / "run_config.json").read_text())["diloco"]
    curve = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("learner") == "global" and "eval_loss" in row:
            curve.append((row["step"], row["eval_loss"]))
    return {
        "name": name, "H": d["sync_every"], "P": d["fragments"], "tau": d["overlap"],
        "max_wait": d["max_wait"], "quorum": d["quorum"], "eval_loss": summary["final_eval_loss"],
        "merge_delay_steps": summary.get("mean_merge_delay_steps"), "curve": curve,
    }  # fmt: skip


def main(argv: list[str]) -> None:
    path = HERE / "runs.json"
    if argv:
        pairs = [a.split("=", 1) for a in argv]
        runs = [read_run(name, pathlib.Path(folder)) for name, folder in pairs]
        path.write_text(json.dumps(runs, indent=1) + "\n")
    runs = json.loads(path.read_text())
    lines = ["| run | H | P | spacing H/P | τ | final eval loss |", "|---|---|---|---|---|---|"]
    for r in runs:
        spacing = r["H"] / r["P"] if not r["name"].startswith("aligned") else r["H"]
        lines.append(f"| {r['name']} | {r['H']} | {r['P']} | {spacing:g} | {r['tau']} | "
                     f"{r['eval_loss']:.4f} |")  # fmt: skip
    (HERE / "overlap_spacing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    groups: dict[str, list] = {}
    for r in runs:
        group = r["name"].rsplit("_tau", 1)[0]
        groups.setdefault(group, []).append((r["tau"], r["eval_loss"]))
    for group, points in groups.items():
        taus, losses = zip(*sorted(points), strict=True)
        ax.plot(taus, losses, marker="o", label=group)
    ax.set_xlabel("overlap τ (steps; every learner waits for its merge at t + τ)")
    ax.set_ylabel("final eval loss of Θ (1000 steps)")
    ax.set_xticks([0, 1, 2, 3])
    ax.set_title("What the overlap costs, by fragment schedule (tiny, seed 0 unless named)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "overlap_spacing.png", dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:])
