"""Shared plumbing of the ablation scripts: flags, arms x seeds runs, tables and plots.

An experiment is a list of *arms* (a label, a base config and dotted-key overrides) run over
seeds. `run_arms` runs each (arm, seed) in this process, one after the other (each gets the
whole machine), writing <out>/runs/<arm>_s<seed>/ and skipping runs whose summary.json is
already there, so an interrupted experiment resumes where it stopped (--fresh reruns).

Scales: --scale=cpu (default) uses the tiny configs here; --scale=tpu swaps in the arm's TPU
base config (configs/tpu_*.py, the Ray runtime, a slice per learner) and drops CPU-only
overrides. TPU scale is wired but cannot run on this machine.
Lengths: full (the script's own), --quick (minutes), --smoke (~6 steps, 1 seed, every arm
validated but only the first and last run; for tests).
"""

import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
from absl import flags, logging  # noqa: E402

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
TPU_BASE = {"moe": "tpu_moe_v5p", "dense": "tpu_dense_multislice"}
# Keys that only make sense on 8 fake CPU devices; TPU scale keeps the slice layout.
CPU_ONLY = ("devices_per_learner", "model.preset", "model.num_layers", "data.", "train.")
# --quick default: short runs at batch 8 per learner (2 busy cores manage ~1-2k tokens/s).
QUICK = {
    "train.steps": 48,
    "train.warmup_steps": 5,
    "train.eval_every": 16,
    "train.batch_size": 8,
    "train.eval_batches": 4,
}
SMOKE = {
    "train.steps": 6,
    "train.batch_size": 8,
    "train.warmup_steps": 1,
    "train.eval_every": 3,
    "train.eval_batches": 2,
    "train.log_every": 1,
    "data.seq_len": 64,
    "data.max_corpus_bytes": 400_000,
}


