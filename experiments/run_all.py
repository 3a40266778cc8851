r"""Every ablation of the paper, one after the other, with progress and a summary at the end.

    python experiments/run_all.py --quick     # all 12, 1 seed each: ~40 min on an idle 2-core box
    python experiments/run_all.py             # full mode, 2 seeds each: ~4.5 h idle
    python experiments/run_all.py --only=heterogeneous,merge_rule --out=/tmp/dd_results
    python experiments/run_all.py --dry_run   # print the commands only

Each experiment runs as its own process (absl flags are per process) with --out=<out>/<name>,
so results land where each script's own default puts them when --out is left alone
(experiments/results/<name>/ in full mode, experiments/results_quick|smoke/<name>/ otherwise:
experiments/outputs.py); finished runs are reused (see harness.py: only when their
config matches), so an interrupted run_all resumes. An experiment that fails is reported
and the others still run; the exit status is non-zero if any failed.
--seeds, --scale, --fresh, --reuse_other_code and --smoke are passed through to every
script.

Expected minutes on an idle 2-core machine (a machine shared with other work is slower;
each script's docstring says what its modes run):

    experiment              --quick   full (2 seeds)
    quality_ladder              8      50
    quality_targets             5      31
    quality_equal_tokens        4      35
    learners_sweep            2.5      18
    quorum_grace                2      20
    heterogeneous               2      11
    merge_rule                  3      27
    precision                 2.5      24
    fragmentation               2      17
    scavenging                2.5      11
    cross_region              1.5      12
    goodput_failures            5      14
    all                        40     270 (~4.5 h)
"""

import pathlib
import subprocess
import sys
import time

import outputs
from absl import app, flags

from decoupled_diloco import cli

HERE = pathlib.Path(__file__).resolve().parent
# (script, expected minutes --quick, expected minutes full), in the order; the table
# in the docstring above repeats these numbers.
EXPERIMENTS = (
    ("quality_ladder", 8, 50),
    ("quality_targets", 5, 31),
    ("quality_equal_tokens", 4, 35),
    ("learners_sweep", 2.5, 18),
    ("quorum_grace", 2, 20),
    ("heterogeneous", 2, 11),
    ("merge_rule", 3, 27),
    ("precision", 2.5, 24),
    ("fragmentation", 2, 17),
    ("scavenging", 2.5, 11),
    ("cross_region", 1.5, 12),
    ("goodput_failures", 5, 14),
)

SMOKE_MIN = 1  # an experiment's --smoke run, about (plumbing only)

flags.DEFINE_string("out", "experiments/results", "Root folder: <out>/<experiment>/.")
flags.DEFINE_bool("quick", False, "Every experiment in --quick mode (minutes each).")
flags.DEFINE_bool("smoke", False, "Every experiment in --smoke mode (plumbing only).")
flags.DEFINE_list("only", [], "Run only these experiments (default: all).")
flags.DEFINE_list("skip", [], "Skip these experiments.")
flags.DEFINE_list("seeds", None, "Passed through: seeds of every experiment.")
flags.DEFINE_enum("scale", "cpu", ["cpu", "mid", "tpu"], "Passed through: cpu | mid | tpu.")
flags.DEFINE_bool("fresh", False, "Passed through: rerun finished runs.")
flags.DEFINE_bool("reuse_other_code", False, "Passed through: keep runs made by other code.")
flags.DEFINE_bool("dry_run", False, "Print the commands, run nothing.")
FLAGS = flags.FLAGS


def commands() -> list[tuple[str, float, list[str]]]:
    names = [n for n, _, _ in EXPERIMENTS]
    unknown = sorted(set(FLAGS.only + FLAGS.skip) - set(names))
    if unknown:
        raise app.UsageError(f"unknown experiments {unknown}; choose from {names}")
    try:  # here, not in each experiment after the ones before it ran
        outputs.parse_seeds(FLAGS.seeds or ["0"])
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    out, mode = [], "smoke" if FLAGS.smoke else "quick" if FLAGS.quick else "full"
    root = outputs.results_dir(FLAGS.out, mode, FLAGS["out"].present)
    for name, quick_min, full_min in EXPERIMENTS:
        if (FLAGS.only and name not in FLAGS.only) or name in FLAGS.skip:
            continue
        cmd = [sys.executable, str(HERE / f"{name}.py"), f"--out={root / name}"]
        cmd += ["--quick"] * FLAGS.quick + ["--smoke"] * FLAGS.smoke + ["--fresh"] * FLAGS.fresh
        cmd += ["--reuse_other_code"] * FLAGS.reuse_other_code
        cmd += [f"--seeds={','.join(FLAGS.seeds)}"] if FLAGS.seeds else []
        cmd += [f"--scale={FLAGS.scale}"] if FLAGS.scale != "cpu" else []
        minutes = SMOKE_MIN if FLAGS.smoke else quick_min if FLAGS.quick else full_min
        out.append((name, minutes, cmd))
    return out


def main(argv):
    del argv
    todo = commands()
    total = sum(m for _, m, _ in todo)
    mode = "--smoke" if FLAGS.smoke else "--quick" if FLAGS.quick else "full"
    print(f"{len(todo)} experiments, mode {mode}, expected ~{total:g} min idle", flush=True)
    done, t0 = [], time.time()
    for i, (name, minutes, cmd) in enumerate(todo, 1):
        so_far = (time.time() - t0) / 60
        print(f"\n=== [{i}/{len(todo)}] {name} (expected ~{minutes:g} min; {so_far:.1f} min "
              f"so far)\n{' '.join(cmd)}", flush=True)  # fmt: skip
        if FLAGS.dry_run:
            continue
        start = time.time()
        code = subprocess.run(cmd, check=False).returncode
        done.append((name, code, (time.time() - start) / 60, cmd[2].removeprefix("--out=")))
        print(f"=== {name}: {'ok' if code == 0 else f'FAILED ({code})'} in {done[-1][2]:.1f} min",
              flush=True)  # fmt: skip
    if FLAGS.dry_run:
        return
    print(f"\nSummary ({mode}, {(time.time() - t0) / 60:.1f} min in all):")
    for name, code, minutes, out in done:
        wrote = f"{out}/{name}.md (+ .png, .json)" if code == 0 else "-"
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        print(f"  {name:<22} {status:<18} {minutes:6.1f} min  {wrote}")
    if any(code for _, code, _, _ in done):
        sys.exit(1)


if __name__ == "__main__":
    cli.run_script(main)
