"""Shared plumbing of the ablation scripts: flags, arms x seeds runs, progress and caching.

An experiment is a list of *arms* (a label, a configs/ file and dotted-key overrides) run over
seeds. `run_arms` runs each (arm, seed) in this process, one after the other (each gets the
whole machine), into <out>/runs/<arm>_s<seed>/, with a progress line per 10% of a run's steps
(at most one per 3 s, at least one a minute). A finished run is reused only if its resolved
config (and wall-clock budget) is the one the current flags would build and the code that
ran it is today's (a hash of the package's sources, the jax/flax/optax versions and Python's,
whose standard library is the default corpus): experiment.json in the run directory holds
both, so --quick results never stand in for full ones, an edited arm reruns and so does
every run after a code change (--reuse_other_code keeps runs made by other code, naming
them); --fresh reruns everything. An interrupted experiment resumes where it stopped.

Flags every script shares (define_flags); without --quick/--smoke a script runs its full
mode (200 steps x batch 16 per learner unless it says otherwise, >= 2 seeds):
  --quick       short runs (48 steps x batch 8 per learner), 1 seed unless --seeds: minutes
  --smoke       ~6 steps, 1 seed; every arm validated, only the first and last run (all arms
                named by --arms run): checks the plumbing, used by the tests
  --seeds       full mode's seeds (>= 2 where noise matters); tables give mean ± sample std
                (ddof = 1) over seeds
  --scale=mid   the same arms on the 31M-parameter `mid` model, 32 x 256 tokens per learner
                and step, 1000 steps (arm_config.MID): minutes per run on one GPU, hours on
                this CPU; learners share the devices (devices_per_learner = 1)
  --scale=tpu   the family's TPU config plus each arm's ablation settings (arm_config.py);
                wired, but cannot run on this machine; needs a checkpoint folder every VM
                reaches: --set=ray.checkpoint_dir=gs://BUCKET/ckpt (<experiment>/<run> below)
  --arms        run only these arms;  --set=key=value  an extra override for every arm
  --budget_s    wall-clock cap per run (0: the script's default, if any); local runs only
  --check_configs  build and validate every arm's config in every mode and scale (writes
                <out>/configs.json), run nothing
Config building (lengths per mode, equal eval sets, TPU scaling) lives in arm_config.py.
"""

import ast
import functools
import gc
import hashlib
import json
import os
import pathlib
import shutil
import sys
import threading
import time

from decoupled_diloco import cli, paths  # noqa: E402  (import no JAX)

cli.xla_flags()  # before JAX starts: 8 fake CPU devices, no CUDA graphs

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import outputs  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from arm_config import (  # noqa: E402
    FULL,
    QUICK,
    SET_PER_RUN,
    SMOKE,
    Arm,
    build_config,
    for_cpu_validation,
)
from outputs import results_dir  # noqa: E402
from tables import (  # noqa: E402
    Result,
    arm_colors,
    by_arm,
    equal_tokens,
    eval_curve,
    fmt,
    json_text,
    loss_ratio,
    paired,
    param_count,
    plot_bars,
    plot_curves,
    read_summary,
    rows,
    start_below_lowest,
    stat,
    table,
    tokens_per_run,
)

__all__ = ["FULL", "QUICK", "SMOKE", "Arm", "arm_colors", "by_arm", "equal_tokens", "eval_curve",
           "fmt", "loss_ratio", "paired", "param_count", "plot_bars", "plot_curves", "rows",
           "start_below_lowest", "stat", "table", "tokens_per_run"]  # fmt: skip
PROGRESS_EVERY_S = 60.0  # a progress line at least this often, even when steps stall
PROGRESS_MIN_S = 3.0  # ...and at most this often (a 10% tick of a short run is a blink)
WARM_UP_WAIT_S = 5.0  # a warm-up learner's final sync waits at most this long