def define_flags(default_out: str, default_seeds: str) -> None:
    """The flags every experiment script shares (absl; call once at import)."""
    flags.DEFINE_string("out", default_out, "Output directory (tables, plots, runs/).")
    flags.DEFINE_list("seeds", default_seeds.split(","), "Seeds; every arm runs once per seed.")
    flags.DEFINE_bool("quick", False, "Short runs, 1 seed unless --seeds is given: minutes.")
    flags.DEFINE_bool("smoke", False, "~6 steps, 1 seed, tiny batches: only checks the plumbing.")
    flags.DEFINE_enum("scale", "cpu", ["cpu", "tpu"], "cpu: tiny configs; tpu: configs/tpu_*.")
    flags.DEFINE_bool("fresh", False, "Rerun runs whose summary.json already exists.")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One setting of an experiment: `config` is a configs/ file (optionally `file:arg`)."""

    name: str
    config: str
    overrides: dict = dataclasses.field(default_factory=dict)
    label: str = ""
    model: str = "dense"  # which TPU base config stands in at --scale=tpu


@dataclasses.dataclass
class Result:
    arm: Arm
    seed: int
    summary: dict
    rundir: pathlib.Path


def load_config(spec: str):
    """`tiny_decoupled` or `heterogeneous:sync` -> that file's get_config(arg)."""
    name, _, arg = spec.partition(":")
    path = CONFIG_DIR / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(f"dd_config_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def set_key(c, key: str, value) -> None:
    *path, last = key.split(".")
    node = c
    for p in path:
        node = node[p]
    node[last] = value


def build_config(arm: Arm, seed: int, scale: str, length: dict):
    """The arm's validated-ready ConfigDict for one seed; `length` = quick/smoke overrides."""
    if scale == "tpu":
        c = load_config(TPU_BASE[arm.model])
        overrides = {k: v for k, v in arm.overrides.items() if not k.startswith(CPU_ONLY)}
        from_file = load_config(arm.config)  # the arm's algorithm settings, not its sizes
        for key in ("diloco", "faults"):
            c[key] = from_file[key]
        c.diloco.heartbeat_timeout = 600.0
    else:
        c = load_config(arm.config)
        # Quick lengths yield to an arm's own sizes; smoke shrinks everything.
        smoke = length is SMOKE
        overrides = ({} if smoke else length) | arm.overrides | (length if smoke else {})
    for key, value in overrides.items():
        set_key(c, key, value)
    c.seed = seed
    c.data.seed = seed
    c.faults.seed = seed
    c.train.checkpoint_every = 0 if c.diloco.sync_every else c.train.checkpoint_every
    if c.diloco.sync_every:  # a sync period longer than the run would never merge mid-run
        h = min(c.diloco.sync_every, c.train.steps)
        c.diloco.sync_every = h
        c.diloco.fragments = min(c.diloco.fragments, h)
        c.diloco.overlap = min(c.diloco.overlap, h - 1)
    return c


def length_overrides(quick: dict, full: dict | None = None) -> dict:
    """The length overrides the flags select (smoke wins over quick; full mode: `full`)."""
    FLAGS = flags.FLAGS
    if FLAGS.smoke:
        return SMOKE
    return quick if FLAGS.quick else (full or {})


def is_full() -> bool:
    return not (flags.FLAGS.quick or flags.FLAGS.smoke)


def seeds() -> list[int]:
    FLAGS = flags.FLAGS
    # --quick runs one seed unless --seeds is given explicitly (quick runs with a spread).
    if FLAGS.smoke or (FLAGS.quick and not FLAGS["seeds"].present):
        return [0]
    return [int(s) for s in FLAGS.seeds]


def setup() -> pathlib.Path:
    """Compilation cache, quiet logs, output folder; returns the output folder."""
    import jax

    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO
    jax.config.update(
        "jax_compilation_cache_dir",
        os.environ.get("DD_COMPILATION_CACHE", os.path.expanduser("~/.cache/decoupled_diloco_jax")),
    )
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    out = pathlib.Path(flags.FLAGS.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    return out


def run_arms(
    arms: list[Arm], out: pathlib.Path, quick: dict, full: dict | None = None
) -> list[Result]:
    """Runs every (arm, seed) not already done, with a progress line per run."""
    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime import launch

    FLAGS = flags.FLAGS
    if FLAGS.smoke:  # validate every arm, run only the first and the last
        for arm in arms:
            config_lib.validate(build_config(arm, 0, FLAGS.scale, SMOKE))
        arms = arms if len(arms) <= 2 else [arms[0], arms[-1]]
    todo = [(a, s) for s in seeds() for a in arms]
    results, t0 = [], time.time()
    for i, (arm, seed) in enumerate(todo, 1):
        rundir = out / "runs" / f"{arm.name}_s{seed}"
        done = (rundir / "summary.json").exists() and not FLAGS.fresh
        if not done:
            if rundir.exists():
                shutil.rmtree(rundir)  # a partial run would resume from its checkpoints
            c = build_config(arm, seed, FLAGS.scale, length_overrides(quick, full))
            c.name = f"{arm.name}_s{seed}"
            launch.run(config_lib.validate(c), str(rundir), verbose=False)
            # The tables need only the logs; orbax checkpoints are MBs per run.
            shutil.rmtree(rundir / "checkpoints", ignore_errors=True)
        summary = json.loads((rundir / "summary.json").read_text())
        results.append(Result(arm, seed, summary, rundir))
        print(
            f"[{i}/{len(todo)} {time.time() - t0:6.0f} s] {arm.name} seed {seed}"
            f"{' (cached)' if done else ''}: eval {summary['final_eval_loss']:.4f} "
            f"goodput {summary.get('goodput', float('nan')):.3f} "
            f"merges {summary.get('merges', 0)} wall {summary['wall_seconds']:.0f} s",
            flush=True,
        )
    return results


def rows(rundir: pathlib.Path, name: str) -> list[dict]:
    path = rundir / name
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def eval_curve(r: Result) -> list[tuple[float, int, float]]:
    """(wall s, tokens, eval loss) of the global model (DP: its only learner), time-sorted."""
    no_syncer = not r.summary.get("merges") and r.summary.get("learners", 1) == 1
    curve = {
        (x["time"], x["tokens"], x["eval_loss"])
        for x in rows(r.rundir, "metrics.jsonl")
        if "eval_loss" in x and (x["learner"] == "global" or (no_syncer and x["learner"] == 0))
    }
    return sorted(curve)


def by_arm(results: list[Result]) -> dict[str, list[Result]]:
    out: dict[str, list[Result]] = {}
    for r in results:
        out.setdefault(r.arm.name, []).append(r)
    return out


def stat(values: list[float]) -> tuple[float, float]:
    """(mean, sample std; 0 for a single value)."""
    values = [float(v) for v in values]
    if not values:
        return float("nan"), float("nan")
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def fmt(values: list[float], digits: int = 4, scale: float = 1.0) -> str:
    """'mean ± std' (just the value for one seed)."""
    mean, std = stat([scale * v for v in values])
    return f"{mean:.{digits}f}" if len(values) < 2 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def mode_note() -> str:
    FLAGS = flags.FLAGS
    mode = "--smoke" if FLAGS.smoke else "--quick" if FLAGS.quick else "full"
    return f"mode {mode}, scale {FLAGS.scale}, seeds {seeds()}"


def write(out: pathlib.Path, name: str, markdown: str, fig, results: list[Result]) -> None:
    """<name>.md, <name>.png and <name>.json (every summary) into `out`; prints the table."""
    import matplotlib.pyplot as plt

    (out / f"{name}.md").write_text(markdown)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)
    dump = [{"arm": r.arm.name, "seed": r.seed, "summary": r.summary} for r in results]
    (out / f"{name}.json").write_text(json.dumps(dump, indent=1))
    print(markdown)
    print(f"wrote {out}/{name}.{{md,png,json}}", flush=True)


def plot_curves(ax, results: list[Result], x: str = "tokens") -> None:
    """Eval loss against tokens (millions) or wall time, one colour per arm."""
    for i, (name, runs) in enumerate(by_arm(results).items()):
        for k, r in enumerate(runs):
            curve = eval_curve(r)
            if not curve:
                continue
            t, tok, loss = zip(*curve, strict=True)
            xs = [v / 1e6 for v in tok] if x == "tokens" else t
            label = (r.arm.label or name) if k == 0 else None
            ax.plot(xs, loss, marker="o", ms=3, color=f"C{i}", alpha=1 if k == 0 else 0.5,
                    label=label)  # fmt: skip
    ax.set_xlabel("tokens (millions, all learners)" if x == "tokens" else "wall time (s)")
    ax.set_ylabel("eval loss (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_bars(ax, names: list[str], values: list[list[float]], ylabel: str) -> None:
    """Mean bars with std error bars (one bar per arm, seeds as the spread)."""
    stats = [stat(v) for v in values]
    ax.bar(range(len(names)), [m for m, _ in stats], yerr=[s for _, s in stats], capsize=3,
           color=[f"C{i}" for i in range(len(names))])  # fmt: skip
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
