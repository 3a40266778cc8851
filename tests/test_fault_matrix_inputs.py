"""Fault matrix, inputs (issue 18, items 4, 5 and 8): every key given is used or refused,
config and data errors stop the run once, in the driver, before anything is written, and
on Ray an error no restart can fix stops the run instead of a restart loop."""

import dataclasses
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco import preflight
from decoupled_diloco.config import RayConfig
from decoupled_diloco.data import load_corpus, make_iterator
from decoupled_diloco.preflight import FatalRunError
from decoupled_diloco.runtime import launch

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")
DECOUPLED = {"diloco.learners": 2, "diloco.sync_every": 4, "diloco.fragments": 2}


def _corpus_dir(tmp_path, name="corpus"):
    """A folder of ten small text documents unlike the stdlib (every byte a letter)."""
    folder = tmp_path / name
    folder.mkdir()
    for i in range(10):
        (folder / f"doc{i}.txt").write_text(("held out words " * 200 + f"{i}\n") * 4)
    return folder


def _binary_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(np.arange(4096, dtype=np.int32).tobytes())  # NUL bytes from the start
    return path


def _shipped(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(CONFIG_DIR, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


# --- a key given on the command line is never silently ignored --------------------------------
def test_data_path_without_source_trains_on_that_path(small_config, tmp_path):
    """`--config.data.path=DIR` alone (here on a shipped config) selects the path source: the
    run's corpus is DIR's documents, not the default stdlib corpus."""
    folder = _corpus_dir(tmp_path)
    c = _shipped("tiny_decoupled")
    c.data.path = str(folder)
    run = config_lib.validate(c)
    assert run.data.source == "path" and run.data.path == str(folder)
    names = load_corpus(run.data).document_names
    assert sorted(names["train"] + names["eval"]) == [f"doc{i}.txt" for i in range(10)]
    # With the path unset the same config still trains on the stdlib.
    assert config_lib.validate(_shipped("tiny_decoupled")).data.source == "stdlib"


def test_a_relative_corpus_path_is_recorded_absolute(small_config, tmp_path, monkeypatch):
    """run_config.json holds a local data.path as an absolute path: `evaluate` and `load`
    read the run's corpus from any directory (with the path as typed, only from the one
    the run started in). A remote path is kept as it is."""
    from decoupled_diloco import run_files
    from decoupled_diloco.runtime import workdir

    (tmp_path / "corp").mkdir()
    monkeypatch.chdir(tmp_path)
    run = config_lib.validate(small_config(**{"data.path": "corp", "data.source": "path"}))
    run_files.write(str(tmp_path / "wd"), run)
    monkeypatch.chdir("/")
    assert run_files.read_config(str(tmp_path / "wd")).data.path == str(tmp_path / "corp")
    monkeypatch.chdir(tmp_path)  # the same path typed the same way is no change
    assert workdir.config_changes(str(tmp_path / "wd"), run) == []
    remote = dataclasses.replace(run, data=dataclasses.replace(run.data, path="gs://b/c"))
    run_files.write(str(tmp_path / "wd2"), remote)
    assert run_files.read_config(str(tmp_path / "wd2")).data.path == "gs://b/c"


def test_data_path_with_an_explicit_other_source_is_an_error(small_config, tmp_path):
    c = small_config(**{"data.source": "shakespeare", "data.path": str(_corpus_dir(tmp_path))})
    with pytest.raises(ValueError, match=r"data\.path=.*data\.source is 'shakespeare'"):
        config_lib.validate(c)


def test_run_seed_changes_the_data_order_unless_data_sets_its_own(small_config):
    """The top-level seed reaches the model init, the training-data order and the fault
    schedule; data.seed / faults.seed, when set, win; the eval order stays fixed."""

    def first_batch(run):
        return next(make_iterator(run.data, "train", 4, 0, 2))

    def eval_batch(run):
        return next(make_iterator(run.data, "eval", 4))

    run0 = config_lib.validate(small_config(**DECOUPLED))
    run1 = config_lib.validate(small_config(seed=1, **DECOUPLED))
    assert (run1.train.seed, run1.data.seed, run1.faults.seed) == (1, 1, 1)
    assert not np.array_equal(first_batch(run0), first_batch(run1))
    np.testing.assert_array_equal(eval_batch(run0), eval_batch(run1))
    own = config_lib.validate(small_config(**{"seed": 1, "data.seed": 0, "faults.seed": 7}))
    assert (own.train.seed, own.data.seed, own.faults.seed) == (1, 0, 7)
    np.testing.assert_array_equal(first_batch(own), first_batch(run0))
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\)"):
        config_lib.validate(small_config(seed=-1))


# --- bad inputs are refused at start-up -------------------------------------------------------
def test_a_single_binary_file_is_refused_as_a_corpus(small_config, tmp_path):
    binary = _binary_file(tmp_path)
    run = config_lib.validate(small_config(**{"data.path": str(binary)}))  # touches no files
    with pytest.raises(FatalRunError, match=f"{binary} is a binary file"):
        preflight.check_data(run)
    # In a folder, binary files are skipped (and counted in a warning); text files are read.
    folder = _corpus_dir(tmp_path)
    (folder / "weights.bin").write_bytes(binary.read_bytes())
    names = load_corpus(config_lib.validate(small_config(**{"data.path": str(folder)})).data)
    assert "weights.bin" not in names.document_names["train"] + names.document_names["eval"]


def test_reading_the_train_split_more_than_once_is_warned_of(small_config, tmp_path, caplog):
    """A run that loops its train split trains (windows repeat) but says so at start-up."""
    (tmp_path / "c.txt").write_text("".join(f"line {i} of a small corpus\n" for i in range(400)))
    common = {"data.path": str(tmp_path / "c.txt"), "data.seq_len": 16}
    data = load_corpus(config_lib.validate(small_config(**common)).data).splits["train"]
    windows = (len(data) - 1) // 16
    with caplog.at_level(logging.WARNING):
        preflight.check_data(
            config_lib.validate(small_config(**common, **{"train.steps": windows // 8}))
        )
        assert "windows repeat" not in caplog.text
        over = {"train.steps": windows // 8 + 1}
        preflight.check_data(config_lib.validate(small_config(**common, **over)))
    assert f"the train split holds {windows} windows" in caplog.text


def test_an_evaluation_reads_the_eval_split_at_most_once(small_config, tmp_path, caplog):
    """train.eval_batches beyond the eval split's windows would read the same windows again
    and hold them all on the host (1e12 never finished): an evaluation reads each once."""
    import jax

    from decoupled_diloco import sharding
    from decoupled_diloco.train.evaluate import Evaluator

    (tmp_path / "c.txt").write_text("".join(f"line {i} of a small corpus\n" for i in range(400)))
    run = config_lib.validate(
        small_config(**{"data.path": str(tmp_path / "c.txt"), "data.seq_len": 16})
    )
    data = load_corpus(run.data).splits["eval"]
    whole = -(-((len(data) - 1) // 16) // 8)  # batches of 8 that hold every window
    mesh = sharding.make_mesh(jax.devices()[:1])
    with caplog.at_level(logging.WARNING):
        fits = Evaluator(run.model, run.data, mesh, 8, whole)
        assert "reads the eval split" not in caplog.text
        over = Evaluator(run.model, run.data, mesh, 8, whole + 5)
    assert len(fits.batches) == len(over.batches) == whole
    assert (
        f"reads the eval split's {whole} batches of 8 windows once, not the {whole + 5}"
        in caplog.text
    )
    assert np.array_equal(np.concatenate(fits.batches), np.concatenate(over.batches))


def test_devices_per_learner_must_divide_the_devices(small_config):
    with pytest.raises(ValueError, match=r"devices_per_learner \(3\) must divide the 8 devices"):
        config_lib.validate(small_config(devices_per_learner=3, **DECOUPLED))
    assert config_lib.validate(small_config(devices_per_learner=4, **DECOUPLED))
    # The default tiles the devices too: 3 learners on 8 devices get 2 each, and on 9
    # devices 2 learners get 3 (not 4, which would leave one device idle).
    three = config_lib.validate(small_config(**{**DECOUPLED, "diloco.learners": 3}))
    assert three.devices_per_learner == 2
    assert config_lib._devices_per_learner(0, 2, "local", 9) == 3


def test_fewer_steps_per_period_than_fragments_is_an_error(small_config):
    """H < P would put several fragments on one step of every period."""
    bad = small_config(**{**DECOUPLED, "diloco.sync_every": 4, "diloco.fragments": 6})
    with pytest.raises(ValueError, match=r"diloco\.fragments \(6\) must be <= diloco\.sync_"):
        config_lib.validate(bad)
    assert config_lib.validate(small_config(**{**DECOUPLED, "diloco.fragments": 4}))


# --- data, fragment and run-file errors: one message naming the file, before any write --------
def _refused_before_the_workdir(run, workdir, match):
    with pytest.raises(FatalRunError, match=match):
        launch.run(run, str(workdir), verbose=False)


def test_corrupt_inputs_are_named_and_no_workdir_is_created(small_config, tmp_path):
    binary = _binary_file(tmp_path)
    cases = [
        ({"data.path": str(binary)}, f"{binary} is a binary file"),
        ({"data.path": str(tmp_path / "missing")}, "no such file or folder"),
        # One document of 40 bytes: fewer tokens than a window of seq_len + 1.
        ({"data.path": str(_tiny_file(tmp_path))},
         r"data\.seq_len=64: the train split of .*tiny\.txt has only"),
        # Enough to train on, but its held-out 2% is shorter than one window.
        ({"data.path": str(_tiny_file(tmp_path, "short.txt", 1000))},
         r"the eval split of .*short\.txt has only 2\d tokens.*larger data\.eval_fraction"),
        # More fragments than the tiny model has leaves (H >= P, so the config is valid).
        ({**DECOUPLED, "diloco.sync_every": 99, "diloco.fragments": 99},
         r"diloco\.fragments=99 exceeds the number of leaves"),
    ]  # fmt: skip
    for i, (over, match) in enumerate(cases):
        workdir = tmp_path / f"run{i}"
        _refused_before_the_workdir(config_lib.validate(small_config(**over)), workdir, match)
        assert not workdir.exists(), over


def _tiny_file(tmp_path, name="tiny.txt", length=0):
    path = tmp_path / name
    text = "a corpus far shorter than one window\n"
    path.write_text((text * (length // len(text) + 1))[:length] if length else text)
    return path


def test_corrupt_run_files_are_named_and_nothing_is_written(small_config, tmp_path):
    """A re-run reads run_config.json / summary.json: unreadable ones are named, the workdir
    is left exactly as it was."""
    run = config_lib.validate(small_config())
    for name, text, why in [
        ("run_config.json", '{"model": {"pres', "not JSON"),
        ("run_config.json", '{"model": {}}', "not a run config"),
        ("summary.json", "[1, 2]", "a JSON list"),
    ]:
        workdir = tmp_path / f"w_{name}_{why.replace(' ', '_')}"
        workdir.mkdir()
        (workdir / name).write_text(text)
        before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in workdir.rglob("*")}
        _refused_before_the_workdir(run, workdir, f"{workdir / name} .*{why}")
        assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in workdir.rglob("*")} == before


def test_a_corrupt_tokenizer_model_is_named_at_start_up(small_config, tmp_path):
    model = tmp_path / "tokenizer.model"
    model.write_bytes(b"\x00\x01 not a model")
    pytest.importorskip("sentencepiece")
    c = small_config(**{"data.tokenizer": "sentencepiece", "data.spm_model_path": str(model)})
    with pytest.raises(ValueError, match=f"{model} is not a readable sentencepiece model"):
        config_lib.validate(c)


def test_a_tokenizer_bucket_out_of_reach_is_named(monkeypatch):
    """Without network a gs:// model's read ended, after gcsfs's retries, in aiohttp's DNS
    error (an OSError) with nothing naming the config key."""
    from decoupled_diloco import paths
    from decoupled_diloco.data import tokenizer

    class Unreachable:
        def is_file(self):
            raise OSError("Cannot connect to host storage.googleapis.com:443 ssl:default")

    monkeypatch.setattr(paths, "resolve", lambda path: Unreachable())
    with pytest.raises(ValueError) as e:
        tokenizer.load_sentencepiece("gs://bucket/t.model")
    assert str(e.value).startswith(
        "data.spm_model_path='gs://bucket/t.model' could not be read from this machine "
        "(OSError: Cannot connect to host storage.googleapis.com:443 ssl:default): check its "
        "network and credentials"
    )


def test_the_command_line_refuses_a_binary_corpus_in_one_line(tmp_path):
    """The whole entry point: one line naming the file, exit != 0, no workdir."""
    binary = _binary_file(tmp_path)
    workdir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "decoupled_diloco.main", "--config=configs/tiny_dense.py",
         f"--workdir={workdir}", f"--config.data.path={binary}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert f"error: data.path='{binary}': {binary} is a binary file" in out.stderr
    assert not workdir.exists()


# --- errors a restart cannot fix, inside actors ------------------------------------------------
def test_config_and_data_errors_inside_a_process_are_fatal_others_are_not():
    fatal = pytest.raises(FatalRunError, match=r"^learner 1: data\.path='x': no such file")
    with fatal, preflight.fatal_errors("learner 1"):
        raise ValueError("data.path='x': no such file or folder\n(more detail)")
    # Not a config or data error (e.g. a lost connection): a restart may fix it.
    with pytest.raises(RuntimeError), preflight.fatal_errors("learner 1"):
        raise RuntimeError("connection reset")


# --- Ray start-up ------------------------------------------------------------------------------
def test_ray_start_is_retried_with_a_message_then_fails_clearly(capsys, monkeypatch):
    pytest.importorskip("ray")
    from decoupled_diloco.runtime.ray import cluster

    env = cluster._LOCAL_ONLY_ENV
    monkeypatch.delenv(env, raising=False)
    calls, sleeps = [], []

    def flaky(**kw):
        calls.append((kw, os.environ.get(env)))
        if len(calls) < 3:
            raise Exception("The current node timed out during startup.")

    cfg = RayConfig(num_cpus=2, temp_dir="/tmp/ray_dd_test_retry")
    assert cluster.connect(cfg, verbose=False, init=flaky, sleep=sleeps.append) is True
    assert len(calls) == 3 and sleeps == list(cluster.START_WAITS_S)
    err = capsys.readouterr().err
    assert "Ray did not start (attempt 1/3): Exception: The current node timed out" in err
    assert "attempt 2/3" in err and "attempt 3/3" not in err
    # A single-host cluster listens on 127.0.0.1 only, without the metrics exporter.
    kw, env_during_start = calls[-1]
    assert kw["_node_ip_address"] == "127.0.0.1" and kw["include_dashboard"] is False
    assert kw["_system_config"] == {"enable_metrics_collection": False}
    assert env_during_start == "0" and os.environ.get(env) is None  # restored after

    def down(**kw):
        raise ConnectionError("GCS unreachable")

    joining = RayConfig(address="10.0.0.9:6379")
    with pytest.raises(FatalRunError, match=r"after 3 attempts .*10\.0\.0\.9.*GCS unreachable"):
        cluster.connect(joining, verbose=False, init=down, sleep=lambda s: None)
    kw = cluster.init_kwargs(joining, verbose=False)
    assert kw["address"] == "10.0.0.9:6379" and "_node_ip_address" not in kw
    assert "_system_config" not in kw  # Ray refuses it when joining a cluster


@pytest.mark.ray
def test_ray_stops_at_an_error_no_restart_can_fix(small_config, tmp_path):
    """A learner that cannot read its data (checked in the actor: the driver's preflight is
    bypassed here) stops the run with the message, even with unlimited restarts; a single-
    host cluster is bound to 127.0.0.1."""
    ray = pytest.importorskip("ray")
    from decoupled_diloco.runtime.ray import cluster
    from decoupled_diloco.runtime.ray.runtime import RayRuntime

    started = cluster.connect(RayConfig(num_cpus=2), verbose=False)
    try:
        assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {"127.0.0.1"}
        missing = tmp_path / "not_on_this_node"
        over = {
            **DECOUPLED,
            "runtime": "ray",
            "ray.max_restarts": -1,
            "ray.poll_seconds": 0.25,
            "ray.evaluate": "off",
        }  # the driver reads no data: only the actors do
        run = config_lib.validate(small_config(**over, **{"data.path": str(missing)}))
        out: dict = {}

        def go():
            try:
                RayRuntime(run, str(tmp_path / "run"), verbose=False).run()
            except BaseException as e:
                out["error"] = e

        t0 = time.monotonic()
        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        thread.join(timeout=150)
        assert not thread.is_alive(), "the run did not stop: restarted forever?"
        assert isinstance(out.get("error"), FatalRunError), out
        assert f"data.path='{missing}': no such file or folder" in str(out["error"])
        with open(tmp_path / "run" / "events.jsonl", encoding="utf-8") as f:
            events = [json.loads(line) for line in f]
        kinds = [e["event"] for e in events]
        assert "fatal_error" in kinds and "learner_error" not in kinds, kinds
        assert time.monotonic() - t0 < 150
    finally:
        if started:
            ray.shutdown()