def define_flags(default_out: str, default_seeds: str) -> None:
    """The flags every experiment script shares (absl; call once at import)."""
    flags.DEFINE_string(
        "out", default_out,
        "Output directory (tables, plots, runs/); --quick/--smoke runs default to "
        "experiments/results_<mode>/<name> (untracked).",
    )  # fmt: skip
    flags.DEFINE_list("seeds", default_seeds.split(","), "Seeds; every arm runs once per seed.")
    flags.DEFINE_bool("quick", False, "Short runs, 1 seed unless --seeds is given: minutes.")
    flags.DEFINE_bool("smoke", False, "~6 steps, 1 seed, tiny batches: only checks the plumbing.")
    flags.DEFINE_enum(
        "scale", "cpu", ["cpu", "mid", "tpu"],
        "cpu: tiny configs; mid: the 31M-param `mid` model at 32 x 256 tokens per learner and "
        "step, 1000 steps (for a GPU; arm_config.py); tpu: configs/tpu_*.",
    )  # fmt: skip
    flags.DEFINE_bool("fresh", False, "Rerun runs whose summary.json already exists.")
    flags.DEFINE_bool(
        "reuse_other_code", False,
        "Reuse finished runs of the same config made by other code (another package version "
        "or edited sources); by default they rerun.",
    )  # fmt: skip
    flags.DEFINE_list("arms", [], "Run only these arms (default: all).")
    flags.DEFINE_multi_string("set", [], "key=value override for every arm, e.g. diloco.alpha=0.5")
    flags.DEFINE_float("budget_s", 0.0, "Wall-clock cap per run (s); 0 = the script's default.")
    flags.DEFINE_bool("check_configs", False, "Build + validate every arm's config; run nothing.")
    # The script's own key flags too, so its --help lists them (absl lists the main module's).
    for flag in flags.FLAGS.get_key_flags_for_module(__name__):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)


def mode() -> str:
    FLAGS = flags.FLAGS
    return "smoke" if FLAGS.smoke else "quick" if FLAGS.quick else "full"


def is_full() -> bool:
    return mode() == "full"


def seeds() -> list[int]:
    FLAGS = flags.FLAGS
    # --quick runs one seed unless --seeds is given explicitly (quick runs with a spread).
    if FLAGS.smoke or (FLAGS.quick and not FLAGS["seeds"].present):
        return [0]
    return parse_seeds(FLAGS.seeds)


def parse_seeds(texts: list[str]) -> list[int]:
    """--seeds as distinct integers >= 0 (a usage error naming the flag otherwise)."""
    try:
        return outputs.parse_seeds(texts)
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def extra_overrides() -> dict:
    """--set key=value pairs; values parsed as Python literals where possible."""
    out = {}
    for item in flags.FLAGS.set:
        key, sep, text = item.partition("=")
        if not sep:
            raise app.UsageError(f"--set={item!r}: expected key=value")
        if key in SET_PER_RUN:
            raise app.UsageError(f"--set={item!r}: {key} is set for each run ({SET_PER_RUN[key]})")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text
    return out


def selected(arms: list[Arm]) -> list[Arm]:
    """The arms --arms names; a name also selects its variants `<name>@...` (e.g. one arm
    at several swept values)."""
    names = flags.FLAGS.arms
    match = lambda a, n: a.name == n or a.name.startswith(n + "@")
    unknown = sorted(n for n in names if not any(match(a, n) for a in arms))
    if unknown:
        raise app.UsageError(f"--arms: unknown {unknown}; choose from {[a.name for a in arms]}")
    return [a for a in arms if any(match(a, n) for n in names)] if names else arms


def config_for(arm: Arm, seed: int, quick: dict, full: dict):
    FLAGS, m = flags.FLAGS, mode()
    length = {"smoke": SMOKE, "quick": quick, "full": full}[m]
    c = build_config(arm, seed, FLAGS.scale, m, length, extra_overrides())
    # One folder per experiment and run (a Ray run's learners and syncer save there; that
    # folder is removed with the run's when it is run again: `_fresh_checkpoints`).
    if (FLAGS.scale == "tpu" or c.runtime == "ray") and c.ray.checkpoint_dir:
        root = c.ray.checkpoint_dir.rstrip("/")
        c.ray.checkpoint_dir = f"{root}/{out_dir().name}/{c.name}"
    return c


def out_dir() -> pathlib.Path:
    FLAGS = flags.FLAGS
    return results_dir(FLAGS.out, mode(), FLAGS["out"].present)


def setup() -> pathlib.Path:
    """Compilation cache, quiet logs; returns the output folder, created only once the arms
    are checked (`run_arms`) or something is written into it: a typo leaves no folder."""
    from decoupled_diloco import compile_cache

    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO
    compile_cache.enable()
    out = out_dir()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    return out


