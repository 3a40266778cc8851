"""The run's thread switch interval (`gil_switch_ms`, runtime/gil.py): validated, set for
the run's threads, and given back when the run ends."""

import json
import sys
import threading
import time

import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco import run_files
from decoupled_diloco.diloco.syncer import Syncer
from decoupled_diloco.runtime import gil
from decoupled_diloco.runtime.local import LocalRuntime


@pytest.mark.parametrize("bad", [-0.1, 0.0004, 101.0, None])
def test_a_bad_interval_fails_at_start_up_naming_the_key(small_config, bad):
    cfg = small_config()
    cfg.gil_switch_ms = bad
    with pytest.raises(ValueError, match="gil_switch_ms"):
        config_lib.validate(cfg)


def test_the_interval_travels_with_the_run_config(small_config):
    cfg = small_config()
    cfg.gil_switch_ms = 0.5
    run = config_lib.validate(cfg)
    assert run.gil_switch_ms == 0.5
    back = run_files.config_from_json(run_files.config_to_json(run))
    assert back.gil_switch_ms == 0.5
    old = run_files.config_to_json(run)
    del old["gil_switch_ms"]  # a run directory written before the key existed
    assert run_files.config_from_json(old).gil_switch_ms == config_lib.GIL_SWITCH_MS


def test_the_block_gets_the_interval_and_gives_it_back_on_error():
    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError), gil.switch_interval(0.3):
        assert sys.getswitchinterval() == pytest.approx(0.3e-3, rel=0.01)
        raise RuntimeError("a failed run")
    assert sys.getswitchinterval() == before
    with gil.switch_interval(0):  # 0: Python's own
        assert sys.getswitchinterval() == before


@pytest.mark.parametrize("ms", [pytest.param(0.25, marks=pytest.mark.slow), 0.0])
def test_a_local_run_merges_under_its_interval_and_restores_python_s(
    small_config, tmp_path, monkeypatch, ms
):
    seen = []
    merge = Syncer._merge

    def recording(self, p, now):
        seen.append(sys.getswitchinterval())  # on the syncer's thread
        return merge(self, p, now)

    monkeypatch.setattr(Syncer, "_merge", recording)
    over = {"diloco.learners": 2, "diloco.sync_every": 4, "diloco.fragments": 2,
            "train.steps": 8, "train.eval_every": 0, "train.checkpoint_every": 0}  # fmt: skip
    cfg = small_config(**over)
    cfg.gil_switch_ms = ms
    before = sys.getswitchinterval()
    summary = LocalRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False).run()
    assert seen, "no merge ran"
    written = json.loads((tmp_path / "summary.json").read_text())
    for key in ("lock_wait_ms", "lock_wait_p99_ms"):  # the run's lock probe
        assert 0 <= summary[key] == written[key] < 1e3
    assert seen == pytest.approx([ms / 1e3 if ms else before] * len(seen), rel=0.01)
    assert sys.getswitchinterval() == before


def test_the_lock_probe_sees_a_thread_that_holds_the_lock():
    with gil.LockProbe(period_s=0.002) as idle:
        time.sleep(0.2)
    stop = threading.Event()

    def hold():  # sum over a range runs in C without letting go of the lock (~0.2 s)
        while not stop.is_set():
            sum(range(10_000_000))

    holder = threading.Thread(target=hold)
    with gil.LockProbe(period_s=0.002) as busy:
        holder.start()
        time.sleep(1.0)
        stop.set()
        holder.join()
    assert idle.summary()["samples"] > 10 and busy.summary()["samples"] > 0
    assert idle.summary()["mean_ms"] < 20 <= busy.summary()["p99_ms"], (idle.counts, busy.counts)
    assert busy.summary()["mean_ms"] > idle.summary()["mean_ms"]
    empty = gil.LockProbe().summary()
    assert empty == {"mean_ms": None, "p99_ms": None, "samples": 0}


def test_overlapping_runs_give_back_the_interval_the_first_found():
    before = sys.getswitchinterval()
    first, second = gil.switch_interval(0.25), gil.switch_interval(0.5)
    first.__enter__()
    second.__enter__()
    assert sys.getswitchinterval() == pytest.approx(0.5e-3, rel=0.01)
    first.__exit__(None, None, None)  # the first ends while the second still runs
    assert sys.getswitchinterval() == pytest.approx(0.5e-3, rel=0.01)
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == before
