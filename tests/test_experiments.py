"""Every ablation script under experiments/ runs end to end (--smoke) and writes its outputs.

Each script runs in its own process (absl flags are process-global), with ~6 steps and only
its first and last arm (every arm's config is still validated). Minutes in all: `slow`.
"""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = (
    "learners_sweep",
    "quorum_grace",
    "heterogeneous",
    "merge_rule",
    "precision",
    "fragmentation",
    "scavenging",
    "cross_region",
    "goodput_failures",
)


@pytest.mark.parametrize("name", SCRIPTS)
def test_smoke_writes_table_plot_and_runs(name, tmp_path):
    out = tmp_path / name
    cmd = [sys.executable, str(ROOT / "experiments" / f"{name}.py"), "--quick", "--smoke",
           f"--out={out}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (out / f"{name}.md").read_text()
    assert table.count("|---") >= 1 and "nan ±" not in table
    assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    runs = json.loads((out / f"{name}.json").read_text())
    assert runs and all(r["summary"]["steps"] > 0 for r in runs)
    # Resumable: a second invocation finds every summary and runs nothing.
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("(cached)") == len(runs)


def test_quality_equal_tokens_dense_and_moe_arms(tmp_path):
    out = tmp_path / "quality"
    arms = "dp,decoupled_m2,dp_moe,decoupled_moe"
    cmd = [sys.executable, str(ROOT / "experiments" / "quality_equal_tokens.py"), "--steps=4",
           f"--arms={arms}", f"--out={out}", f"--workdir={tmp_path / 'runs'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (out / "quality_equal_tokens.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "arm" not in line]
    assert len(rows) == 4
    # Each arm is compared with its own data-parallel reference: both references read 1.0000.
    assert sum("| 1.0000 |" in row for row in rows) == 2
    assert (out / "quality_equal_tokens.png").read_bytes()[:4] == b"\x89PNG"
