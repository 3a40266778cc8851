"""The experiment scripts' plumbing (experiments/harness.py, tables.py and the scripts' table
code) where runs go wrong: a diverged arm, a damaged stamp, a changed package."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import tables  # noqa: E402
from arm_config import Arm  # noqa: E402


def _script(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter in the checkout (a script's absl flags are global)."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _cells(markdown: str) -> dict[str, list[str]]:
    """A markdown table's rows by their first cell (the header's too)."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    rows = ([c.strip() for c in line.strip("|").split("|")] for line in lines)
    return {cells[0]: cells for cells in rows}


# --- a diverged run ----------------------------------------------------------------------
def test_a_diverged_runs_summary_reads_as_nan_floats(tmp_path):
    """summary.json holds a non-finite loss as the str "nan" (metrics.write_json); read back,
    it is a float again, in nested records too, while other strs stay strs."""
    summary = {"final_eval_loss": "nan", "goodput": 0.9, "name": "dp_s0",
               "this_attempt": {"bytes": "inf"}, "losses": ["-inf", 1.0]}  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    read = tables.read_summary(tmp_path)
    assert math.isnan(read["final_eval_loss"]) and read["goodput"] == 0.9
    assert read["name"] == "dp_s0" and read["this_attempt"]["bytes"] == math.inf
    assert read["losses"] == [-math.inf, 1.0]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"learner": 0, "eval_loss": "nan"}) + "\n")
    assert math.isnan(tables.rows(tmp_path, "metrics.jsonl")[0]["eval_loss"])


def test_a_diverged_seed_is_nan_in_ratios_and_tables():
    arm = Arm("decoupled", "tiny_decoupled")
    runs = [tables.Result(arm, s, {"final_eval_loss": v}, None, None)
            for s, v in ((0, math.nan), (1, 2.0))]  # fmt: skip
    refs = [tables.Result(arm, s, {"final_eval_loss": 1.0}, None, None) for s in (0, 1)]
    ratio = tables.loss_ratio(runs, refs)
    assert math.isnan(ratio[0]) and ratio[1] == 2.0
    assert tables.fmt(ratio) == "nan ± nan" and tables.fmt([math.nan]) == "nan"
    assert tables.fmt([1.0, 3.0], 1) == "2.0 ± 1.4"


def test_a_bar_charts_axis_starts_below_the_lowest_finite_loss():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.bar([0, 1, 2], [4.0, 2.0, 3.0])
    tables.start_below_lowest(ax, [math.nan, 2.0, 3.0], 0.5)
    assert ax.get_ylim()[0] == 1.0
    before = ax.get_ylim()
    tables.start_below_lowest(ax, [math.nan, math.inf], 0.5)  # every run diverged
    assert ax.get_ylim() == before
    plt.close(fig)


LADDER_NAN = """
import json, pathlib, sys
sys.path.insert(0, "experiments")
sys.argv = ["quality_ladder.py", "--smoke", "--seeds=0,1"]
import quality_ladder as q
from absl import flags
from tables import Result, read_summary
flags.FLAGS(sys.argv)
arms = {a.name: a for a in q.arms()}
out = []
for name, seed, loss in [("dp", 0, 1.0), ("dp", 1, 1.0), ("diloco", 0, "nan"),
                         ("diloco", 1, 1.2), ("streaming", 0, 1.1), ("streaming", 1, 1.1)]:
    rundir = pathlib.Path("%s") / f"{name}_s{seed}"
    rundir.mkdir(parents=True)
    summary = {"final_eval_loss": loss, "mean_learners_per_merge": 4.0, "dropped_offers": 0,
               "tokens": 1000}
    (rundir / "summary.json").write_text(json.dumps(summary))
    out.append(Result(arms[name], seed, read_summary(rundir), rundir, None))
print(q.markdown(out))
"""