def check_configs(arms_fn, out: pathlib.Path, quick: dict, full: dict) -> None:
    """Builds and validates every arm's config in every mode and scale; with --out, writes
    them to <out>/configs.json (never into the published results, the default folder).

    TPU-scale configs are validated with their mesh shrunk to this machine's devices
    (arm_config.for_cpu_validation): everything but the device layout is checked.
    """
    import jax

    from decoupled_diloco import config as config_lib

    FLAGS = flags.FLAGS
    saved = FLAGS.quick, FLAGS.smoke, FLAGS.scale
    dump = {}
    try:
        for scale in ("cpu", "mid", "tpu"):
            for m in ("smoke", "quick", "full"):
                FLAGS.quick, FLAGS.smoke, FLAGS.scale = m == "quick", m == "smoke", scale
                arms = selected(arms_fn())
                for arm in arms:
                    for seed in seeds():
                        c = config_for(arm, seed, quick, full)
                        tpu = scale == "tpu"
                        check = for_cpu_validation(c, jax.device_count()) if tpu else c
                        config_lib.validate(check)
                        dump[f"{scale}/{m}/{arm.name}/{seed}"] = json.loads(c.to_json_best_effort())
                print(f"{scale} {m}: {len(arms)} arms x seeds {seeds()} valid", flush=True)
    finally:
        FLAGS.quick, FLAGS.smoke, FLAGS.scale = saved
    if not FLAGS["out"].present:
        print(f"{len(dump)} configs valid (--out=DIR writes them to DIR/configs.json)")
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "configs.json").write_text(json.dumps(dump, indent=1, sort_keys=True))
    print(f"wrote {out}/configs.json ({len(dump)} configs)", flush=True)


@functools.cache
def code_fingerprint() -> str:
    """16 hex digits of sha256 over the package's Python sources (path and bytes) and the
    versions of the libraries a run's numbers depend on: what made a run besides its config.
    Python's own version too: the default corpus (data.source "stdlib") is the running
    interpreter's standard library, other text under another Python."""
    import platform

    import flax
    import jax
    import optax

    import decoupled_diloco

    root = pathlib.Path(decoupled_diloco.__file__).parent
    versions = f"jax {jax.__version__} flax {flax.__version__} optax {optax.__version__}"
    versions += f" python {platform.python_version()}"
    h = hashlib.sha256(versions.encode())
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _stamp(c, budget_s: float) -> dict:
    text = c.to_json_best_effort(sort_keys=True)
    digest = hashlib.sha256(f"{text}|budget_s={budget_s:g}".encode()).hexdigest()[:16]
    return {"hash": digest, "code": code_fingerprint(), "budget_s": budget_s,
            "config": json.loads(text)}  # fmt: skip


def _reusable(rundir: pathlib.Path, stamp: dict) -> bool:
    """Whether a finished run in `rundir` stands for `stamp`'s (module docstring); says why
    not when it holds a finished run that does not."""
    FLAGS, path = flags.FLAGS, rundir / "experiment.json"
    if FLAGS.fresh or not (rundir / "summary.json").exists() or not path.exists():
        return False
    try:
        prior = json.loads(path.read_text())
    except ValueError:  # (JSONDecodeError, UnicodeDecodeError: cut short, damaged)
        prior = None
    if not isinstance(prior, dict):
        print(f"  {rundir.name}: its {path.name} is unreadable, rerunning", flush=True)
        return False
    if prior.get("hash") != stamp["hash"]:
        print(f"  {rundir.name}: cached run has another config, rerunning", flush=True)
        return False
    code = prior.get("code", "unknown")
    if code != stamp["code"]:
        if FLAGS.reuse_other_code:
            print(f"  {rundir.name}: reusing a run made by other code ({code})", flush=True)
            return True
        print(f"  {rundir.name}: cached run was made by other code ({code}, now "
              f"{stamp['code']}), rerunning (--reuse_other_code keeps it)", flush=True)  # fmt: skip
        return False
    return True


