r"""Crash scenario, real runs: Decoupled DiLoCo (M = 4, K = 1) vs data-parallel, side by side.

    pip install -e .   # once
    python experiments/chaos_crashes.py            # configs/chaos_crashes.py: ~9 min on 2 cores
    python experiments/chaos_crashes.py --quick    # 140 steps, crashes every ~15 s: ~4 min

Runs configs/chaos_crashes.py twice, one arm after the other so each has the whole
machine: "decoupled" (4 learners of 16 chips, K = 1) and "dp" (one job of the same 64
chips, restarting from its last checkpoint). Both share the seeded failure process, so
they crash at the same wall-clock times. Each arm stops at its step budget or after
--budget_s seconds of wall time, whichever comes first: when failures come faster than
DP gets from one checkpoint to the next (a busy machine makes steps slow), DP redoes the
same steps forever, and only the wall-clock budget ends it. Prints and writes into --out:
  chaos_crashes.md    goodput, uptime, downtime, failures, eval loss at equal wall time
                      (the last evaluation of each arm before the shorter run ended),
                      final eval loss, tokens
  chaos_crashes.json  both summaries plus the eval curves and crash times
  chaos_crashes.png   eval loss against wall time for both arms, crashes marked
Run directories (metrics.jsonl, merges.jsonl, events.jsonl) go to --workdir/<arm>.
"""

import importlib.util
import pathlib
import shutil
import threading
import time

from decoupled_diloco import cli  # noqa: E402  (imports no JAX)

cli.xla_flags()  # before JAX starts: 8 fake CPU devices, no CUDA graphs

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import flags, logging  # noqa: E402
from outputs import results_dir  # noqa: E402
from tables import json_text, numbers  # noqa: E402

from decoupled_diloco import compile_cache  # noqa: E402
from decoupled_diloco import config as config_lib  # noqa: E402
from decoupled_diloco.metrics import parse_jsonl  # noqa: E402
from decoupled_diloco.runtime.local import LocalRuntime  # noqa: E402

flags.DEFINE_string("out", "experiments/results/chaos_crashes", "Output directory.")
flags.DEFINE_string("workdir", "/tmp/dd_chaos_crashes", "Run directories (wiped per arm).")
flags.DEFINE_bool("quick", False, "Fewer steps, more frequent crashes, 150 s budget.")
flags.DEFINE_float("budget_s", 0.0, "Wall-clock cap per arm (s); 0 = 420 (150 with --quick).")
FLAGS = flags.FLAGS

ARMS = ("decoupled", "dp")
LABELS = {"decoupled": "Decoupled DiLoCo (M=4, K=1)", "dp": "data-parallel"}
CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "chaos_crashes.py"
# --quick: 64 chips of 16 min MTBF fail every ~15 s; shorter restarts and checkpoints.
QUICK = {
    "train.steps": 140,
    "train.eval_every": 20,
    "train.checkpoint_every": 20,
    "faults.chip_mtbf_hours": 16 / 60,
    "faults.restart_delay_s": 4.0,
}


