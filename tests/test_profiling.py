"""--profile: a jax.profiler trace of learner steps START..STOP-1 (profiling.py)."""

import dataclasses
import glob
import os

import jax
import jax.numpy as jnp
import pytest

from decoupled_diloco import profiling


def _trace_files(directory) -> list[str]:
    return glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)


def test_trace_of_a_few_steps_is_written(tmp_path):
    directory = str(tmp_path / "profile")
    profiler = profiling.StepProfiler(directory, start=2, stop=4)
    profiling.install(profiler)
    f = jax.jit(lambda x: jnp.tanh(x @ x))
    state = {"x": jnp.ones((64, 64))}
    seen, readied = [], []

    def ready():  # the learner's "wait for my dispatched steps"
        jax.block_until_ready(state["x"])
        readied.append(len(seen))

    try:
        for step in range(6):
            profiling.step(1, step, ready)
            profiling.step(0, step)  # another learner: neither starts nor stops the trace
            seen.append(profiler.tracing)
            state["x"] = f(state["x"])
    finally:
        profiling.close()
    assert seen == [False, False, True, True, False, False]
    # Before the trace starts (the steps before START are not in it) and before it stops.
    assert readied == [2, 4]
    assert profiler.owner == 1 and profiler.done
    files = _trace_files(directory)
    assert files and all(os.path.getsize(p) > 0 for p in files)


def test_close_stops_a_trace_the_run_ended_inside(tmp_path):
    profiler = profiling.StepProfiler(str(tmp_path), start=0, stop=100)
    profiling.install(profiler)
    profiling.step(0, 0)
    assert profiler.tracing
    profiling.close()
    assert profiler.done and _trace_files(str(tmp_path))
    profiling.step(0, 1)  # uninstalled: a no-op


def test_a_resumed_learner_past_the_window_never_traces(tmp_path, caplog):
    profiler = profiling.StepProfiler(str(tmp_path), start=2, stop=4)
    profiler.step(0, 7)
    with caplog.at_level("WARNING"):
        profiler.close()
    assert profiler.owner is None and not _trace_files(str(tmp_path))
    assert "--profile=2:4: no learner of this process took a step in that window" in caplog.text


@pytest.mark.slow  # a whole run: ~6 s on 2 cores
def test_a_window_ending_at_the_last_step_stops_with_it(small_config, tmp_path, monkeypatch):
    """--profile=START:train.steps: the learner never reaches step STOP before a dispatch,
    so the trace ran on through the final sync, evaluation and checkpoint saves (5 s and
    the profiler's event cap for a 2-step window) until the entry point closed it. The
    learner stops it when its loop ends."""
    import threading

    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime.local import LocalRuntime

    stopped_by, stop = [], jax.profiler.stop_trace

    def recording_stop():
        stopped_by.append(threading.current_thread().name)
        stop()

    monkeypatch.setattr(jax.profiler, "stop_trace", recording_stop)
    run = config_lib.validate(small_config(**{"train.steps": 6, "train.eval_every": 0}))
    profiler = profiling.StepProfiler(str(tmp_path / "profile"), start=4, stop=6)
    profiling.install(profiler)
    try:
        LocalRuntime(run, str(tmp_path / "run"), verbose=False).run()
        assert profiler.done and stopped_by and stopped_by[0] != "MainThread", stopped_by
    finally:
        profiling.close()
    assert _trace_files(str(tmp_path / "profile"))


@pytest.mark.parametrize("text", ["10", "a:b", "5:5", "-1:3", "1:2:3"])
def test_bad_profile_steps_are_refused(text):
    with pytest.raises(ValueError, match="--profile"):
        profiling.parse_steps(text)


def test_profile_steps_parse():
    assert profiling.parse_steps("10:13") == (10, 13)


def _main(tmp_path, *flags):
    import subprocess
    import sys

    command = [sys.executable, "-m", "decoupled_diloco.main", "--config=configs/tiny_dense.py",
               f"--workdir={tmp_path / 'run'}", "--config.train.steps=6",
               "--config.train.eval_every=0", *flags]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "flag, message",
    [("--profile=5:3", "needs 0 <= START < STOP"), ("--profile=2:9", "ends after train.steps")],
)
@pytest.mark.parametrize("check", [False, True])
def test_main_refuses_a_bad_profile_window(tmp_path, flag, message, check):
    out = _main(tmp_path, flag, *(["--check_config"] if check else []))
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert message in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_main_writes_a_trace_of_the_profiled_steps(tmp_path):
    """The learner loop calls profiling.step before each step (runtime/learner_loop.py)."""
    out = _main(tmp_path, "--profile=2:4")
    assert out.returncode == 0, out.stderr
    assert _trace_files(str(tmp_path / "run" / "profile"))


def test_the_profile_window_is_checked_against_the_run(small_config):
    """`--check_config` and the run refuse the same windows (the check passed a window
    past train.steps that the run then refused)."""
    from decoupled_diloco import config as config_lib

    run = config_lib.validate(small_config(**{"train.steps": 12}))
    assert profiling.check_steps("3:12", run) == (3, 12)
    with pytest.raises(ValueError, match="ends after train.steps"):
        profiling.check_steps("3:13", run)
    ray_run = dataclasses.replace(run, runtime="ray")
    with pytest.raises(ValueError, match="runtime 'local' only"):
        profiling.check_steps("3:12", ray_run)


def test_a_tilde_workdirs_trace_goes_where_the_run_writes(small_config, tmp_path, monkeypatch):
    """--workdir=~/x reaches the program with its "~" (the shell expands only a word that
    starts with one); the run writes to $HOME/x, and so must the trace (it went to ./~/x)."""
    from absl import flags
    from absl.testing import flagsaver

    from decoupled_diloco import config as config_lib
    from decoupled_diloco import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    installed = []
    monkeypatch.setattr(profiling, "install", installed.append)
    run = config_lib.validate(small_config(**{"train.steps": 12}))
    parsed = flags.FLAGS.is_parsed()
    flags.FLAGS.mark_as_parsed()
    try:
        with flagsaver.flagsaver(workdir="~/run", profile="2:4"):
            main._install_profiler(run)
    finally:
        if not parsed:
            flags.FLAGS.unparse_flags()
    assert installed[0].directory == str(tmp_path / "run" / "profile")
