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


def test_a_sigterm_stops_a_run_as_a_ctrl_c_does_even_with_sigint_ignored():
    """`kill <pid>`, a scheduler's stop and a VM's shutdown send SIGTERM, which ended the
    process at once (the work since the last checkpoints lost, half-written ones left). It
    is one press now, as a Ctrl-C, also where SIGINT is ignored (a non-interactive shell's
    background job: how scripts/tpu starts a run); a SIGINT and a SIGTERM moments apart are
    one press; at the end of a run it is deferred as a Ctrl-C is."""
    import signal
    import time

    def press(signum) -> bool:
        try:
            os.kill(os.getpid(), signum)
            time.sleep(0.05)  # the handler runs here
        except KeyboardInterrupt:
            return True
        return False

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with cli.one_interrupt_per_press():
        assert press(signal.SIGTERM)
        assert not press(signal.SIGINT)  # the same stop, arriving twice
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with cli.one_interrupt_per_press():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # theirs: kept
            assert press(signal.SIGTERM)
            time.sleep(cli.REPEAT_INTERRUPT_S)
            with cli.interrupts_deferred("noted") as state:
                assert not press(signal.SIGTERM) and state.pressed
                time.sleep(cli.REPEAT_INTERRUPT_S)
                assert press(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ignored = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # someone's ignore: kept
    try:
        with cli.one_interrupt_per_press():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, ignored)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_lost_in_a_finalizer_is_raised_again():
    """A KeyboardInterrupt raised while the main thread runs a finalizer (JAX's garbage-
    collection callback) is printed as "Exception ignored" and lost: the run trained on, and
    the user's next Ctrl-C was taken for the second, a hard stop. It stays pending for the
    runtimes' watch loops to raise until one handles it."""
    import signal
    import time

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here, inside the finalizer

    with cli.one_interrupt_per_press():
        Finalized()  # (dropped at once: its finalizer runs; the raise in it is lost)
        with pytest.raises(KeyboardInterrupt):
            cli.raise_pending_interrupt()
        cli.interrupt_handled()
        cli.raise_pending_interrupt()  # handled: nothing pending


@pytest.mark.parametrize(
    "config_text, extra, expected",
    [
        ("def get_config(:\n", [], "error: invalid syntax"),
        ("def get_config():\n    return undefined\n", [], "error: name 'undefined' is not"),
        ("def get_config():\n    return {}\n", [], "get_config() returned dict, not an"),
        ("x = 1\n", [], "the config file defines no get_config()"),
        # a value of the wrong type set inside get_config (absl's FATAL with a traceback)
        ("from decoupled_diloco import config as c\ndef get_config():\n    d = "
         "c.tiny_cpu_config('x')\n    d.train.steps = 'many'\n    return d\n", [],
         "bad.py: TypeError: Could not override field 'steps'"),
        (None, ["config.train.steps=5"], "unexpected arguments ['config.train.steps=5']"),
        # the fragment plan needs no data: --check_config refuses what the run's start would
        (None, ["--config.diloco.fragment_strategy=layer", "--config.diloco.fragments=12"],
         "config error: diloco.fragments=12 would leave an empty fragment"),
    ],
)  # fmt: skip
def test_a_bad_config_file_or_argument_is_one_line(tmp_path, config_text, extra, expected):
    """A config file that does not run or does not return a config, and an argument that
    would be ignored, stop `main --check_config` with one line (they were tracebacks or,
    for the argument, silently dropped)."""
    path = "configs/tiny_decoupled.py"
    if config_text is not None:
        path = str(tmp_path / "bad.py")
        with open(path, "w") as f:
            f.write(config_text)
    out = subprocess.run(
        [sys.executable, "-m", "decoupled_diloco.main", f"--config={path}", "--check_config",
         *extra], cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0 and expected in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


def test_the_simulator_names_a_malformed_fault_spec_field():
    out = subprocess.run(
        [sys.executable, "-m", "decoupled_diloco.simulate", "--chips=4", "--learners=4",
         '--fault_spec={"chip_mtbf_hours": "x"}'], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "faults.chip_mtbf_hours must be a number" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("extra", [[], ["--config.train.steps=5"]])
def test_a_missing_config_file_points_at_the_shipped_ones(tmp_path, extra):
    """Run from another directory, `--config=configs/...` is not found: with or without a
    --config.* override the error says where the shipped configs are (with one it pointed
    at where the keys are documented, which does not help), and an unknown key still does."""
    out = subprocess.run(
        [sys.executable, "-m", "decoupled_diloco.main", "--config=configs/tiny_dense.py",
         "--check_config", *extra], cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert "config file configs/tiny_dense.py not found" in lines[0], out.stderr[-2000:]
    assert "shipped configs are in the repository's configs/" in out.stderr
    assert "config keys, defaults" not in out.stderr and len(lines) <= 2
    assert cli.config_hint(KeyError("stepz")) == cli.CONFIG_DOCS


def test_the_ctrl_c_notice_of_a_data_parallel_run_names_no_syncer():
    from decoupled_diloco.runtime.learner_loop import interrupt_notice

    alone = interrupt_notice(False)
    assert "syncer" not in alone and "the learner saves" in alone
    assert "then the syncer" in interrupt_notice(True)
    assert all("the same command resumes" in interrupt_notice(s) for s in (False, True))


def test_a_ctrl_c_at_the_end_of_a_run_is_deferred_once():
    """At the end of a run (the syncer's last save, the checkpoints' commits) a first Ctrl-C
    is noted and lets the work finish; the next stops at once; after an earlier Ctrl-C of
    the run, the first already does."""
    import signal
    import time

    def press() -> bool:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here
        except KeyboardInterrupt:
            return True
        return False

    with cli.one_interrupt_per_press():
        with cli.interrupts_deferred("noted") as state:
            assert not press() and state.pressed  # noted, not raised
            assert not press()  # the same press, repeated at once
            time.sleep(cli.REPEAT_INTERRUPT_S)
            assert press()  # the next press: at once
        with cli.interrupts_deferred("noted", pressed=True):
            assert press()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