def make_config(arm: str, quick: bool):
    spec = importlib.util.spec_from_file_location("chaos_crashes_config", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config(arm)
    for key, value in (QUICK if quick else {}).items():
        section, field = key.split(".")
        c[section][field] = value
    return c


def _rows(workdir: pathlib.Path, name: str) -> list[dict]:
    """A run file's records; a diverged run's "nan" losses as floats (tables.numbers)."""
    path = workdir / name
    return [numbers(r) for r in parse_jsonl(path.read_text(encoding="utf-8"), str(path))]


def run_with_budget(run, workdir: pathlib.Path, budget_s: float, label: str = "") -> dict:
    """A local run that is stopped (learners finish as at their last step) at budget_s,
    with a progress line every tenth of it (at most a minute apart)."""
    rt = LocalRuntime(run, str(workdir), verbose=False)
    every = min(max(budget_s / 10, 5.0), 60.0)

    def stopper():
        while rt.t0 == 0.0:  # run() starts the clock once everything is built
            time.sleep(0.1)
        shown = 0.0
        while not rt.stop.wait(0.2):
            now = rt.now()
            if now >= budget_s:
                rt.stop.set()
            elif now - shown >= every:
                shown = now
                steps = "/".join(str(loop.step) for loop in rt.loops)
                merges = f", merges {rt.log.ledger.merges}" if run.uses_syncer else ""
                print(f"    {label}: {now:.0f} of {budget_s:.0f} s, learner steps {steps}{merges}",
                      flush=True)  # fmt: skip

    threading.Thread(target=stopper, daemon=True).start()
    return rt.run()


def run_arm(arm: str, quick: bool, workdir: pathlib.Path, budget_s: float) -> dict:
    if workdir.exists():
        shutil.rmtree(workdir)  # a stale run would be resumed from its checkpoints
    t0 = time.time()
    run = config_lib.validate(make_config(arm, quick))
    summary = run_with_budget(run, workdir, budget_s, arm)
    # DP evaluates inside its learner (rows of learner 0); Decoupled evaluates the global
    # model (rows of learner "global"); both end with a "global" row.
    curve = sorted(
        (r["time"], r["eval_loss"]) for r in _rows(workdir, "metrics.jsonl") if "eval_loss" in r
    )
    first_step = min(r["time"] for r in _rows(workdir, "metrics.jsonl") if r["learner"] != "global")
    events = _rows(workdir, "events.jsonl")
    crashes = [(e["time"], e["learner"]) for e in events if e["event"] == "learner_down"]
    print(
        f"[{time.time() - t0:5.0f} s] {arm}: goodput {summary['goodput']:.3f} uptime "
        f"{summary['uptime']:.3f} downtime {summary['global_downtime_seconds']:.0f} s "
        f"failures {summary['failures']} final eval {summary['final_eval_loss']:.3f}",
        flush=True,
    )
    return {"summary": summary, "curve": curve, "crashes": crashes, "first_step": first_step}


def loss_at(curve: list[tuple[float, float]], t: float) -> float | None:
    """The last evaluation at or before wall time t (None if none; nan if it diverged)."""
    before = [loss for time_s, loss in curve if time_s <= t + 1e-9]
    return before[-1] if before else None


def _loss_cell(loss: float | None) -> str:
    return "- (no evaluation yet)" if loss is None else f"{loss:.3f}"


def markdown(results: dict, quick: bool, budget_s: float) -> str:
    t_eq = min(r["summary"]["wall_seconds"] for r in results.values())
    out = [
        f"Crash scenario (configs/chaos_crashes.py{', --quick' if quick else ''}): the same "
        f"seeded chip failures hit both arms, each capped at {budget_s:.0f} s of wall time; "
        "eval loss at equal wall time "
        f"= the last evaluation at or before {t_eq:.0f} s. Wall time includes start-up "
        "and compilation (first step column).",
        "",
        "| arm | goodput | uptime | downtime (s) | failures | restarts | merges "
        f"| eval loss @ {t_eq:.0f} s | final eval loss | steps | tokens | first step (s) "
        "| wall (s) |",
        "|---" * 13 + "|",
    ]
    for arm, r in results.items():
        s = r["summary"]
        out.append(
            f"| {LABELS[arm]} | {100 * s['goodput']:.1f}% | {100 * s['uptime']:.1f}% "
            f"| {s['global_downtime_seconds']:.0f} | {s['failures']} | {s['restarts']} "
            f"| {s.get('merges', 0)} | {_loss_cell(loss_at(r['curve'], t_eq))} "
            f"| {s['final_eval_loss']:.3f} | {s['steps']} | {s['tokens']:,} "
            f"| {r['first_step']:.0f} | {s['wall_seconds']:.0f} |"
        )
    return "\n".join(out) + "\n"


def plot(results: dict, path: pathlib.Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (arm, r) in enumerate(results.items()):
        t, loss = zip(*r["curve"], strict=True)
        ax.plot(t, loss, marker="o", ms=3, color=f"C{i}", label=LABELS[arm])
        # Crashes as ticks along the bottom, one row per arm.
        when = [c[0] for c in r["crashes"]]
        ax.plot(
            when,
            [0.02 + 0.04 * i] * len(when),
            "|",
            ms=10,
            color=f"C{i}",
            transform=ax.get_xaxis_transform(),
            label=f"{arm} crashes",
        )
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("eval loss (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Eval loss vs wall time under the same crash schedule")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO
    compile_cache.enable()
    out = results_dir(FLAGS.out, "quick" if FLAGS.quick else "full", FLAGS["out"].present)
    out.mkdir(parents=True, exist_ok=True)
    budget = FLAGS.budget_s or (150.0 if FLAGS.quick else 420.0)
    results = {
        arm: run_arm(arm, FLAGS.quick, pathlib.Path(FLAGS.workdir) / arm, budget) for arm in ARMS
    }
    table = markdown(results, FLAGS.quick, budget)
    (out / "chaos_crashes.md").write_text(table)
    (out / "chaos_crashes.json").write_text(json_text(results))
    plot(results, out / "chaos_crashes.png")
    print(table)
    print(f"wrote {out}/chaos_crashes.{{md,json,png}}")


if __name__ == "__main__":
    cli.run_script(main)
