r"""The paper's goodput table from the simulator: N chips x {DP, elastic DP, Decoupled M}.

    pip install -e .   # once
    python experiments/goodput_table.py            # 5 seeds x 14 days: ~1 min on one core
    python experiments/goodput_table.py --quick    # 2 seeds x 3 days: ~5 s

N in {150k, 300k, 600k, 1.2M, 2.4M}, chip MTBF 1 year, every other parameter at its
`SimParams` default (one setting for every cell). Writes into --out
(default experiments/results/goodput): goodput.md (goodput and uptime tables, mean ± sample
std (ddof = 1) over seeds, the paper's 1.2M numbers beside them), goodput.json (every run) and
goodput.png (goodput against N, one line per method, the paper's points marked).
"""

import dataclasses
import json
import pathlib
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from goodput_cells import CHIPS, COLUMNS, PAPER_1P2M  # noqa: E402
from outputs import results_dir  # noqa: E402

from decoupled_diloco import cli
from decoupled_diloco.simulator import SimParams, simulate  # noqa: E402

flags.DEFINE_string("out", "experiments/results/goodput", "Output directory.")
flags.DEFINE_bool("quick", False, "2 seeds over 3 days instead of --seeds over --horizon_days.")
flags.DEFINE_integer("seeds", 5, "Seeds per cell (full mode).")
flags.DEFINE_float("horizon_days", 14.0, "Simulated days per run (full mode).")
FLAGS = flags.FLAGS


def run_grid(seeds: int, horizon_days: float) -> list[dict]:
    """Every (N, column, seed) run as a dict (SimResult fields + the column label)."""
    rows, t0 = [], time.time()
    for n in CHIPS:
        for label, method, m in COLUMNS:
            goodputs = []
            for seed in range(seeds):
                p = SimParams(seed=seed, horizon_days=horizon_days)
                rows.append({"column": label} | simulate(method, n, m, p).to_dict())
                goodputs.append(rows[-1]["goodput"])
            print(
                f"[{time.time() - t0:6.1f} s] N={n:>9,} {label:<15} goodput "
                f"{np.mean(goodputs):.3f} ± {_std(goodputs):.3f}",
                flush=True,
            )
    return rows


def _std(values) -> float:
    """Sample standard deviation (ddof = 1), as every experiment table; 0 for one value."""
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def _stats(rows: list[dict], n: int, label: str, key: str) -> tuple[float, float]:
    vals = [r[key] for r in rows if r["chips"] == n and r["column"] == label]
    return float(np.mean(vals)), _std(vals)


def markdown(rows: list[dict], seeds: int, horizon_days: float) -> str:
    head = "| chips | " + " | ".join(c[0] for c in COLUMNS) + " |"
    rule = "|---" * (len(COLUMNS) + 1) + "|"
    out = [
        f"Simulated goodput, chip MTBF 1 year, mean ± sample std over {seeds} seeds of "
        f"{horizon_days:g} days (`SimParams` defaults).",
        "",
        head,
        rule,
    ]
    for n in CHIPS:
        cells = []
        for label, _, _ in COLUMNS:
            mean, std = _stats(rows, n, label, "goodput")
            cells.append(f"{100 * mean:.1f} ± {100 * std:.1f}")
        out.append(f"| {n:,} | " + " | ".join(cells) + " |")
    out.append(
        "| 1,200,000 (paper) | "
        + " | ".join(f"{100 * PAPER_1P2M[c[0]]:.0f}" for c in COLUMNS)
        + " |"
    )
    out += ["", "System uptime (% of time the global model advances), same runs:", "", head, rule]
    for n in CHIPS:
        cells = [f"{100 * _stats(rows, n, c[0], 'uptime')[0]:.2f}" for c in COLUMNS]
        out.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: pathlib.Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, _, _) in enumerate(COLUMNS):
        stats = np.asarray([_stats(rows, n, label, "goodput") for n in CHIPS])
        color = f"C{i}"
        ax.errorbar(
            CHIPS,
            100 * stats[:, 0],
            yerr=100 * stats[:, 1],
            marker="o",
            ms=4,
            capsize=3,
            color=color,
            label=label,
        )
        ax.plot(
            [1_200_000], [100 * PAPER_1P2M[label]], marker="*", ms=12, color=color, mec="k", ls=""
        )
    ax.plot([], [], marker="*", ms=12, color="w", mec="k", ls="", label="paper (1.2M)")
    ax.set_xscale("log")
    ax.set_xticks(CHIPS, [f"{n / 1e6:g}M" for n in CHIPS])
    ax.minorticks_off()
    ax.set_xlabel("chips (chip MTBF 1 year)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("Simulated goodput: DP vs elastic DP vs Decoupled DiLoCo")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    seeds, days = (2, 3.0) if FLAGS.quick else (FLAGS.seeds, FLAGS.horizon_days)
    if seeds < 1 or not 0 < days < float("inf"):
        raise app.UsageError(
            f"--seeds={seeds} and --horizon_days={days:g} must be >= 1 and finite > 0"
        )
    out = results_dir(FLAGS.out, "quick" if FLAGS.quick else "full", FLAGS["out"].present)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows = run_grid(seeds, days)
    (out / "goodput.json").write_text(
        json.dumps(
            {"params": dataclasses.asdict(SimParams(horizon_days=days)), "runs": rows}, indent=1
        )
    )
    (out / "goodput.md").write_text(markdown(rows, seeds, days))
    plot(rows, out / "goodput.png")
    print(markdown(rows, seeds, days))
    print(f"wrote {out}/goodput.{{md,json,png}} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    cli.run_script(main)
