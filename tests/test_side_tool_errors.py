"""Bad input to the side tools (report, tokenizer, simulate) ends in one line naming the
file or flag and a non-zero exit: never a traceback, never a wrong result written."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
RUN_FILES = ("attempts.jsonl", "events.jsonl", "merges.jsonl", "metrics.jsonl",
             "run_config.json", "summary.json")  # fmt: skip


def _tool(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"decoupled_diloco.{module}", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _refused(out: subprocess.CompletedProcess, *expected: str) -> str:
    """The one line `out` ended with, which holds every `expected` text."""
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and all(e in lines[0] for e in expected), out.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One tiny finished data-parallel run (its run files; no checkpoints needed)."""
    workdir = tmp_path_factory.mktemp("st_run")
    out = _tool("main", "--config=configs/tiny_dense.py", f"--workdir={workdir}",
                "--config.train.steps=10", timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return workdir


@pytest.fixture
def copy_of_run(run_dir, tmp_path):
    """The run's files in a folder of the test's own, to damage."""
    work = tmp_path / "run"
    work.mkdir()
    for name in RUN_FILES:
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, work / name)
    return work


# -- report -------------------------------------------------------------------------------


@pytest.mark.parametrize("out", ["x.md", "x.png", "x", "x.PNG"])
def test_report_out_names_a_png_and_a_table_never_one_file(run_dir, tmp_path, out):
    result = _tool("report", f"--workdir={run_dir}", f"--out={tmp_path / out}")
    assert result.returncode == 0, result.stderr[-3000:]
    png, md = tmp_path / "x.png", tmp_path / "x.md"
    assert f"wrote {png} and {md}" in result.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert md.read_text().startswith("| summary | value |")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.md", "x.png"]


@pytest.mark.parametrize(
    "out, expected",
    [
        ("folder", "is a folder: give the report's name in it"),
        ("missing/x.png", "does not exist"),
        ("a_file/x.png", "is a file, not a folder"),
        ("taken.png", "taken.md is a folder"),
    ],
)
def test_report_refuses_an_out_it_cannot_write(run_dir, tmp_path, out, expected):
    (tmp_path / "folder").mkdir()
    (tmp_path / "a_file").write_text("")
    (tmp_path / "taken.md").mkdir()
    _refused(_tool("report", f"--workdir={run_dir}", f"--out={tmp_path / out}"),
             f"--out={tmp_path / out}", expected)  # fmt: skip
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob("*/*.png"))


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("attempts.jsonl", "garbage\n", "line 1 is not a JSON record"),
        ("events.jsonl", '{"event": "learner_down", "time": \n{"event": "x"}\n',
         "is not a JSON record"),  # a bad line in the middle, not a torn last one
        ("metrics.jsonl", '{"learner": 0, "st\n{"learner": 0}\n', "is not a JSON record"),
        ("metrics.jsonl", "[1, 2]\n", "is a JSON list, not an object"),
        ("metrics.jsonl", '{"learner": 0, "step": 1, "tokens": 1, "time": 1.0, "loss": "x", '
         '"tokens_per_second": 1.0}\n', ": loss is 'x', not a number"),
        ("metrics.jsonl", '{"learner": 0, "step": 1, "loss": 1.0}\n', "has no tokens"),
        ("metrics.jsonl", '{"step": 1}\n', "names no learner"),
        ("merges.jsonl", '{"time": 1.0, "quorum_wait": 0, "grace": 0}\n',
         "lacks its learners or staleness"),
        ("summary.json", '{"final_eval_loss": 3.', "not a JSON object"),
        ("summary.json", "", "not a JSON object"),
        ("summary.json", "[1, 2]", "holds a JSON list, not an object"),
    ],
)  # fmt: skip
def test_report_names_a_damaged_run_file(copy_of_run, name, text, expected):
    path = copy_of_run / name
    if name.endswith(".jsonl") and name != "attempts.jsonl":  # damage after good records
        text = (path.read_text() if path.exists() else "") + text
    path.write_text(text)
    _refused(_tool("report", f"--workdir={copy_of_run}"), str(path), expected)
    assert not (copy_of_run / "report.png").exists()


def test_report_reads_a_run_whose_last_line_is_cut_short(copy_of_run):
    """A run still writing metrics.jsonl: its torn last line is left out, not an error."""
    with open(copy_of_run / "metrics.jsonl", "a") as f:
        f.write('{"learner": 0, "step": 11, "lo')
    out = _tool("report", f"--workdir={copy_of_run}")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_report_reads_a_learner_with_evaluation_rows_only(copy_of_run):
    """A learner whose rows are evaluations only has no training row for the table (an
    IndexError traceback); it is left out of it."""
    with open(copy_of_run / "metrics.jsonl", "a") as f:
        f.write('{"learner": 7, "step": 30, "eval_loss": 3.0, "tokens": 1, "time": 1.0}\n')
    out = _tool("report", f"--workdir={copy_of_run}")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "| 7 |" not in (copy_of_run / "report.md").read_text()


def test_report_refuses_a_stray_argument(run_dir):
    _refused(_tool("report", f"--workdir={run_dir}", "extra"), "unexpected arguments ['extra']")


# -- tokenizer ----------------------------------------------------------------------------


def test_tokenizer_without_a_config_prints_its_usage(tmp_path):
    out = _tool("tokenizer", f"--out={tmp_path / 'a.model'}")
    _refused(out, "usage: python -m decoupled_diloco.tokenizer --config=FILE --out=PATH.model")


@pytest.mark.parametrize(
    "out, expected",
    [("folder", "is a folder"), ("a_file/a.model", "is a file, not a folder")],
)
def test_tokenizer_refuses_an_out_it_cannot_write_before_training(tmp_path, out, expected):
    """With sentencepiece set the tokenizer would train (half a minute here) and only then
    fail to write: --out is checked first."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "a_file").write_text("")
    args = ("--config=configs/tiny_dense.py", "--config.data.tokenizer=sentencepiece")
    _refused(_tool("tokenizer", *args, f"--out={tmp_path / out}", timeout=25),
             f"--out={tmp_path / out}", expected)  # fmt: skip


def test_tokenizer_refuses_a_stray_argument(tmp_path):
    out = _tool("tokenizer", "--config=configs/tiny_dense.py", f"--out={tmp_path}/a.model", "x")
    _refused(out, "unexpected arguments ['x']")


# -- simulate -----------------------------------------------------------------------------


def test_simulate_refuses_a_stray_argument_in_one_line():
    _refused(_tool("simulate", "--chips=4", "--learners=4", "x"), "unexpected arguments ['x']")


@pytest.mark.parametrize(
    "content, expected",
    [(None, "is a folder, not a JSON file"), ('{"seed": ', "not a JSON object"),
     ("[1]", "holds a JSON list, not an object")],
)  # fmt: skip
def test_simulate_names_a_fault_spec_it_cannot_read(tmp_path, content, expected):
    path = tmp_path / "spec.json"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    out = _tool("simulate", "--chips=4", "--learners=4", f"--fault_spec={path}")
    _refused(out, f"--fault_spec={path}", expected)


def test_simulate_refuses_learners_it_would_take_hours_on():
    """1.2M learners of one chip each: a day of silent work, refused at once, saying why."""
    out = _tool("simulate", "--learners=1200000", timeout=60)
    _refused(out, "--learners=1,200,000 of --chips=1,200,000", "~27 h", "simulate fewer learners")
