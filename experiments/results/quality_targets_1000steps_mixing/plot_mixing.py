"""Draws mixing.png from the JSON tables of this folder and its siblings (run from anywhere).

Each bar: a decoupled K = 1 arm's final eval loss ÷ synchronous streaming under (1.0, 0.0)
of the same seed (`../quality_targets_1000steps`), mean over the seeds that ran (dots: the
seeds); the hatched bars are synchronous twins (τ = 0, K = M, learners wait).
"""

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def losses(rel: str, arm: str) -> dict[int, float]:
    rows = json.loads((ROOT / rel / "quality_targets.json").read_text())
    return {r["seed"]: r["summary"]["final_eval_loss"] for r in rows if r["arm"] == arm}


def merged(*parts: tuple[str, str]) -> dict[int, float]:
    out = {}
    for rel, arm in parts:
        out |= losses(rel, arm)
    return out


MIX = "quality_targets_1000steps_mixing/"
NAG0 = "quality_targets_1000steps_nag_parts/decoupled_nag_exact_look/"
MOM0 = "quality_targets_1000steps_mom_exact_look/"
LR1 = "quality_targets_1000steps_mom_lr1"
BASE = "quality_targets_1000steps"
REF = losses(BASE, "streaming_sync")
DEC, NAG, MOM, SYNC_NAG = "decoupled", "decoupled_nag", "decoupled_mom", "streaming_sync_nag"
BARS = [  # (outer step, label, [(folder, arm) of each run], synchronous twin?)
    ("(1.0, 0.0)", "rebase, α 0\n(tiny_decoupled)", [(BASE, DEC)], False),
    ("(1.0, 0.0)", "rebase, α 0.5",
     [(MIX + "plain_rebase_a05", DEC), (MIX + "plain_rebase_a05_s1", DEC)], False),
    ("(1.0, 0.0)", "overwrite, α 0\n(the paper's)",
     [(MIX + "plain_overwrite_a0", DEC), (MIX + "plain_overwrite_a0_s1", DEC)], False),
    ("(1.0, 0.0)", "overwrite, α 0.5", [(MIX + "plain_overwrite_a05", DEC)], False),
    ("(0.5, 0.5)", "rebase, α 0", [(MOM0 + "seed0", MOM), (MOM0 + "seed1", MOM)], False),
    ("(0.5, 0.5)", "rebase, α 0.5", [(MIX + "mom_rebase_a05", MOM)], False),
    ("(1.0, 0.5)", "sync twin, α 0", [(LR1, "streaming_sync_mom")], True),
    ("(1.0, 0.5)", "rebase, α 0", [(LR1, MOM)], False),
    ("(1.0, 0.5)", "rebase, α 0.5", [(MIX + "mom_lr1_rebase_a05", MOM)], False),
    ("(0.7, 0.9)", "sync twin, α 0", [(BASE, SYNC_NAG)], True),
    ("(0.7, 0.9)", "sync twin, α 0.5",
     [(MIX + "sync_nag_overwrite_a05", SYNC_NAG), (MIX + "sync_nag_overwrite_a05_s1", SYNC_NAG)],
     True),
    ("(0.7, 0.9)", "rebase, α 0", [(NAG0 + "seed0", NAG), (NAG0 + "seed1", NAG)], False),
    ("(0.7, 0.9)", "rebase, α 0.5",
     [(MIX + "nag_rebase_a05", NAG), (MIX + "nag_rebase_a05_s1", NAG)], False),
    ("(0.7, 0.9)", "overwrite, α 0",
     [(MIX + "nag_overwrite_a0", NAG), (MIX + "nag_overwrite_a0_s1", NAG)], False),
    ("(0.7, 0.9)", "overwrite, α 0.5", [(MIX + "nag_overwrite_a05", NAG)], False),
]  # fmt: skip
COLORS = {
    "(1.0, 0.0)": "tab:blue",
    "(0.5, 0.5)": "tab:green",
    "(1.0, 0.5)": "tab:orange",
    "(0.7, 0.9)": "tab:red",
}


def main() -> None:
    fig, ax = plt.subplots(figsize=(15, 5))
    top = 1.0
    seen = set()
    for i, (group, _, parts, twin) in enumerate(BARS):
        by_seed = merged(*parts)
        ratios = [loss / REF[s] for s, loss in sorted(by_seed.items())]
        mean = sum(ratios) / len(ratios)
        legend = None if group in seen or twin else group
        seen |= set() if twin else {group}
        ax.bar(i, mean - 1, bottom=1, color=COLORS[group], alpha=0.45 if twin else 0.85,
               hatch="//" if twin else None, label=legend)  # fmt: skip
        ax.scatter([i] * len(ratios), ratios, color="black", s=10, zorder=3)
        ax.text(i, max(ratios) + 0.004, f"{mean:.3f}", ha="center", fontsize=8)
        top = max(top, max(ratios))
    ax.set_xticks(range(len(BARS)), [b[1] for b in BARS], fontsize=7.5)
    ax.set_ylim(0.99, top + 0.015)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(1.05, color="gray", lw=0.6, ls=":")
    ax.set_ylabel("final eval loss ÷ synchronous streaming (1.0, 0.0)")
    ax.set_title("Decoupled K = 1 at 1000 tiny steps, by outer (lr, μ), apply rule and mixing α "
                 "(hatched: synchronous twins; dots: seeds)")  # fmt: skip
    ax.legend(title="outer (lr, μ)")
    fig.tight_layout()
    fig.savefig(HERE / "mixing.png", dpi=110)


if __name__ == "__main__":
    main()