def test_the_ladders_table_shows_a_diverged_rung_as_nan(tmp_path):
    """A rung with a diverged seed (its summary says "nan") is nan in its loss, ratios and
    seed spread; the rungs beside it keep their numbers."""
    rows = _cells(_script(LADDER_NAN % tmp_path).stdout)
    head = rows["rung"]
    loss, dp, below, spread = (head.index(k) for k in ("final eval loss", "÷ DP",
                                                        "÷ rung below", "seed spread"))  # fmt: skip
    diloco, streaming = rows["DiLoCo (P=1, K=M, wait)"], rows["+ P=6 fragments"]
    assert diloco[loss] == "nan ± nan" and diloco[dp] == "nan ± nan"
    assert diloco[spread] == "nan"
    assert streaming[dp] == "1.1000 ± 0.0000" and streaming[spread] == "0.000"
    assert streaming[below].startswith("nan")


@pytest.mark.slow
def test_a_diverging_arm_writes_its_table_and_is_reused(tmp_path):
    """The reviewer's case: lr 1e12 drives the loss to nan. The sweep writes its table with
    nan in it, and a second invocation reuses the run instead of failing on it again."""
    cmd = [sys.executable, str(ROOT / "experiments" / "quality_ladder.py"), "--smoke",
           "--arms=dp", "--set=train.learning_rate=1e12", f"--out={tmp_path}"]  # fmt: skip
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert _cells((tmp_path / "quality_ladder.md").read_text())["data-parallel"][1] == "nan"
    dump = json.loads((tmp_path / "quality_ladder.json").read_text())
    assert dump[0]["summary"]["final_eval_loss"] == "nan"  # strict JSON, as summary.json
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(cached): eval nan" in again.stdout


# --- a damaged stamp ---------------------------------------------------------------------
STAMP = """
import json, pathlib, sys
sys.path.insert(0, "experiments")
sys.argv = ["precision.py", "--smoke"]
import harness, precision
from absl import flags
flags.FLAGS(sys.argv)
rundir = pathlib.Path("%s")
rundir.mkdir()
(rundir / "summary.json").write_text("{}")
stamp = {"hash": "0123456789abcdef", "code": "fedcba9876543210"}
for text in ('{"hash": "0123', "", "[1, 2]", json.dumps(stamp)):
    (rundir / "experiment.json").write_text(text)
    print(harness._reusable(rundir, stamp))
"""


def test_an_unreadable_stamp_reruns_its_run(tmp_path):
    """A stamp cut short (a kill while writing it), empty or not an object: the run is run
    again, saying so, instead of a JSONDecodeError ending the experiment."""
    out = _script(STAMP % (tmp_path / "run")).stdout.splitlines()
    assert [line for line in out if line in ("True", "False")] == ["False"] * 3 + ["True"]
    assert out.count("  run: its experiment.json is unreadable, rerunning") == 3


# --- a stale simulator table -------------------------------------------------------------
SIMULATOR = """
import pathlib, sys
sys.path.insert(0, "experiments")
sys.argv = ["goodput_failures.py", "--smoke"]
import goodput_failures as g, harness
from absl import flags
flags.FLAGS(sys.argv)
out = pathlib.Path("%s")
made = []

def simulate(cmd, **kwargs):  # stands for goodput_table.py: writes its table
    made.append(cmd)
    (out / "simulator").mkdir(parents=True, exist_ok=True)
    (out / "simulator" / "goodput.md").write_text(f"table {len(made)}")

g.subprocess.run = simulate
print(g.simulator_table(out), g.simulator_table(out))
harness.code_fingerprint = lambda: "0123456789abcdef"  # the package changed since
print(g.simulator_table(out), g.simulator_table(out))
"""


def test_the_simulator_table_is_made_again_after_the_code_changed(tmp_path):
    """goodput_failures reuses the simulator's table for the same arguments, but not once
    the code that made it changed (as the CPU runs: harness.code_fingerprint)."""
    out = _script(SIMULATOR % tmp_path).stdout.splitlines()
    assert [line for line in out if line.startswith("table")] == [
        "table 1 table 1",
        "table 2 table 2",
    ]


