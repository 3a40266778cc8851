r"""Which assumption drives which goodput cell: one-at-a-time sweep of the simulator's defaults.

    pip install -e .   # once
    python experiments/goodput_sensitivity.py            # 1 seed x 4 days per cell: ~2 min
    python experiments/goodput_sensitivity.py --quick    # 1 day per cell: ~30 s

Every `SimParams` field with a `plausible` (low, high) range in simulator/params.py is set to
its low and to its high end while every other field keeps its default, and each setting runs
the goodput cells at 150k, 1.2M and 2.4M chips (DP, elastic DP, Decoupled M = 2..16). All
settings share one failure trace per N (the same seed): a difference between two rows is
the assumption's effect, not sampling noise. Varying step_s keeps H = 24 steps, so the sync
period scales with it. Writes into --out (default experiments/results/goodput_sensitivity):
sensitivity.md (per N, a row per assumption: goodput at low -> high), sensitivity.json
(every run) and sensitivity.png (the swing |high - low| in points, assumption x cell).
"""

import dataclasses
import json
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from goodput_cells import COLUMNS, PAPER_1P2M  # noqa: E402
from outputs import results_dir  # noqa: E402

from decoupled_diloco import cli
from decoupled_diloco.simulator import SimParams, simulate  # noqa: E402
from decoupled_diloco.simulator.params import plausible_ranges  # noqa: E402

flags.DEFINE_string("out", "experiments/results/goodput_sensitivity", "Output directory.")
flags.DEFINE_bool("quick", False, "1 simulated day per cell instead of --horizon_days.")
flags.DEFINE_float("horizon_days", 4.0, "Simulated days per cell (full mode).")
flags.DEFINE_integer("seed", 0, "Seed of the failure traces (one per N, shared by all rows).")
flags.register_validator("horizon_days", lambda d: 0 < d < float("inf"), "--horizon_days: > 0")
flags.register_validator("seed", lambda s: 0 <= s < 2**63, "--seed: an integer in [0, 2**63)")
FLAGS = flags.FLAGS

CHIPS = (150_000, 1_200_000, 2_400_000)
H_STEPS = SimParams().sync_period_s / SimParams().step_s  # the paper's H = 24


def setting(base: SimParams, name: str, value) -> SimParams:
    """base with one assumption changed (step_s carries the sync period: H stays in steps)."""
    extra = {"sync_period_s": H_STEPS * value} if name == "step_s" else {}
    return dataclasses.replace(base, **{name: type(getattr(base, name))(value)}, **extra)


def run_cells(p: SimParams) -> dict[str, float]:
    """{"<N>/<column>": goodput} for every cell."""
    return {
        f"{n}/{label}": simulate(method, n, m, p).goodput
        for n in CHIPS
        for label, method, m in COLUMNS
    }


def sweep(days: float, seed: int) -> dict:
    base = SimParams(seed=seed, horizon_days=days)
    t0 = time.time()
    out = {"defaults": run_cells(base), "rows": []}
    for name, (low, high) in plausible_ranges().items():
        row = {"name": name, "default": getattr(base, name), "low": low, "high": high}
        row["at_low"] = run_cells(setting(base, name, low))
        row["at_high"] = run_cells(setting(base, name, high))
        out["rows"].append(row)
        print(f"[{time.time() - t0:6.1f} s] {name}: {low} .. {high}", flush=True)
    return out


def _fmt(v) -> str:
    if isinstance(v, float) and v >= 3600 and v % 3600 == 0:
        return f"{v / 3600:g} h"
    return f"{v:g}"


def markdown(res: dict, days: float, seed: int) -> str:
    head = "| assumption: low – default – high | " + " | ".join(c[0] for c in COLUMNS) + " |"
    rule = "|---" * (len(COLUMNS) + 1) + "|"
    out = [
        f"Goodput (%) with one assumption at the low / high end of its plausible range, the "
        f"rest at their defaults (simulator/params.py); seed {seed}, {days:g} simulated days "
        f"per cell. Cells: low → high; the defaults row is the reference.",
    ]
    for n in CHIPS:
        out += ["", f"**{n:,} chips**", "", head, rule]
        cells = [f"{100 * res['defaults'][f'{n}/{c[0]}']:.1f}" for c in COLUMNS]
        out.append("| defaults | " + " | ".join(cells) + " |")
        if n == 1_200_000:
            paper = [f"{100 * PAPER_1P2M[c[0]]:.0f}" for c in COLUMNS]
            out.append("| paper | " + " | ".join(paper) + " |")
        for row in res["rows"]:
            label = f"`{row['name']}`: {_fmt(row['low'])} – {_fmt(row['default'])} – "
            label += _fmt(row["high"])
            cells = []
            for c in COLUMNS:
                lo, hi = (100 * row[k][f"{n}/{c[0]}"] for k in ("at_low", "at_high"))
                cells.append(f"{lo:.1f} → {hi:.1f}")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(res: dict, path) -> None:
    names = [r["name"] for r in res["rows"]]
    keys = [f"{n}/{c[0]}" for n in CHIPS for c in COLUMNS]
    swing = np.asarray(
        [[100 * abs(r["at_high"][k] - r["at_low"][k]) for k in keys] for r in res["rows"]]
    )
    fig, ax = plt.subplots(figsize=(12, 0.42 * len(names) + 2.2))
    im = ax.imshow(swing, cmap="Reds", aspect="auto", vmin=0)
    for i in range(swing.shape[0]):
        for j in range(swing.shape[1]):
            color = "w" if swing[i, j] > 0.6 * swing.max() else "k"
            ax.text(j, i, f"{swing[i, j]:.0f}", ha="center", va="center", fontsize=7, color=color)
    short = [c[0].replace("Decoupled ", "") for c in COLUMNS]
    ax.set_xticks(range(len(keys)), short * len(CHIPS), rotation=60, fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    for k in range(1, len(CHIPS)):
        ax.axvline(k * len(COLUMNS) - 0.5, color="k", lw=1)
    for k, n in enumerate(CHIPS):
        ax.text((k + 0.5) * len(COLUMNS) - 0.5, -0.9, f"{n / 1e6:g}M chips", ha="center")
    fig.colorbar(im, ax=ax, label="goodput swing, low vs high end (points)", shrink=0.8)
    fig.suptitle("Which assumption drives which cell")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    days = 1.0 if FLAGS.quick else FLAGS.horizon_days
    out = results_dir(FLAGS.out, "quick" if FLAGS.quick else "full", FLAGS["out"].present)
    out.mkdir(parents=True, exist_ok=True)
    res = sweep(days, FLAGS.seed)
    params = dataclasses.asdict(SimParams(seed=FLAGS.seed, horizon_days=days))
    (out / "sensitivity.json").write_text(json.dumps({"params": params, **res}, indent=1))
    md = markdown(res, days, FLAGS.seed)
    (out / "sensitivity.md").write_text(md)
    plot(res, out / "sensitivity.png")
    print(md)
    print(f"wrote {out}/sensitivity.{{md,json,png}}")


if __name__ == "__main__":
    cli.run_script(main)
