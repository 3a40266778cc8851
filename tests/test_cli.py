"""What the entry points set before JAX starts (decoupled_diloco/cli.py): fake CPU devices and
no CUDA graphs, each unless the user's XLA_FLAGS already says otherwise."""

import json
import os
import subprocess
import sys

import pytest

from decoupled_diloco import cli

ROOT = os.path.join(os.path.dirname(__file__), "..")


COUNT = "--xla_force_host_platform_device_count"
OFF = cli.NO_CUDA_GRAPHS


@pytest.mark.parametrize(
    "given, expected",
    [
        (None, [f"{COUNT}=3", OFF]),
        ("--xla_dump_to=/tmp/d", ["--xla_dump_to=/tmp/d", f"{COUNT}=3", OFF]),
        # The user's choices win: graphs back on for fusions, another device count.
        ("--xla_gpu_enable_command_buffer=FUSION",
         ["--xla_gpu_enable_command_buffer=FUSION", f"{COUNT}=3"]),
        (f"{COUNT}=2", [f"{COUNT}=2", OFF]),
    ],
)  # fmt: skip
def test_xla_flags_add_what_the_user_did_not_set(monkeypatch, given, expected):
    if given is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", given)
    cli.xla_flags(3)
    assert os.environ["XLA_FLAGS"].split() == expected
    cli.xla_flags(3)  # a second call adds nothing
    assert os.environ["XLA_FLAGS"].split() == expected


def test_xla_flags_can_leave_the_cpu_device_count_alone(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    cli.xla_flags(None)
    assert os.environ["XLA_FLAGS"].split() == [OFF]


def test_every_entry_point_sets_the_flags_before_jax_starts():
    """Each module that starts JAX for a user (the run, evaluate, sample, export, the
    experiments' harness) sets XLA_FLAGS on import; JAX has not picked a backend yet."""
    code = """
import importlib, json, os, sys
sys.path.insert(0, "experiments")
seen = {}
for name in ["decoupled_diloco.main", "decoupled_diloco.evaluate", "decoupled_diloco.sample",
             "decoupled_diloco.export", "harness"]:
    os.environ.pop("XLA_FLAGS", None)
    importlib.import_module(name)
    seen[name] = os.environ.get("XLA_FLAGS", "")
import jax._src.xla_bridge as xb
print(json.dumps({"flags": seen, "backends_started": bool(xb._backends)}))
"""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for name, flags in got["flags"].items():
        assert OFF in flags.split(), name
        assert f"{COUNT}=8" in flags.split(), name
    assert not got["backends_started"]


def test_a_ctrl_c_signalled_twice_at_once_interrupts_once():
    """`timeout -s INT` signals the process and then its group: the second signal, moments
    after the first, is not the user's second Ctrl-C (which stops a run at once)."""
    import signal
    import time

    def interrupts(gaps: list[float]) -> int:
        count = 0
        for gap in gaps:
            time.sleep(gap)
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs here, at the next bytecode
            except KeyboardInterrupt:
                count += 1
        return count

    with cli.one_interrupt_per_press():
        assert interrupts([0.0, 0.0]) == 1  # the repeat is ignored
        assert interrupts([cli.REPEAT_INTERRUPT_S]) == 1  # a press a second later is one
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert interrupts([0.0, 0.0]) == 2  # outside: Python's own handler