# --- cross-region DP bytes ---------------------------------------------------------------
CROSS_REGION = """
import sys
sys.path.insert(0, "experiments")
sys.argv = ["cross_region.py", "--smoke"]
import math
import cross_region as x, harness, jax
from absl import flags
from decoupled_diloco import config as config_lib, models
from tables import Result
flags.FLAGS(sys.argv)
summary = {"final_eval_loss": 2.0, "wall_seconds": 10.0, "steps": 6, "learners": 1,
           "bytes_communicated": 0}
for scale in ("cpu", "mid"):
    flags.FLAGS.scale = scale
    dp = next(a for a in x.arms() if a.name == "dp")
    r = Result(dp, 0, summary, None, harness.config_for(dp, 0, harness.QUICK, harness.FULL))
    shapes = models.param_shapes(config_lib.validate(r.config).model)
    print(scale, sum(math.prod(s.shape) for s in jax.tree.leaves(shapes)))
    print(x.markdown([r], 1.0))
"""


def test_cross_regions_dp_bytes_are_those_of_the_model_it_trained():
    """DP's all-reduce bytes per step and its modelled cross-region wall time come from the
    DP arm's own parameter count: the `mid` model's at --scale=mid, not the tiny one's."""
    out = _script(CROSS_REGION).stdout
    counts = dict(line.split() for line in out.splitlines() if line.startswith(("cpu ", "mid ")))
    tables_of = [_cells(part)["data-parallel"] for part in out.split("Cross-region")[1:]]
    head = _cells(out.split("Cross-region")[1])["arm"]
    kb, wall = head.index("kB / learner step"), head.index("wall (s), DP across regions (model)")
    for scale, row in zip(("cpu", "mid"), tables_of, strict=True):
        n = int(counts[scale])
        ring = 2 * 3 / 4 * 4 * n  # M = 4 replicas, fp32 gradients
        assert float(row[kb]) == pytest.approx(ring / 1e3, abs=0.05)
        per_step = ring * 8 / 10e6 + 2 * 3 * 0.15  # 10 Mbit/s, 150 ms away
        assert float(row[wall]) == pytest.approx(10.0 + 6 * per_step, abs=0.5)
    assert int(counts["cpu"]) == 139_840  # the tiny model (cross_region.PARAMS)
    assert int(counts["mid"]) > 100 * int(counts["cpu"])


# --- scripts/trace_summary.py ------------------------------------------------------------
def _trace_summary(path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "scripts" / "trace_summary.py"), str(path)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_trace_summary_reads_a_trace_in_the_json_array_form(tmp_path):
    """A Chrome trace may be a bare list of events (the format's array form)."""
    import gzip

    events = [
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 2, "tid": 1, "name": "fusion", "ts": 0, "dur": 250},
        {"ph": "X", "pid": 1, "tid": 9, "name": "PjitFunction(step)", "ts": 0, "dur": 1000},
    ]
    path = tmp_path / "host.trace.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(events, f)
    proc = _trace_summary(path)
    assert proc.returncode == 0, proc.stderr
    assert "window 1.0 ms" in proc.stdout
    assert "/device:GPU:0: busy 25.0% of the window" in proc.stdout


