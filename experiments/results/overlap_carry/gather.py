"""Collects this folder's runs.json from the runs' summary.json and metrics.jsonl.

python gather.py /work/runs   # the root the commands in README.md wrote under
"""

import json
import os
import sys

# name | folder under the root | the arm's run folder | lr | rung or arm | apply rule | seed
# ("-": a run of an earlier folder, in KNOWN below)
TABLE = """
sync_tau0_lr012 | - | - | 0.012 | streaming | - | 0
sync_tau2_rebase_lr012 | - | - | 0.012 | overlap | rebase | 0
sync_tau2_overwrite_lr012 | ow_a0_lr012 | overlap_s0 | 0.012 | overlap | overwrite a0 | 0
sync_tau0_lr036 | lr_0.036 | streaming_s0 | 0.036 | streaming | - | 0
sync_tau0_lr036_s1 | lr_0.036 | streaming_s1 | 0.036 | streaming | - | 1
sync_tau2_rebase_lr036 | lr_0.036 | overlap_s0 | 0.036 | overlap | rebase | 0
sync_tau2_carry05_lr036 | ov_c05 | overlap_s0 | 0.036 | overlap | carry 0.5 | 0
sync_tau2_overwrite_a05_lr036 | ow_a05 | overlap_s0 | 0.036 | overlap | overwrite a0.5 | 0
sync_tau2_overwrite_lr036 | ow_a0 | overlap_s0 | 0.036 | overlap | overwrite a0 | 0
dec_rebase_lr036 | dec_rebase | decoupled_s0 | 0.036 | decoupled | rebase a0.5 | 0
dec_rebase_ladder_lr036 | lr_0.036 | outer_lr_s0 | 0.036 | decoupled | rebase a0.5 | 0
dec_rebase_lr036_s1 | dec_rebase_s1 | decoupled_s1 | 0.036 | decoupled | rebase a0.5 | 1
dec_carry05_lr036 | dec_c05 | decoupled_s0 | 0.036 | decoupled | carry 0.5 a0.5 | 0
dec_carry0_lr036 | dec_c0 | decoupled_s0 | 0.036 | decoupled | carry 0 a0.5 | 0
dec_carry0_a0_lr036 | dec_c0_a0 | decoupled_s0 | 0.036 | decoupled | carry 0 a0 | 0
dec_overwrite_a0_lr036 | dec_ow_a0 | decoupled_s0 | 0.036 | decoupled | overwrite a0 | 0
dec_overwrite_a05_lr036_s1 | dec_ow_a05_s1 | decoupled_s1 | 0.036 | decoupled | overwrite a0.5 | 1
sync_tau0_lr012_s1 | - | - | 0.012 | streaming | - | 1
dec_rebase_lr012 | - | - | 0.012 | decoupled | rebase a0.5 | 0
dec_rebase_lr012_s1 | - | - | 0.012 | decoupled | rebase a0.5 | 1
dec_ow05_lr012 | dec_ow_a05_lr012 | decoupled_s0 | 0.012 | decoupled | overwrite a0.5 | 0
dec_ow05_lr012_s1 | dec_ow_a05_lr012 | decoupled_s1 | 0.012 | decoupled | overwrite a0.5 | 1
dec_rebase_lat1 | - | - | 0.012 | decoupled 1 s links | rebase a0.5 | 0
dec_ow05_lat1 | lat1_ow_a05 | decoupled_s0 | 0.012 | decoupled 1 s links | overwrite a0.5 | 0
"""
RUNS = [
    (name, None if folder == "-" else folder, run, float(lr), arm, rule, int(seed))
    for name, folder, run, lr, arm, rule, seed in (
        [field.strip() for field in line.split("|")] for line in TABLE.strip().splitlines()
    )
]
# Runs of earlier folders, by value (their runs are not kept here): eval loss, goodput, merge
# delay (rounded as those folders give them). Synchronous streaming and its τ = 2 rung:
# ../overlap_spacing/ and ../quality_targets_1000steps/; the shipped decoupled arm (outer lr
# 0.75, α 0.5): ../merge_delay/lat0_lr075/ and, under 1 s links, ../merge_delay/lat_1.0_lr075_a05/.
KNOWN = {
    "sync_tau0_lr012": (1.1817, 0.7495, 0.0),
    "sync_tau0_lr012_s1": (1.1685, 0.7491, 0.0),
    "sync_tau2_rebase_lr012": (1.1994, None, 2.0),  # (its goodput was not recorded)
    "dec_rebase_lr012": (1.1931, 0.9998, 2.8),
    "dec_rebase_lr012_s1": (1.1930, 0.9998, 3.2),
    "dec_rebase_lat1": (1.2289, 0.9999, 10.7),
}


def main(root: str) -> None:
    out = []
    for name, folder, run, lr, arm, rule, seed in RUNS:
        row = dict(name=name, lr=lr, arm=arm, rule=rule, seed=seed)
        if folder is None:
            loss, goodput, delay = KNOWN[name]
            row.update(eval_loss=loss, goodput=goodput, merge_delay_steps=delay, curve=[])
        else:
            path = os.path.join(root, folder, "runs", run)
            if not os.path.isfile(os.path.join(path, "summary.json")):
                print("missing:", path)
                continue
            with open(os.path.join(path, "summary.json"), encoding="utf-8") as f:
                s = json.load(f)
            with open(os.path.join(path, "metrics.jsonl"), encoding="utf-8") as f:
                rows = [json.loads(line) for line in f]
            curve = [[r["step"], r["eval_loss"]] for r in rows
                     if r.get("learner") == "global" and "eval_loss" in r]  # fmt: skip
            row.update(
                eval_loss=s["final_eval_loss"],
                goodput=s["goodput"],
                merge_delay_steps=s.get("mean_merge_delay_steps", 0.0),
                offer_steps=s.get("mean_offer_steps"),
                curve=curve,
            )
        out.append(row)
    with open(os.path.join(os.path.dirname(__file__) or ".", "runs.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(len(out), "runs")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/work/runs")
