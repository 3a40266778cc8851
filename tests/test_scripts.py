"""Every benchmark script under scripts/ starts: its imports resolve and its absl flags are
defined once (a script importing another script's module must not define a flag twice)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))


def test_the_scripts_are_found():
    assert "bench_syncer_merge.py" in SCRIPTS and len(SCRIPTS) >= 5


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_starts_and_lists_its_flags(name):
    cmd = [sys.executable, str(ROOT / "scripts" / name), "--helpshort"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    # absl prints the script's own flags and exits 1 after --helpshort.
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode in (0, 1) and f"{name}:" in proc.stdout, proc.stdout[-2000:]