def test_trace_summary_names_a_trace_cut_short(tmp_path):
    """A .trace.json.gz cut short (a profile still being written, a copy interrupted) or
    holding no trace is an error naming the file, not a traceback."""
    import gzip

    whole = gzip.compress(json.dumps({"traceEvents": []}).encode() * 50)
    cases = {"cut.trace.json.gz": whole[: len(whole) // 2],
             "text.trace.json.gz": gzip.compress(b"not json"),
             "number.trace.json.gz": gzip.compress(b"42")}  # fmt: skip
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        proc = _trace_summary(tmp_path / name)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith(f"trace_summary: {tmp_path / name}: "), proc.stderr


# --- eval curves over seeds --------------------------------------------------------------
def _seed_run(rundir, evals, eval_every=40, steps=160):
    import ml_collections

    rundir.mkdir(parents=True)
    (rundir / "metrics.jsonl").write_text("".join(
        json.dumps({"learner": 0, "step": s, "tokens": 100 * s, "eval_loss": loss, "time": t})
        + "\n" for t, (s, loss) in enumerate(evals, 1)))  # fmt: skip
    config = ml_collections.ConfigDict({"train": {"eval_every": eval_every, "steps": steps}})
    arm = Arm("dp", "tiny_dense")
    return tables.Result(arm, len(evals), {"learners": 1, "merges": 0}, rundir, config)


def test_seeds_eval_curves_are_averaged_step_by_step(tmp_path):
    """Seed 0 crashed and evaluated step 80 again when it redid it; seed 1 evaluated its
    slots a step past the multiple (the lead learner got there first). The mean pairs the
    seeds' evaluations by step (the last one of a step evaluated twice), not by position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = _seed_run(tmp_path / "s0", [(40, 3.0), (80, 2.5), (80, 2.4), (120, 2.0), (160, 1.8)])
    b = _seed_run(tmp_path / "s1", [(41, 3.2), (82, 2.6), (121, 2.2), (160, 2.0)])
    fig, ax = plt.subplots()
    tables.plot_curves(ax, [a, b])
    (line,) = ax.lines
    assert list(line.get_ydata()) == pytest.approx([3.1, 2.5, 2.1, 1.9])
    assert list(line.get_xdata()) == pytest.approx([0.00405, 0.0081, 0.01205, 0.016])
    plt.close(fig)
    # The last evaluation has a slot of its own where the steps end between two.
    c = _seed_run(tmp_path / "s2", [(40, 3.0), (50, 2.9)], eval_every=40, steps=50)
    assert sorted(tables.eval_slots(c)) == [1, 2]


# --- what the tables and the README say -------------------------------------------------
SWEEP_TOKENS = """
import sys
sys.path.insert(0, "experiments")
sys.argv = ["%s.py", "--smoke"]
w = __import__(sys.argv[0][:-3])
from absl import flags
from tables import Result
flags.FLAGS(sys.argv)
arms = {a.name: a for a in w.arms()}
def run(name, tokens):
    summary = {"final_eval_loss": 2.0, "mean_learners_per_merge": 2.0, "goodput": 1.0,
               "tokens": tokens, "wall_seconds": 5.0, "dropped_offers": 0}
    return Result(arms[name], 0, summary, None, None)
other = "M4" if "M4" in arms else "diloco"
print(w.markdown([run("dp", 6144), run(other, 24576)]).splitlines()[0])
print(w.markdown([run("dp", 6144), run(other, 6144)]).splitlines()[0])
"""


def test_a_smoke_tables_note_claims_no_equal_tokens():
    """Under --smoke every learner takes the smoke batch (DP included), so the arms' tokens
    differ; the note says so instead of "32 sequences per step in total for every arm"."""
    unequal, equal = _script(SWEEP_TOKENS % "learners_sweep").stdout.splitlines()[-2:]
    assert "in total for every arm" not in unequal
    assert "tokens per run differ between arms (6,144 to 24,576: not equal tokens)" in unequal
    assert "32 sequences per step in total for every arm, 6,144 tokens per run" in equal
    unequal, equal = _script(SWEEP_TOKENS % "quality_ladder").stdout.splitlines()[-2:]
    assert "tokens per run differ between arms" in unequal and "tokens per run;" not in unequal
    assert "; 6,144 tokens per run;" in equal


def test_the_readme_promises_only_columns_the_ladder_prints():
    """experiments/README.md's quality-ladder section lists the table's columns; each one it
    names is one quality_ladder.py prints."""
    code = """
import sys
sys.path.insert(0, "experiments")
sys.argv = ["quality_ladder.py", "--smoke"]
import quality_ladder as q
from absl import flags
from tables import Result
flags.FLAGS(sys.argv)
summary = {"final_eval_loss": 2.0, "mean_learners_per_merge": 2.0, "dropped_offers": 0,
           "tokens": 10}
print(q.markdown([Result(q.arms()[1], 0, summary, None, None)]))
"""
    header = _cells(_script(code).stdout)["rung"]
    readme = (ROOT / "experiments" / "README.md").read_text()
    section = readme.split("## 0. The quality ladder")[1].split("![ladder]")[0]
    columns = {"seed spread": "seed spread", "learners per merge": "learners / merge",
               "offers dropped": "dropped offers", "merge delay": "merge delay"}  # fmt: skip
    promised = [column for phrase, column in columns.items() if phrase in section]
    assert "dropped offers" in promised
    assert [c for c in promised if c not in header] == []
