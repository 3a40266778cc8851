"""`python -m decoupled_diloco.simulate`: what the command line checks before it simulates."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _simulate(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "decoupled_diloco.simulate", *flags, "--json"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)


def test_a_fault_spec_is_checked_over_the_simulated_horizon():
    """A crash on day 10 of the default 14-day horizon happens; the command checked the
    spec over the run's 7-day fault timeline and refused it (a review found it)."""
    spec = '{"crashes": [[0, 864000.0]], "restart_delay_s": 20.0}'
    out = _simulate("--method=dp", "--chips=2", "--learners=2", f"--fault_spec={spec}")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["failures"] == 1
    late = _simulate(
        "--method=dp", "--chips=2", "--learners=2", f"--fault_spec={spec}", "--horizon_days=5"
    )
    assert "past the 432000 s fault timeline" in late.stderr


def test_more_fragments_than_any_model_has_is_refused_by_name():
    """--fragments=1e12 ended in a numpy MemoryError traceback (a review found it)."""
    big = _simulate("--method=decoupled", "--chips=2", "--learners=2", "--fragments=1000000000000")
    assert big.stderr.strip().splitlines() == [
        "error: fragments must be at most 10,000 (a fragment is at least one parameter leaf), "
        "got 1,000,000,000,000"
    ]


def test_a_step_too_short_to_count_in_the_horizon_is_refused_by_name():
    """--step_s=1e-300 with a schedule gave an overflowing cast's RuntimeWarning and a number
    anyway (a review found it)."""
    spec = '{"crashes": [[0, 100.0]]}'
    tiny = _simulate("--method=dp", "--chips=2", "--learners=2", f"--fault_spec={spec}",
                     "--step_s=1e-300")  # fmt: skip
    assert tiny.returncode != 0 and tiny.stdout == ""
    assert tiny.stderr.strip().splitlines() == [
        "error: step_s (1e-300 s) leaves 1.21e+306 steps in the 14-day horizon, past the 2**53 "
        "a step count holds: use a longer step_s or a shorter horizon_days"
    ]
