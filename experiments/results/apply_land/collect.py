"""Gathers the runs of this folder (and of ../overlap_carry/runs.json, the same commands a
session earlier) into apply_land.md and apply_land.png: each run's final eval loss over its
synchronous streaming twin's (same corpus, inner lr and seed), by apply rule.

    python experiments/results/apply_land/collect.py
"""

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
CARRY = json.loads((HERE.parent / "overlap_carry" / "runs.json").read_text())


def run(folder: str, arm: str, seed: int) -> float:
    """Final eval loss of `arm` seed `seed` in this folder's `folder` run."""
    for name in ("quality_targets.json", "quality_ladder.json"):
        path = HERE / folder / name
        if path.exists():
            for r in json.loads(path.read_text()):
                if r["arm"] == arm and r["seed"] == seed:
                    return r["summary"]["final_eval_loss"]
    raise KeyError((folder, arm, seed))


def carry(name: str) -> float:
    return next(r["eval_loss"] for r in CARRY if r["name"] == name)


def sync_rung(lr: str, land: float) -> tuple[dict, dict]:
    """The synchronous τ = 2 rung at inner lr `lr` (seed 0): ../overlap_carry's rebase and
    overwrite runs, and the landing's loss `land`, over synchronous streaming."""
    rules = {"rebase": f"sync_tau2_rebase_{lr}", "overwrite a0": f"sync_tau2_overwrite_{lr}"}
    runs = {rule: [(0, carry(name))] for rule, name in rules.items()}
    return {0: carry(f"sync_tau0_{lr}")}, {"rebase": runs["rebase"], "land": [(0, land)],
                                          "overwrite a0": runs["overwrite a0"]}  # fmt: skip


# condition -> (denominator per seed, {rule: [(seed, loss), ...]})
CONDITIONS = {
    "stdlib, lr 0.036, synchronous, tau 2 (overlap rung)": sync_rung(
        "lr036", run("hold_overlap_lr036", "overlap", 0)
    ),
    "stdlib, lr 0.036, decoupled": (
        {0: carry("sync_tau0_lr036"), 1: carry("sync_tau0_lr036_s1")},
        {
            "rebase": [
                (0, carry("dec_rebase_lr036")),
                (0, carry("dec_rebase_ladder_lr036")),
                (1, carry("dec_rebase_lr036_s1")),
            ],  # fmt: skip
            "land": [
                (0, run("hold_dec_lr036", "decoupled", 0)),
                (1, run("hold_dec_lr036", "decoupled", 1)),
            ],  # fmt: skip
            "overwrite a0.5": [(1, carry("dec_overwrite_a05_lr036_s1"))],
        },
    ),
    "stdlib, lr 0.036, decoupled, alpha 0": (
        {0: carry("sync_tau0_lr036")},
        {
            "land": [(0, run("hold_dec_a0_lr036", "decoupled", 0))],
            "overwrite a0": [(0, carry("dec_overwrite_a0_lr036"))],
        },
    ),
    "stdlib, lr 0.012, synchronous, tau 2 (overlap rung)": sync_rung(
        "lr012", run("land_rung_lr012", "land", 0)
    ),
    "stdlib, lr 0.012, decoupled": (
        {s: run("base_dec_lr012", "streaming_sync", s) for s in (0, 1)},
        {
            "rebase": [(s, run("base_dec_lr012", "decoupled", s)) for s in (0, 1)]
            + [(0, carry("dec_rebase_lr012")), (1, carry("dec_rebase_lr012_s1"))],
            "land": [(s, run("hold_dec_lr012", "decoupled", s)) for s in (0, 1)],
            "overwrite a0.5": [(0, carry("dec_ow05_lr012")), (1, carry("dec_ow05_lr012_s1"))],
        },
    ),
    "shakespeare, lr 0.012, decoupled": (
        {s: run("shk_base", "streaming_sync", s) for s in (0, 1)},
        {
            "rebase": [(s, run("shk_base", "decoupled", s)) for s in (0, 1)]
            + [(0, run("shk_repeat", "decoupled_rebase", 0))],
            "land": [(s, run("shk_land", "decoupled", s)) for s in (0, 1)]
            + [(0, run("shk_repeat", "decoupled", 0))],
        },
    ),
    "stdlib, lr 0.012, decoupled, outer (0.7, 0.9)": (
        {s: run("base_dec_lr012", "streaming_sync", s) for s in (0, 1)},
        {
            "rebase": [(s, run("nag_base", "decoupled_nag", s)) for s in (0, 1)],
            "land": [(s, run("nag_land", "decoupled_nag", s)) for s in (0, 1)],
        },
    ),
}


def main() -> None:
    rows, means = [], {}
    for label, (den, rules) in CONDITIONS.items():
        for rule, runs in rules.items():
            ratios = [loss / den[seed] for seed, loss in runs]
            mean = sum(ratios) / len(ratios)
            means.setdefault(label, {})[rule] = mean
            per = ", ".join(f"s{seed} {loss:.4f} ({r:.4f})" for (seed, loss), r in
                            zip(runs, ratios, strict=True))  # fmt: skip
            rows.append(f"| {label} | {rule} | **{mean:.4f}** | {per} |")
    header = ("| condition | apply rule | ÷ synchronous streaming (mean) | runs: seed, eval loss "
              "(ratio) |\n|---|---|---|---|")  # fmt: skip
    (HERE / "apply_land.md").write_text(header + "\n" + "\n".join(rows) + "\n")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    colors = {"rebase": "tab:red", "land": "tab:green", "overwrite": "tab:gray"}
    width, seen = 0.25, set()
    for i, by_rule in enumerate(means.values()):
        for j, (rule, mean) in enumerate(by_rule.items()):
            kind = rule.split()[0]
            ax.bar(i + (j - 1) * width, mean - 1, width, color=colors.get(kind, "tab:gray"),
                   label=None if kind in seen else kind)  # fmt: skip
            seen.add(kind)
            ax.text(i + (j - 1) * width, mean - 1, f"{mean - 1:+.3f}", ha="center",
                    va="bottom", fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(means)))
    ax.set_xticklabels([label.replace(", ", "\n", 2) for label in means], fontsize=7)
    ax.set_ylabel("eval loss ÷ synchronous streaming − 1")
    ax.set_title("Where a learner applies the merge of its own offer (tiny model, 1000 steps)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "apply_land.png", dpi=110)
    print((HERE / "apply_land.md").read_text())


if __name__ == "__main__":
    main()
