"""What the experiments' tables claim and what their runs were made from: the tokens every
run saw and which swept lr is an arm's best (quality_equal_tokens.py, quality_targets.py),
what --check_configs writes, which cached runs are reused, which --set overrides are kept."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script(code: str) -> str:
    """Runs `code` in a fresh interpreter in the checkout (a script's absl flags are global)."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# Tables of hand-made summaries (no run): `run(name, tokens, loss)` is one seed-0 run of an
# arm, with its real --smoke config (quality_equal_tokens counts the model's parameters).
RESULTS = """
import math, sys
sys.path.insert(0, "experiments")
sys.argv = ["%s.py", "--smoke", *%r]
w = __import__(sys.argv[0][:-3])
import harness
from absl import flags
from tables import Result
flags.FLAGS(sys.argv)
arms = {a.name: a for a in w.arms()}
def run(name, tokens=6144, loss=2.0):
    c = harness.config_for(arms[name], 0, harness.QUICK, harness.FULL)
    summary = {"final_eval_loss": loss, "tokens": tokens, "steps": 6, "merges": 3,
               "mean_learners_per_merge": 2.0, "bytes_per_token": 1.0, "wall_seconds": 5.0}
    return Result(arms[name], 0, summary, None, c)
"""


def test_the_quality_tables_claim_equal_tokens_only_where_every_run_saw_them():
    """Under --smoke (every learner takes the smoke batch), a --budget_s cap or a crash,
    arms end at different tokens; the note said the first run's tokens were every run's."""
    notes = {}
    for name, other in (("quality_equal_tokens", "decoupled_m4"), ("quality_targets", "decoupled")):
        code = (
            RESULTS % (name, [])
            + f"""
print("unequal:", w.markdown([run("dp", 6144), run("{other}", 24576)]).splitlines()[0])
print("equal:", w.markdown([run("dp", 6144), run("{other}", 6144)]).splitlines()[0])
"""
        )
        lines = _script(code).splitlines()
        unequal, equal = (next(x for x in lines if x.startswith(k)) for k in ("unequal:", "equal:"))
        assert "tokens per run differ between arms (6,144 to 24,576: not equal tokens)" in unequal
        assert "6,144 tokens per run" not in unequal, name
        assert "6,144 tokens per run" in equal, name
        notes[name] = unequal, equal
    # quality_equal_tokens's claim of a total batch (4 learners at the quick batch: 32) goes
    # with equal tokens only
    unequal, equal = notes["quality_equal_tokens"]
    assert "in total" not in unequal and "6,144 tokens per run, 32 sequences per step" in equal


def test_a_diverged_lr_is_never_an_arms_best():
    """An lr whose loss is nan is not the best of a sweep where another lr is finite, in
    whichever order --inner_lrs lists them (nan < x is False: met first, it stayed best)."""
    code = (
        RESULTS % ("quality_equal_tokens", ["--inner_lrs=0.1,0.003,0.006"])
        + """
best = w.best_runs([run("dp@lr0.1", loss=math.nan), run("dp@lr0.003", loss=2.0),
                    run("dp@lr0.006", loss=1.9), run("decoupled_m4@lr0.1", loss=math.nan),
                    run("decoupled_m4@lr0.003", loss=math.nan)])
print("best:", {base: runs[0].arm.name for base, runs in best.items()})
table = w.best_lr_table([run("dp@lr0.1", loss=math.nan), run("dp@lr0.003", loss=2.0)])
print("row:", table.splitlines()[-1])
"""
    )
    lines = _script(code).splitlines()
    best, row = (next(x for x in lines if x.startswith(k)) for k in ("best:", "row:"))
    # every lr of decoupled_m4 diverged: one of them is still shown (as nan), the arm kept
    assert best == "best: {'dp': 'dp@lr0.006', 'decoupled_m4': 'decoupled_m4@lr0.1'}"
    assert row.split("|")[2].strip() == "0.003", row  # the table's "best inner lr" cell


def test_check_configs_writes_nothing_but_the_configs(tmp_path):
    """--check_configs runs nothing and writes only <out>/configs.json: fragmentation.py
    wrote its gemma_2b plans first, so without --out it rewrote the published
    experiments/results/fragmentation/fragmentation_plan.{md,png}."""
    cmd = [sys.executable, str(ROOT / "experiments" / "fragmentation.py"), "--check_configs",
           f"--out={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs.json"]


FINGERPRINT = """
import pathlib, platform, sys
sys.path.insert(0, "experiments")
sys.argv = ["precision.py", "--smoke"]
import harness, precision
from absl import flags
flags.FLAGS(sys.argv)
rundir = pathlib.Path("%s")
rundir.mkdir()
(rundir / "summary.json").write_text("{}")
stamp = {"hash": "0123456789abcdef", "code": harness.code_fingerprint()}
(rundir / "experiment.json").write_text(__import__("json").dumps(stamp))
print("same python:", harness._reusable(rundir, stamp))
harness.code_fingerprint.cache_clear()
platform.python_version = lambda: "3.99.0"  # another interpreter: another stdlib corpus
now = {"hash": stamp["hash"], "code": harness.code_fingerprint()}
print("other python:", harness._reusable(rundir, now))
"""


def test_a_run_made_under_another_python_is_run_again(tmp_path):
    """The default corpus (data.source "stdlib") is the running interpreter's standard
    library: a cached run of the same config and package made under another Python trained
    on other text, and is not reused as today's."""
    out = _script(FINGERPRINT % (tmp_path / "run")).splitlines()
    assert "same python: True" in out and "other python: False" in out, out
    assert any("cached run was made by other code" in line for line in out), out


SET_PER_RUN = """
import sys
sys.path.insert(0, "experiments")
sys.argv = ["precision.py", "--smoke", *%r]
import harness, precision
from absl import app, flags
flags.FLAGS(sys.argv)
try:
    print("overrides:", harness.extra_overrides())
except app.UsageError as e:
    print("usage error:", e)
"""


def test_an_override_of_what_each_run_sets_is_refused():
    """arm_config._finish sets each run's name, seeds and eval set after the overrides:
    --set=seed=5 was replaced by the run's seed without a word, while the table's note
    (mode_note) still listed "--set seed=5"."""
    for item, why in (("seed=5", "give the seeds with --seeds"),
                      ("faults.seed=5", "give the seeds with --seeds"),
                      ("train.eval_batches=2", "the same EVAL_SEQUENCES")):  # fmt: skip
        out = _script(SET_PER_RUN % ([f"--set={item}"],)).splitlines()[-1]
        key = item.partition("=")[0]
        assert out.startswith(f"usage error: --set={item!r}: {key} is set for each run"), out
        assert why in out, out
    kept = _script(SET_PER_RUN % (["--set=train.learning_rate=0.002"],)).splitlines()[-1]
    assert kept == "overrides: {'train.learning_rate': 0.002}"


BUDGET = """
import sys
sys.path.insert(0, "experiments")
sys.argv = ["%s.py", "--smoke", "--set=runtime=ray", "--out=%s", *%r]
script = __import__(sys.argv[0][:-3])
import harness
from absl import app, flags
from decoupled_diloco.runtime import launch
flags.FLAGS(sys.argv)
def launched(run, workdir, verbose=True):  # stands for a Ray run (which no cap stops)
    print(f"launched on {run.runtime}", flush=True)
    raise SystemExit(0)
launch.run = launched
try:
    harness.run_arms(script.arms, harness.out_dir(), budget_s=getattr(script, "BUDGET_S", None))
except app.UsageError as e:
    print("usage error:", e)
"""


def test_a_wall_clock_cap_is_refused_where_it_would_not_stop_the_runs(tmp_path):
    """Only local runs are watched for --budget_s (or a script's own cap): a Ray run went on
    to its step budget while local arms stopped at the cap, the table saying all had it."""
    out = tmp_path / "out"
    capped = _script(BUDGET % ("quorum_grace", out, ["--arms=K4", "--budget_s=5"]))
    assert capped.splitlines()[-1] == (
        "usage error: arm K4: a wall-clock cap (--budget_s=5) stops runs of the local runtime "
        "only; this arm runs on 'ray'"
    )
    assert not out.exists()
    default = _script(BUDGET % ("goodput_failures", out, ["--arms=decoupled"]))
    assert "(the script's 60 s)" in default.splitlines()[-1], default
    # without a cap, a Ray arm runs
    free = _script(BUDGET % ("quorum_grace", out, ["--arms=K4"]))
    assert free.splitlines()[-1] == "launched on ray", free
    # a script's own caps are sized for its CPU-scale runs: at mid or TPU scale it has none
    # (goodput_failures --scale=tpu ran into the refusal above)
    scaled = _script(BUDGET % ("goodput_failures", out, ["--arms=decoupled", "--scale=mid"]))
    assert scaled.splitlines()[-1] == "launched on ray", scaled


RAY_CHECKPOINTS = """
import pathlib, sys
sys.path.insert(0, "experiments")
root, out = pathlib.Path("%s"), pathlib.Path("%s")
sys.argv = ["quorum_grace.py", "--smoke", "--arms=K4", "--set=runtime=ray",
            f"--set=ray.checkpoint_dir={root}", f"--out={out}"]
import harness, quorum_grace as q
from absl import flags
from decoupled_diloco.runtime import launch, workdir as workdir_lib
flags.FLAGS(sys.argv)
stale = root / "out" / "K4_s0" / "learner_0" / "12"  # an earlier attempt's checkpoint
stale.mkdir(parents=True)
(stale / "params").write_text("saved")
def launched(run, workdir, verbose=True):  # launch.run's own check, then no Ray run
    print("checkpoints of", run.ray.checkpoint_dir.removeprefix(str(root)), flush=True)
    try:
        workdir_lib.check_resume(workdir, run, False, False)
        print("launched", flush=True)
    except ValueError as e:
        print("refused:", e, flush=True)
    raise SystemExit(0)
launch.run = launched
harness.run_arms(q.arms, harness.out_dir())
"""


def test_a_ray_run_run_again_starts_without_its_earlier_checkpoints(tmp_path):
    """A Ray run saves under ray.checkpoint_dir, outside its run directory: a run run again
    (interrupted, an edited arm, --fresh, a code change) had its run directory removed but
    not those checkpoints, and its launch refused a run that trained without its
    run_config.json. Each run has its own folder there (<experiment>/<run>), removed too."""
    lines = _script(RAY_CHECKPOINTS % (tmp_path / "ckpt", tmp_path / "out")).splitlines()
    assert "checkpoints of /out/K4_s0" in lines, lines
    assert lines[-1] == "launched", lines
    assert not (tmp_path / "ckpt" / "out" / "K4_s0").exists()