def _warm_up(run, rundir: pathlib.Path) -> None:
    """Compiles what `run` will compile (every learner's train step on its mesh, the
    evaluator) by running it for 2 steps into a scratch folder, so that the persistent
    compilation cache is warm when the measured run starts. Without it the first seed of
    every arm starts its learners staggered by seconds of compilation, and in asynchronous
    arms that changes who merges with whom, i.e. the result."""
    import dataclasses

    from decoupled_diloco.runtime.local import LocalRuntime

    scratch = rundir.with_name(rundir.name + ".warmup")
    shutil.rmtree(scratch, ignore_errors=True)
    print("    warming up (compiling; 2 steps, not measured)", flush=True)
    # A learner that joins late (membership schedules) may come in as the others halt:
    # its final sync, with no merge coming, would wait the whole diloco.final_wait.
    diloco = dataclasses.replace(run.diloco, final_wait=min(run.diloco.final_wait, WARM_UP_WAIT_S))
    run = dataclasses.replace(run, diloco=diloco)
    t0, verbosity = time.monotonic(), logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)  # (its warnings are the measured run's again)
    try:
        LocalRuntime(run, str(scratch), verbose=False, halt_after=2).run()
    finally:
        logging.set_verbosity(verbosity)
    print(f"    warmed up in {time.monotonic() - t0:.0f} s", flush=True)
    gc.collect()  # the warm-up's learners (reference cycles) and their device memory
    shutil.rmtree(scratch, ignore_errors=True)


