"""Adds runs' mean merge delays to merge_delays.json (run from anywhere, after the runs):

    python collect_delays.py lat0_h18=/tmp/runs/lat0_h18/runs ...

Each argument is FOLDER=RUNS: FOLDER names a result folder here, RUNS the `runs/` directory
quality_targets.py wrote (one `<arm>_s<seed>/` per run, whose metrics.jsonl is not kept in
the repo); unfinished runs (no summary.json) are skipped. The delay is
`report.mean_merge_delay` over the run's learner rows: steps from an offer to the boundary
applying the merge holding it. Runs made since summary.json has `mean_merge_delay_steps`
need none of this.
"""

import json
import pathlib
import sys

from decoupled_diloco import report

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / "merge_delays.json"


def main(args: list[str]) -> None:
    table = json.loads(OUT.read_text()) if OUT.exists() else {}
    for arg in args:
        folder, runs = arg.split("=", 1)
        for run in sorted(pathlib.Path(runs).iterdir()):
            if not (run / "summary.json").exists():
                continue  # did not finish
            with open(run / "metrics.jsonl", encoding="utf-8") as f:
                rows = [json.loads(line) for line in f]
            seed = run.name.rsplit("_s", 1)[1]
            delay = report.mean_merge_delay([r for r in rows if isinstance(r["learner"], int)])
            table.setdefault(folder, {})[seed] = None if delay is None else round(delay, 2)
    OUT.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