def _run_local(run, rundir: pathlib.Path, label: str, budget_s: float) -> dict:
    """A local-runtime run with a progress line per 10% of its steps, stopped at budget_s."""
    from decoupled_diloco.runtime.local import LocalRuntime

    rt = LocalRuntime(run, str(rundir), verbose=False)
    done = threading.Event()
    total = run.train.steps
    tick = max(total // 10, 1)

    def monitor():
        while rt.t0 == 0.0:  # run() starts the clock once learners and syncer are built
            if done.wait(0.1):
                return
        next_step, last = tick, -PROGRESS_EVERY_S  # the first tick prints at once
        while not done.wait(0.5):
            now = rt.now()
            if budget_s and now >= budget_s and not rt.stop.is_set():
                print(f"    {label}: budget of {budget_s:.0f} s reached, stopping", flush=True)
                rt.stop.set()
            step, quiet = max(lp.step for lp in rt.loops), time.monotonic() - last
            if (step >= next_step and quiet >= PROGRESS_MIN_S) or quiet >= PROGRESS_EVERY_S:
                merges = f", merges {rt.log.ledger.merges}" if run.uses_syncer else ""
                print(
                    f"    {label}: step {step}/{total} ({100 * step // total}%) {now:.0f} s, "
                    f"{rt.total_tokens() / max(now, 1e-9) / 1e3:.1f}k tok/s{merges}",
                    flush=True,
                )
                next_step, last = (step // tick + 1) * tick, time.monotonic()

    thread = threading.Thread(target=monitor, daemon=True)
    thread.start()
    try:
        return rt.run()
    finally:
        done.set()
        thread.join()


def _fresh_checkpoints(run) -> None:
    """Removes the checkpoints a Ray run keeps outside its run directory (ray.checkpoint_dir,
    one per run: `config_for`) before the run is run again, as the run directory is: left
    there, the launch found a run that trained but no run_config.json beside it and refused
    to start (an interrupted run, an edited arm, --fresh, a code change)."""
    from etils import epath

    if run.runtime == "ray" and run.ray.checkpoint_dir:
        folder = epath.Path(run.ray.checkpoint_dir)
        if folder.exists():
            print(f"    removing the earlier attempt's checkpoints in {folder}", flush=True)
            folder.rmtree()


def run_budget(budget_s: dict | None) -> float:
    """The wall-clock cap per run in seconds (0: none): --budget_s, else the script's own
    `budget_s` for the mode at --scale=cpu only. A script's caps are sized for its tiny runs
    on a 2-core machine; at mid and TPU scale they would cut real runs short (and a Ray
    run's cannot be kept: `check_budget`)."""
    FLAGS = flags.FLAGS
    if FLAGS.budget_s:
        return FLAGS.budget_s
    return (budget_s or {}).get(mode(), 0.0) if FLAGS.scale == "cpu" else 0.0


def check_budget(arm: str, runtime: str, budget: float) -> None:
    """A usage error where a wall-clock cap would not stop the arm's runs: only the local
    runtime's (`_run_local`) is watched; a Ray run ran to its step budget while the others
    stopped at the cap, and the tables said every run had it."""
    if budget and runtime != "local":
        cap = f"--budget_s={budget:g}" if flags.FLAGS.budget_s else f"the script's {budget:g} s"
        raise app.UsageError(
            f"arm {arm}: a wall-clock cap ({cap}) stops runs of the local runtime only; "
            f"this arm runs on {runtime!r}"
        )


def run_arms(arms, out: pathlib.Path, quick: dict = QUICK, full: dict = FULL,
             budget_s: dict | None = None) -> list[Result]:  # fmt: skip
    """Runs every (arm, seed) not already done; `arms` is a list or a function returning one
    (called after the flags are parsed). `budget_s`: wall-clock cap per run by mode."""
    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime import launch

    FLAGS = flags.FLAGS
    arms_fn = arms if callable(arms) else lambda: arms
    if FLAGS.check_configs:
        check_configs(arms_fn, out, quick, full)
        raise SystemExit(0)
    if FLAGS.budget_s < 0:
        raise app.UsageError(f"--budget_s={FLAGS.budget_s:g}: a cap in seconds, >= 0 (0: none)")
    parse_seeds(FLAGS.seeds)  # even where --smoke or --quick run seed 0 alone
    budget = run_budget(budget_s)
    arms = selected(arms_fn())
    for arm in arms:  # fail fast: a typo in the last arm must not cost the first hour
        try:
            run = config_lib.validate(config_for(arm, seeds()[0], quick, full))
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # (--set, --scale)
            raise app.UsageError(f"arm {arm.name}: {e}") from e
        check_budget(arm.name, run.runtime, budget)
    if FLAGS.smoke and not FLAGS.arms and len(arms) > 2:
        arms = [arms[0], arms[-1]]
    todo = [(a, s) for s in seeds() for a in arms]
    print(f"{len(todo)} runs: {len(arms)} arms x seeds {seeds()}, {mode_note()}", flush=True)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    results, t0, warm = [], time.time(), set()
    for i, (arm, seed) in enumerate(todo, 1):
        c = config_for(arm, seed, quick, full)
        stamp = _stamp(c, budget)
        rundir = out / "runs" / f"{arm.name}_s{seed}"
        cached = _reusable(rundir, stamp)
        if not cached:
            if rundir.exists():
                shutil.rmtree(rundir)  # a partial run would resume from its checkpoints
            run = config_lib.validate(c)
            _fresh_checkpoints(run)
            print(f"  {arm.name} seed {seed}: {run.train.steps} steps x {run.num_learners} "
                  f"learner(s) x batch {run.train.batch_size}", flush=True)  # fmt: skip
            if run.runtime == "local":
                if arm.name not in warm and mode() != "smoke":
                    _warm_up(run, rundir)
                    warm.add(arm.name)
                _run_local(run, rundir, f"{arm.name} s{seed}", budget)
                gc.collect()  # the run's learners (reference cycles) and their device memory
            else:
                launch.run(run, str(rundir), verbose=True)
            # The tables need only the logs; orbax checkpoints are MBs per run.
            shutil.rmtree(rundir / "checkpoints", ignore_errors=True)
        # A diverged run's loss is nan (a float, `read_summary`), shown as such; the stamp
        # comes after the summary is read, so a run whose summary cannot be is run again.
        summary = read_summary(rundir)
        if not cached:  # (whole or not at all, as summary.json: a kill never cuts it short)
            paths.write_atomic(rundir / "experiment.json", json.dumps(stamp, indent=1))
        results.append(Result(arm, seed, summary, rundir, c))
        elapsed = time.time() - t0
        eta = elapsed / i * (len(todo) - i)
        print(
            f"[{i}/{len(todo)} {elapsed:6.0f} s, eta {eta / 60:.0f} min] {arm.name} seed {seed}"
            f"{' (cached)' if cached else ''}: eval {summary['final_eval_loss']:.4f} "
            f"goodput {summary.get('goodput', float('nan')):.3f} "
            f"merges {summary.get('merges', 0)} steps {summary['steps']} "
            f"wall {summary['wall_seconds']:.0f} s",
            flush=True,
        )
    return results


# --- writing results -------------------------------------------------------------------
def mode_note() -> str:
    FLAGS = flags.FLAGS
    note = f"mode {mode()}, scale {FLAGS.scale}, seeds {seeds()}"
    if len(seeds()) > 1:
        note += ", mean ± sample std (ddof = 1) over seeds"
    if FLAGS.set:
        note += ", --set " + " ".join(FLAGS.set)
    return note


def write(out: pathlib.Path, name: str, markdown: str, fig, results: list[Result]) -> None:
    """<name>.md, <name>.png and <name>.json (every summary) into `out`; prints the table."""
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(markdown)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)
    dump = [{"arm": r.arm.name, "seed": r.seed, "summary": r.summary} for r in results]
    (out / f"{name}.json").write_text(json_text(dump))
    print(markdown)
    print(f"wrote {out}/{name}.{{md,png,json}}", flush=True)
