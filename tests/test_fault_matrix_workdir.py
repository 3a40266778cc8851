"""Attacks on a run's workdir and checkpoints (issue 18, items 1 and 6): corrupted
checkpoints, two runs on one workdir, resumes with another config, kills that must leave a
trace, a Decoupled resume that must not count work twice, a NaN model that must not pass."""

import collections
import dataclasses
import json
import math
import os
import shutil
import threading
import time

import pytest
from damage import flip_values

from decoupled_diloco import config as config_lib
from decoupled_diloco import preflight, run_files
from decoupled_diloco.checkpoint import CorruptCheckpointError
from decoupled_diloco.data import iterator
from decoupled_diloco.diloco.messages import Merged
from decoupled_diloco.runtime import launch, learner_loop, workdir
from decoupled_diloco.runtime import local as local_runtime
from decoupled_diloco.runtime.local import LocalRuntime

DECOUPLED = {
    "diloco.learners": 2,
    "diloco.sync_every": 4,
    "diloco.fragments": 2,
    "diloco.overlap": 1,
    "diloco.quorum": 1,
    "diloco.max_wait": 0.0,
}


def _read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _halted(cfg, wd, after):
    """A process that dies after `after` steps (no final checkpoint or summary), as the
    launcher runs it: lock held, attempt recorded."""
    run = config_lib.validate(cfg)
    with workdir.lock(str(wd)):
        run_files.check_corpus(str(wd), run.data, force=False)
        attempt = workdir.Attempt(str(wd), [], forced=False)
        rt = LocalRuntime(run, str(wd), verbose=False, halt_after=after,
                          fault_offset_s=attempt.fault_offset,
                          fault_steps=attempt.fault_steps_checked,
                          attempt=attempt.number)  # fmt: skip
        rt.log.ledger.seed_rolled(attempt.rolled_before)
        attempt.watch(workdir.counters_of(rt.log.ledger, rt.bytes_communicated), rt.fault_clock,
                      rt.schedule.steps_checked, rt.log.ledger.rolled_spans)  # fmt: skip
        assert rt.run() is None
        attempt.stop()  # what its last heartbeat would have written


def _steps(ckpt_dir):
    return sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())


@pytest.mark.slow
def test_a_corrupt_learner_checkpoint_falls_back_and_the_run_finishes(small_config, tmp_path):
    cfg = small_config(**{"train.steps": 12, "train.checkpoint_every": 4})
    _halted(cfg, tmp_path, after=10)
    ckpt = tmp_path / "checkpoints" / "learner_0"
    assert _steps(ckpt) == [4, 8]
    flip_values(ckpt / "8")
    summary = launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    refused = [e for e in _read(tmp_path / "events.jsonl") if e["event"] == "checkpoint_refused"]
    assert [e["checkpoint_step"] for e in refused] == [8]
    assert os.path.isdir(refused[0]["moved_to"])
    assert 0 <= refused[0]["time"] < summary["wall_seconds"]  # on the attempt's clock
    assert summary["steps"] == 12 and summary["final_eval_loss"] < 6.0
    # The second attempt resumed from step 4: steps 5-12 ran in it.
    rows = [r for r in _read(tmp_path / "metrics.jsonl") if r["learner"] == 0 and "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 13))


@pytest.mark.slow
def test_a_corrupt_syncer_checkpoint_falls_back_to_the_previous_one(small_config, tmp_path):
    cfg = small_config(**{"train.steps": 16, "train.checkpoint_every": 4, **DECOUPLED,
                          "diloco.syncer_checkpoint_seconds": 0.05,
                          "diloco.syncer_checkpoint_duty": 1.0})  # fmt: skip
    _halted(cfg, tmp_path, after=8)
    ckpt = tmp_path / "checkpoints" / "syncer_0"
    kept = _steps(ckpt)
    assert len(kept) == 2
    flip_values(ckpt / str(kept[-1]))
    summary = launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    refused = [e for e in _read(tmp_path / "events.jsonl") if e["event"] == "checkpoint_refused"]
    assert [(e.get("shard"), e["checkpoint_step"]) for e in refused] == [(0, kept[-1])]
    assert summary["final_eval_loss"] < 6.0


@pytest.mark.slow  # (the default suite is kept under ~10 min on 2 cores)
def test_no_good_checkpoint_stops_the_run_naming_the_files(small_config, tmp_path):
    cfg = small_config(**{"train.steps": 12, "train.checkpoint_every": 4})
    _halted(cfg, tmp_path, after=10)
    ckpt = tmp_path / "checkpoints" / "learner_0"
    for step in _steps(ckpt):
        flip_values(ckpt / str(step))
    with pytest.raises(CorruptCheckpointError) as e:
        launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    assert f"{ckpt}/8:" in str(e.value) and f"{ckpt}/4:" in str(e.value)
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.slow
def test_a_decoupled_resume_meets_the_syncer_at_one_cut(small_config, tmp_path):
    """Learners checkpoint at step 8, the syncer's last save holds their work up to ~step 11:
    the resumed learners skip what Θ holds instead of merging those steps a second time."""
    # Learners wait for late merges here: a fragment's step-10 offer goes out only once its
    # step-6 offer is merged back, which a loaded machine may not manage by step 10 when
    # nobody waits (then Θ holds nothing past step 8 and there is no cut to test).
    overrides = {**DECOUPLED, "diloco.max_wait": 10.0}
    cfg = small_config(**{"train.steps": 20, "train.checkpoint_every": 8, **overrides})
    _halted(cfg, tmp_path, after=11)
    held = collections.defaultdict(int)  # each learner's newest step in Θ
    for rec in _read(tmp_path / "merges.jsonl"):
        for m, step in zip(rec["learners"], rec["steps"], strict=True):
            held[m] = max(held[m], step)
    assert max(held.values()) > 8  # (offers of step 10 are sent before the kill at 11)
    launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    cuts = {e["learner"]: e for e in _read(tmp_path / "events.jsonl") if e["event"] == "resume_cut"}
    for m in (0, 1):
        if held[m] > 8:
            assert cuts[m]["skipped_steps"] == held[m] - 8 and cuts[m]["step"] == held[m]
    # Every step of every learner reached each fragment's Θ at most once.
    merged = collections.Counter()
    for rec in _read(tmp_path / "merges.jsonl"):
        for m, c in zip(rec["learners"], rec["c_steps"], strict=True):
            merged[(m, rec["fragment"])] += c
    assert merged and max(merged.values()) <= 20, merged
    # Every record says which attempt wrote it (each counts time from its own start).
    for name in ("metrics", "merges", "events"):
        attempts = [r["attempt"] for r in _read(tmp_path / f"{name}.jsonl")]
        assert attempts == sorted(attempts) and set(attempts) == {0, 1}, name


@pytest.mark.slow
def test_a_resume_on_a_syncer_without_the_learners_work_says_what_is_lost(small_config, tmp_path):
    """Learners checkpoint at step 8, the syncer's checkpoints are gone (its disk was lost):
    resumed, they take Θ_0 and their 8 steps are gone from the global model. That is
    recorded, never silent."""
    cfg = small_config(**{"train.steps": 12, "train.checkpoint_every": 4, **DECOUPLED})
    _halted(cfg, tmp_path, after=9)
    shutil.rmtree(tmp_path / "checkpoints" / "syncer_0")
    assert _steps(tmp_path / "checkpoints" / "learner_0")[-1] == 8
    lost = len(_read(tmp_path / "merges.jsonl"))  # the first attempt's merges: Θ lost them
    summary = launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    cuts = {e["learner"]: e for e in _read(tmp_path / "events.jsonl") if e["event"] == "resume_cut"}
    for m in (0, 1):
        assert (cuts[m]["lost_steps"], cuts[m]["skipped_steps"], cuts[m]["step"]) == (8, 0, 8)
    records = len(_read(tmp_path / "merges.jsonl"))
    assert lost > 0 and summary["rolled_back_merges"] == lost
    assert summary["merges"] == records - lost
    # ...and in the summary: the steps summed over learners (it read steps 12, goodput ~1)
    assert summary["resume_lost_steps"] == 16


def test_two_runs_on_one_workdir_the_second_is_refused(tmp_path):
    with workdir.lock(str(tmp_path)):
        with pytest.raises(workdir.WorkdirBusyError, match="in use by another run"):  # noqa: SIM117
            with workdir.lock(str(tmp_path)):
                pass
        # Another thread of this process is refused too (a lock per open file).
        failed = []
        t = threading.Thread(target=lambda: failed.append(_try_lock(tmp_path)))
        t.start()
        t.join()
        assert failed == [True]
    with workdir.lock(str(tmp_path)):  # released when the holder ends
        pass


def _try_lock(path) -> bool:
    try:
        with workdir.lock(str(path)):
            return False
    except workdir.WorkdirBusyError:
        return True


def test_a_remote_lease_outlives_a_failed_renewal(tmp_path, monkeypatch):
    """One renewal that the object store fails (a timeout, a 503) ended the renewing thread:
    the lease then ran out under the live run, and the next starter took its workdir over."""
    from etils import epath
    from fake_gcs import fake_gcs

    from decoupled_diloco.runtime import workdir_lock

    monkeypatch.setattr(workdir_lock, "RENEW_SECONDS", 0.05)
    with fake_gcs(str(tmp_path / "gcs")), workdir_lock.lock("gs://bkt/w") as lease:
        path = epath.Path("gs://bkt/w/run.lock")
        write, failed = type(lease.path).write_bytes, []

        def flaky(self, data):
            if not failed:
                failed.append(self)
                raise OSError("503 Service Unavailable")
            return write(self, data)

        monkeypatch.setattr(type(lease.path), "write_bytes", flaky)
        taken = json.loads(path.read_text())["renewed"]
        time.sleep(0.5)
        assert failed, "no renewal was tried"
        assert lease._thread.is_alive()
        assert json.loads(path.read_text())["renewed"] > taken  # renewed after the failure


def test_a_run_that_took_no_step_starts_over_with_a_changed_config(small_config, tmp_path):
    """What a start that failed before its first step leaves (its config, an empty metrics
    file, incarnation counters, an empty checkpoint folder) binds nothing; one metrics row
    or one saved step does."""
    from decoupled_diloco import run_files

    run_files.write(str(tmp_path), config_lib.validate(small_config(**{"data.seq_len": 4096})))
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "checkpoints" / "learner_0").mkdir(parents=True)
    (tmp_path / "checkpoints" / "lives").mkdir()
    (tmp_path / "checkpoints" / "lives" / "learner_0_0").write_text("1")
    smaller = config_lib.validate(small_config(**{"data.seq_len": 64, "model.d_model": 32}))
    assert not workdir.trained(str(tmp_path), smaller)
    assert workdir.check_resume(str(tmp_path), smaller, False, False) == [
        "data.seq_len",
        "model.d_model",
    ]
    (tmp_path / "checkpoints" / "learner_0" / "4").mkdir()
    with pytest.raises(ValueError, match="another config .differs in data.seq_len, model.d"):
        workdir.check_resume(str(tmp_path), smaller, False, False)
    # How often Python threads switch is speed, not math: free to change on a resume.
    faster = config_lib.validate(small_config(**{"data.seq_len": 4096, "gil_switch_ms": 1.0}))
    assert workdir.check_resume(str(tmp_path), faster, True, False) == ["gil_switch_ms"]
    # Nor is where the syncer runs (a thread or a process: the same checkpoints).
    moved = config_lib.validate(small_config(**{"data.seq_len": 4096, "local_syncer": "process"}))
    assert workdir.check_resume(str(tmp_path), moved, True, False) == ["local_syncer"]
    (tmp_path / "checkpoints" / "learner_0" / "4").rmdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert workdir.trained(str(tmp_path), smaller)


def test_only_a_ray_runs_checkpoint_dir_holds_its_saves(small_config, tmp_path):
    """A local run saves under its workdir whatever `ray.checkpoint_dir` says (another run's
    saves there are not its own); a Ray run's saves there are."""
    elsewhere = tmp_path / "shared"
    (elsewhere / "learner_0" / "8").mkdir(parents=True)
    run = tmp_path / "run"
    run.mkdir()
    local = config_lib.validate(small_config(**{"ray.checkpoint_dir": str(elsewhere)}))
    assert not workdir.trained(str(run), local)
    ray = {"ray.checkpoint_dir": str(elsewhere), "runtime": "ray", "diloco.sync_every": 4}
    on_ray = config_lib.validate(small_config(**ray))
    assert workdir.trained(str(run), on_ray)


@pytest.mark.slow
def test_a_run_out_of_memory_at_its_first_step_is_rerun_in_its_workdir(small_config, tmp_path):
    whole = {"data.max_corpus_bytes": 0, "train.steps": 2}  # an eval split of 100k tokens
    too_long = config_lib.validate(small_config(**whole, **{"data.seq_len": 100_000}))
    with pytest.raises(RuntimeError, match="thread failed") as e:
        launch.run(too_long, str(tmp_path), verbose=False)
    assert "RESOURCE_EXHAUSTED" in str(e.value.__cause__)
    # Another corpus too (the first 400 kB of it): nothing trained on the first one.
    fits = config_lib.validate(small_config(**{"train.steps": 2}))
    assert launch.run(fits, str(tmp_path), verbose=False)["steps"] == 2
    changed = ["data.max_corpus_bytes", "data.seq_len", "corpus"]
    assert _read(tmp_path / "attempts.jsonl")[-1]["changed"] == changed


@pytest.mark.slow
def test_a_resume_refuses_changed_config_unless_forced(small_config, tmp_path):
    cfg = small_config(**{"train.steps": 8, "train.checkpoint_every": 4})
    _halted(cfg, tmp_path, after=6)
    changed = small_config(**{"train.steps": 8, "train.checkpoint_every": 4, "seed": 3,
                              "train.learning_rate": 1e-2})  # fmt: skip
    with pytest.raises(ValueError, match="train.learning_rate, train.seed.*--force_resume"):
        launch.run(config_lib.validate(changed), str(tmp_path), verbose=False)
    # Keys that only change how the run is observed may change freely.
    observed = small_config(**{"train.steps": 8, "train.checkpoint_every": 2, "name": "x"})
    assert workdir.check_resume(str(tmp_path), config_lib.validate(observed), False, False) == [
        "name",
        "train.checkpoint_every",
    ]
    # A model of another shape is refused even forced, before anything is written: it
    # replaced run_config.json, then failed to restore (calling the checkpoints corrupt),
    # and the run's own command was refused from then on.
    wider = small_config(**{"train.steps": 8, "train.checkpoint_every": 4, "model.d_model": 32})
    before = (tmp_path / "run_config.json").read_bytes()
    with pytest.raises(ValueError, match=r"reshape \(block_0/attn/k, .*even with --force_resume"):
        launch.run(config_lib.validate(wider), str(tmp_path), verbose=False, force=True)
    assert (tmp_path / "run_config.json").read_bytes() == before
    summary = launch.run(config_lib.validate(changed), str(tmp_path), verbose=False, force=True)
    assert summary["steps"] == 8
    assert (tmp_path / "run_config.1.json").exists()  # the config it replaced
    saved = json.loads((tmp_path / "run_config.json").read_text())
    assert saved["train"]["seed"] == 3
    attempts = _read(tmp_path / "attempts.jsonl")
    assert attempts[-1]["forced"] and "train.seed" in attempts[-1]["changed"]


@pytest.mark.parametrize(
    "change",
    [{"diloco.syncer_shards": 2}, {"diloco.fragments": 4}, {"diloco.sync_every": 8},
     {"diloco.fragment_strategy": "layer"}],
)  # fmt: skip
def test_a_forced_resume_may_not_relay_the_syncer_checkpoints(small_config, tmp_path, change):
    """Each syncer shard restores its own fragments from its own checkpoint: with more
    shards the new one found none and started its fragments over from Θ_0 (half of Θ
    untrained, silently); with fewer, a bare KeyError; another fragment plan failed on the
    syncer's thread after run_config.json was replaced. Refused up front, even forced."""
    base = {"train.steps": 8, **DECOUPLED, "diloco.fragments": 2}
    run_files.write(str(tmp_path), config_lib.validate(small_config(**base)))
    before = (tmp_path / "run_config.json").read_bytes()
    new = config_lib.validate(small_config(**{**base, **change}))
    with pytest.raises(ValueError, match=r"lay out otherwise .*even with --force_resume"):
        workdir.check_resume(str(tmp_path), new, False, True, stepped=True)
    assert (tmp_path / "run_config.json").read_bytes() == before
    # A forced change that keeps the layout goes through.
    lr = config_lib.validate(small_config(**{**base, "train.learning_rate": 1e-2}))
    assert workdir.check_resume(str(tmp_path), lr, False, True, stepped=True) == [
        "train.learning_rate"
    ]


def test_a_forced_resume_may_not_end_before_its_learners_checkpoints(small_config, tmp_path):
    """train.steps lowered below a learner's checkpointed step: the resumed learners joined
    past the run's end, the syncer refused every Join as implausible, and the run waited
    diloco.join_timeout (600 s) without a word. Refused up front, naming the step."""
    base = {"train.steps": 40, **DECOUPLED}
    run_files.write(str(tmp_path), config_lib.validate(small_config(**base)))
    for m, step in ((0, 10), (1, 20), (1, 10)):
        (tmp_path / "checkpoints" / f"learner_{m}" / str(step)).mkdir(parents=True)
    (tmp_path / "checkpoints" / "learner_0" / "30.orbax-checkpoint-tmp-1").mkdir()
    short = config_lib.validate(small_config(**{**base, "train.steps": 15}))
    with pytest.raises(ValueError, match=r"train.steps=15 \(learner 1 at step 20\), even"):
        workdir.check_resume(str(tmp_path), short, False, True, stepped=True)
    for steps in (20, 60):  # as far as the checkpoints, or further: a forced resume goes on
        run = config_lib.validate(small_config(**{**base, "train.steps": steps}))
        assert "train.steps" in workdir.check_resume(str(tmp_path), run, False, True, True)


@pytest.mark.slow
def test_a_resume_may_change_where_the_learner_is_placed(small_config, tmp_path):
    """The mesh (an OOM run resumed FSDP-sharded) changes no math: resumed without
    --force_resume, its checkpoint restored onto the new shardings."""
    base = {"train.steps": 8, "train.checkpoint_every": 4}
    _halted(small_config(**base), tmp_path, after=6)
    placed = config_lib.validate(small_config(**base, **{"mesh.data": 1, "mesh.fsdp": -1}))
    assert workdir.check_resume(str(tmp_path), placed, False, False) == ["mesh.data", "mesh.fsdp"]
    summary = launch.run(placed, str(tmp_path), verbose=False)
    assert summary["steps"] == 8
    attempts = _read(tmp_path / "attempts.jsonl")
    assert not attempts[-1].get("forced")
    rows = [r for r in _read(tmp_path / "metrics.jsonl") if r.get("learner") == 0]
    first_steps = [r["step"] for r in rows if r["step"] <= 4]
    assert first_steps == sorted(set(first_steps))  # steps 1-4 from the first attempt only


def _text_corpus(folder, files=6, lines=300):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        words = [f"w{(i * 7 + j * 13) % 97}" for j in range(lines * 8)]
        text = "\n".join(" ".join(words[k : k + 8]) for k in range(0, len(words), 8))
        (folder / f"doc{i}.txt").write_text(text + "\n")
    return folder


@pytest.fixture
def fresh_corpora():
    """Corpora are cached per process and config: a test that edits its files between two
    starts must read them again, as a new process would."""
    from decoupled_diloco.data import corpus

    corpus._CACHE.clear()
    yield lambda: corpus._CACHE.clear()
    corpus._CACHE.clear()


@pytest.mark.slow
def test_a_resume_on_a_changed_corpus_is_refused_unless_forced(
    small_config, tmp_path, fresh_corpora, monkeypatch
):
    folder = _text_corpus(tmp_path / "corpus")
    wd = tmp_path / "run"
    cfg = small_config(**{"train.steps": 8, "train.checkpoint_every": 4, "data.source": "path",
                          "data.path": str(folder), "data.eval_fraction": 0.2})  # fmt: skip
    _halted(cfg, wd, after=6)
    record = (wd / run_files.CORPUS).read_text()
    edited = folder / "doc0.txt"
    edited.write_text(edited.read_text().replace("w1 ", "w2 "))  # same size, other text
    fresh_corpora()
    with pytest.raises(ValueError, match=r"another corpus.*other contents.*--force_resume"):
        launch.run(config_lib.validate(cfg), str(wd), verbose=False)
    (folder / "extra.txt").write_text("w5 w6\n" * 200)
    fresh_corpora()
    with pytest.raises(ValueError, match=r"train: 5 documents.* then, 6 documents.* now"):
        launch.run(config_lib.validate(cfg), str(wd), verbose=False)
    assert (wd / run_files.CORPUS).read_text() == record  # a refusal changes nothing
    # Forced onto a corpus too small for the saved data position: the learner continues at
    # the same share of its epoch, with a warning, instead of failing at every attempt.
    shutil.rmtree(folder)
    _text_corpus(folder, files=3, lines=40)
    fresh_corpora()
    warned = []
    monkeypatch.setattr(iterator.logging, "warning", lambda msg, *a: warned.append(msg % a))
    summary = launch.run(config_lib.validate(cfg), str(wd), verbose=False, force=True)
    assert summary["steps"] == 8
    assert any("train stream of shard 0 changed since its checkpoint" in w for w in warned)
    attempts = _read(wd / "attempts.jsonl")
    assert attempts[-1]["forced"] and attempts[-1]["changed"] == ["corpus"]
    assert json.loads((wd / run_files.CORPUS).read_text())["train"]["documents"] == 2


def test_the_same_corpus_elsewhere_resumes_and_a_bad_corpus_record_is_named(
    small_config, tmp_path, fresh_corpora
):
    folder = _text_corpus(tmp_path / "corpus")
    wd = str(tmp_path / "run")
    cfg = config_lib.validate(small_config(**{"data.source": "path", "data.path": str(folder)}))
    run_files.write(wd, cfg)  # a run started here...
    assert run_files.check_corpus(wd, cfg.data, force=False) == []  # ...and recorded its corpus
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')  # ...and trained
    moved = shutil.copytree(folder, tmp_path / "mounted" / "elsewhere")
    there = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(moved) + "/"))
    assert workdir.check_resume(wd, there, False, False) == ["data.path"]  # free: recorded
    assert run_files.check_corpus(wd, there.data, force=False) == []  # the same contents
    record = tmp_path / "run" / run_files.CORPUS
    saved = record.read_text()
    record.unlink()  # a workdir from before corpus.json: where its corpus lies is binding
    with pytest.raises(ValueError, match="differs in data.path"):
        workdir.check_resume(wd, there, False, False)
    for bad, why in (({"train": 5}, "split 'train' has no sha256"),
                     ({"train": {"sha256": "x", "documents": "7"}}, "integers >= 0")):  # fmt: skip
        record.write_text(json.dumps(bad))
        with pytest.raises(preflight.FatalRunError, match=why):
            preflight.check_workdir_files(wd)
        with pytest.raises(ValueError, match=f"{run_files.CORPUS} holds .*{why}"):
            run_files.check_corpus(wd, cfg.data, force=False)
    record.write_text(saved)


def test_a_resume_never_trains_with_another_sentencepiece_model(tmp_path, fresh_corpora):
    pytest.importorskip("sentencepiece")
    from decoupled_diloco.data import DataConfig, get_tokenizer

    folder = _text_corpus(tmp_path / "corpus")
    data = DataConfig(source="path", path=str(folder), tokenizer="sentencepiece",
                      spm_vocab_size=300, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    wd = str(tmp_path / "run")
    assert run_files.check_corpus(wd, data, force=False) == []  # the first start records it
    first = get_tokenizer(data).model_proto
    (tmp_path / "run" / run_files.TOKENIZER).write_bytes(first)  # as the runtime saves it
    (tmp_path / "run" / run_files.RUN_CONFIG).write_text("{}")  # ...with its config: it began
    assert run_files.check_corpus(wd, data, force=False) == []  # the same corpus: resumes
    (folder / "extra.txt").write_text("zq zq xv xv\n" * 500)  # retrains another model
    fresh_corpora()
    with pytest.raises(ValueError, match=r"spm_model_path=.*tokenizer.model --force_resume"):
        run_files.check_corpus(wd, data, force=True)
    kept = dataclasses.replace(data, spm_model_path=f"{wd}/{run_files.TOKENIZER}")
    assert run_files.check_corpus(wd, kept, force=True) == ["corpus"]
    assert get_tokenizer(kept).model_proto == first


@pytest.mark.slow
def test_summary_adds_up_every_attempt(small_config, tmp_path):
    cfg = small_config(**{"train.steps": 8, "train.checkpoint_every": 4})
    _halted(cfg, tmp_path, after=6)
    before = _read(tmp_path / "attempts.jsonl")[0]["own"]["wall_seconds"]
    summary = launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    assert summary["attempts"] == 2 and summary["interrupted_attempts"] == 1
    assert summary["failures"] == 1  # the killed process leaves a trace
    assert summary["wall_seconds"] == pytest.approx(
        summary["this_attempt"]["wall_seconds"] + before
    )
    # A finished run re-run: nothing changes, the totals stay.
    again = launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    assert again == json.loads((tmp_path / "summary.json").read_text())
    assert again["attempts"] == 2


@pytest.mark.slow
def test_bytes_communicated_count_every_syncer_life_and_every_attempt(small_config, tmp_path):
    """The summary counted only the last attempt's traffic, and of that only the syncer's
    last life (a syncer restore started its count again): a killed attempt with a syncer
    crash, then a resume with another, reported a fraction of what went over the links."""
    cfg = small_config(**{"train.steps": 16, **DECOUPLED, "faults.unit": "steps",
                          "faults.syncer_crashes": [4, 12],
                          "faults.syncer_restart_delay_s": 0.2})  # fmt: skip
    _halted(cfg, tmp_path, after=9)
    first = _read(tmp_path / "attempts.jsonl")[0]["own"]["bytes_communicated"]
    earlier = len(_read(tmp_path / "merges.jsonl"))
    summary = launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    events = _read(tmp_path / "events.jsonl")
    assert sum(e["event"] == "syncer_crash" for e in events) == 2  # one in each attempt
    # Every merge of every life and attempt moved its offers in and its replies out (and
    # the joins' snapshots went out too).
    merges = _read(tmp_path / "merges.jsonl")

    def moved(records):
        return sum(r["bytes_in"] + r["bytes_out"] for r in records if r.get("event") == "merge")

    own = summary["this_attempt"]["bytes_communicated"]
    assert own >= moved(merges[earlier:])  # both syncer lives of this attempt
    assert first >= moved(merges[:earlier]) > 0
    assert summary["bytes_communicated"] == first + own
    assert summary["bytes_per_token"] == summary["bytes_communicated"] / summary["tokens"]


@pytest.mark.slow
def test_a_killed_attempts_lost_steps_count_in_the_summary(small_config, tmp_path):
    """A learner crash loses the steps Θ lacks of it (its `rejoin` event's `lost_steps`,
    not a resume's `resume_cut`); in an attempt that is then killed, its heartbeat record
    keeps them, and the finished run's summary counts them with the next attempt's (it
    left them out: 51 of 62 lost steps reported); the resume's own losses apart."""
    cfg = small_config(**{"train.steps": 16, **DECOUPLED, "faults.unit": "steps",
                          "faults.crashes": [[1, 6]], "faults.restart_delay_s": 0.2})  # fmt: skip
    _halted(cfg, tmp_path, after=12)
    events = _read(tmp_path / "events.jsonl")
    lost = sum(e.get("lost_steps", 0) for e in events if e["event"] == "rejoin")
    assert lost > 0 and not [e for e in events if e["event"] == "resume_cut"]
    own = _read(tmp_path / "attempts.jsonl")[0]["own"]
    assert own["crash_lost_steps"] == lost and own["resume_lost_steps"] == 0
    summary = launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    events = _read(tmp_path / "events.jsonl")
    crashes = sum(e.get("lost_steps", 0) for e in events if e["event"] == "rejoin")
    resumes = sum(e.get("lost_steps", 0) for e in events if e["event"] == "resume_cut")
    assert summary["crash_lost_steps"] == crashes >= lost
    assert summary["resume_lost_steps"] == resumes


@pytest.mark.slow
def test_a_resume_continues_a_schedule_in_seconds_instead_of_replaying_it(small_config, tmp_path):
    """The fault clock is the run's: attempts.jsonl records where each attempt left it, and
    the resumed attempt starts there, so the crash at 0 s that hit the first attempt does not
    hit the second (it did, counted again in `failures`, when each attempt began at 0)."""
    cfg = small_config(**{"train.steps": 8, "train.checkpoint_every": 4,
                          "faults.crashes": [[0, 0.0]], "faults.restart_delay_s": 0.1})  # fmt: skip
    _halted(cfg, tmp_path, after=5)
    first = _read(tmp_path / "attempts.jsonl")[0]
    assert first["own"]["failures"] == 1 and first["fault_clock"] > 0
    summary = launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    second = _read(tmp_path / "attempts.jsonl")[1]
    assert second["own"]["failures"] == 0, second
    assert second["fault_clock"] > first["fault_clock"]
    assert summary["failures"] == 2  # the crash, and the killed first attempt
    crashes = [e for e in _read(tmp_path / "events.jsonl") if e["event"] == "learner_down"]
    assert len(crashes) == 1, crashes


@pytest.mark.parametrize("who", ["learner", "syncer"])
@pytest.mark.slow
def test_an_outage_an_earlier_attempt_began_goes_on_and_is_counted_once(
    small_config, tmp_path, who
):
    """A killed attempt left the run at 5 s of its fault clock, with the crash at 0 s (back
    at 8 s) counted: the resumed attempt finds the learner (the syncer) down, keeps it down
    for the 3 s left and restarts it, without a second failure (it counted one more)."""
    faults = (
        {"faults.crashes": [[1, 0.0]], "faults.restart_delay_s": 8.0}
        if who == "learner"
        else {"faults.syncer_crashes": [0.0], "faults.syncer_restart_delay_s": 8.0}
    )
    cfg = small_config(**{"train.steps": 12, **DECOUPLED, **faults})  # fmt: skip
    killed = {"attempt": 0, "finished": False, "fault_clock": 5.0,
              "own": {"wall_seconds": 9.0, "failures": 1, "restarts": 0}}  # fmt: skip
    (tmp_path / "attempts.jsonl").write_text(json.dumps(killed) + "\n")
    summary = launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    resumed = _read(tmp_path / "attempts.jsonl")[1]
    assert resumed["own"]["failures"] == 0 and resumed["own"]["restarts"] == 1, resumed
    assert summary["failures"] == 2  # the crash, and the killed attempt
    kind = "learner_down" if who == "learner" else "syncer_crash"
    down = [e for e in _read(tmp_path / "events.jsonl") if e["event"] == kind]
    assert len(down) == 1 and down[0]["earlier_attempt"], down
    back = "rejoin" if who == "learner" else "syncer_restore"
    up = [e for e in _read(tmp_path / "events.jsonl") if e["event"] == back]
    assert len(up) == 1 and 2.5 <= up[0]["time"] < 6.0, up  # at 8 s of the run's clock


def test_a_non_finite_model_is_a_failed_run(small_config, tmp_path):
    cfg = small_config(**{"train.steps": 6, "train.learning_rate": 1e9, "train.grad_clip": 0.0,
                          "train.warmup_steps": 0})  # fmt: skip
    with pytest.raises(launch.ModelNotFiniteError, match="not finite"):
        launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    assert "failed" in json.loads((tmp_path / "summary.json").read_text())
    with pytest.raises(launch.ModelNotFiniteError):  # and stays failed when re-run
        launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)


@pytest.mark.slow
def test_a_syncer_run_that_merged_nothing_is_a_failed_run(small_config, tmp_path):
    """Diverging learners whose every offer is refused leave Θ at its initial draw: finite,
    and no result."""
    cfg = small_config(**{"train.steps": 8, **DECOUPLED, "train.learning_rate": 1e4,
                          "train.warmup_steps": 0, "diloco.final_wait": 1.0})  # fmt: skip
    with pytest.raises(launch.ModelNotFiniteError, match="no offer was merged"):
        launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["merges"] == 0 and math.isfinite(summary["final_eval_loss"])


def _sigint_ignored():
    """In a child before its exec: SIGINT ignored, as a non-interactive shell's `cmd &`
    starts it (Python keeps an ignore it inherits)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    "runtime,signals",
    [
        ("thread", 1),
        pytest.param("thread", 2, marks=pytest.mark.slow),
        pytest.param("thread", "term", marks=pytest.mark.slow),
        pytest.param("process", "term", marks=pytest.mark.slow),
        pytest.param("process", 1, marks=pytest.mark.slow),
        pytest.param("ray", 1, marks=pytest.mark.ray),
        pytest.param("ray", "term", marks=pytest.mark.ray),  # scripts/tpu's driver
    ],
)
@pytest.mark.slow
def test_ctrl_c_saves_every_learners_work_and_the_same_command_resumes(tmp_path, runtime, signals):
    """SIGINT to the run's process group, as a terminal's Ctrl-C sends it (a syncer process
    and Ray's own services get it too; Ray's actors run in process groups of their own):
    learners offer what Θ lacks and save, the syncer merges and saves, exit 130 without a
    traceback and without summary.json; the same command then finishes with every step of
    every learner merged exactly once per fragment. `runtime`: the local runtime with its
    syncer on a thread or in a process, or the Ray runtime on a local cluster of its own.
    `signals` 2: the signal arrives twice 20 ms apart (`timeout -s INT` signals the process
    and then its group), which is still one Ctrl-C (it was taken for a second, which stops
    at once, and the interpreter's shutdown then aborted under threads inside XLA).
    `signals` "term": a `kill <pid>` (SIGTERM, to the main process only) of a run started
    as scripts/tpu starts one, a background job of a non-interactive shell whose SIGINT is
    ignored; it stops as a Ctrl-C does (it killed the run, losing what the checkpoints did
    not hold)."""
    import signal
    import subprocess
    import sys
    import time

    steps = 120 if runtime != "ray" else 400  # Ray: learners still training when it lands
    args = [sys.executable, "-m", "decoupled_diloco.main", "--config=configs/tiny_decoupled.py",
            f"--workdir={tmp_path}", "--config.diloco.learners=2", f"--config.train.steps={steps}",
            "--config.train.batch_size=8", "--config.data.seq_len=64",
            "--config.data.max_corpus_bytes=400000", "--config.train.log_every=1",
            "--config.train.eval_every=0", "--config.train.eval_batches=2",
            "--config.train.checkpoint_every=0"]  # fmt: skip
    if runtime == "ray":
        temp_dir = f"/tmp/ray_dd_cc{os.getpid()}"  # short: Ray's socket paths are limited
        args += ["--config.runtime=ray", "--config.ray.num_cpus=2",
                 "--config.ray.poll_seconds=0.25", f"--config.ray.temp_dir={temp_dir}"]  # fmt: skip
    else:
        args.append(f"--config.local_syncer={runtime}")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    term = signals == "term"
    proc = subprocess.Popen(args, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=_sigint_ignored if term else None)  # fmt: skip
    metrics, deadline = tmp_path / "metrics.jsonl", time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        rows = _read(metrics) if metrics.exists() else []
        reached = [max((r["step"] for r in rows if r.get("learner") == m), default=0)
                   for m in (0, 1)]  # fmt: skip
        if min(reached) >= 10:
            break
        time.sleep(0.2)
    if term:
        os.kill(proc.pid, signal.SIGTERM)
    for i in range(0 if term else signals):
        time.sleep(0.02 * i)
        os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "learners and syncer saved; the same command resumes" in err, err[-3000:]
    assert not (tmp_path / "summary.json").exists()
    saved = [_steps(tmp_path / "checkpoints" / f"learner_{m}")[-1] for m in (0, 1)]
    # Stopped mid-way, and saved; on a loaded box one learner may run so far ahead of the
    # other (they never wait) that it finished before the Ctrl-C landed ([13, 120] once).
    assert all(10 <= s <= steps for s in saved) and min(saved) < steps, saved

    again = subprocess.run(args, cwd=repo, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    events = _read(tmp_path / "events.jsonl")
    assert not [e for e in events if e["event"] == "resume_cut"]  # nothing skipped or lost
    merged = collections.Counter()
    for rec in _read(tmp_path / "merges.jsonl"):
        for m, c in zip(rec["learners"], rec["c_steps"], strict=True):
            merged[(m, rec["fragment"])] += c
    fragments = {rec["fragment"] for rec in _read(tmp_path / "merges.jsonl")}
    assert merged == {(m, p): steps for m in (0, 1) for p in fragments}, merged
    # summary.json counts the merges of both attempts: Θ holds every one of them.
    summary = json.loads((tmp_path / "summary.json").read_text())
    records = len(_read(tmp_path / "merges.jsonl"))
    assert (summary["merges"], summary["rolled_back_merges"]) == (records, 0)
    if runtime == "ray":
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_learners_killed_in_their_final_sync_rejoin_when_resumed(
    small_config, tmp_path, monkeypatch
):
    """The last step's checkpoint is saved once the final offers and the leave are out,
    before the final sync has seen them merged: a learner whose process was killed then
    must rejoin when resumed (its work since Θ's clock is offered, or, where Θ lost it,
    recorded as lost), never end silently. Here the syncer's disk is lost too: Θ holds none
    of the first attempt, and each learner's 12 steps are recorded."""
    cfg = small_config(**{"train.steps": 12, "train.checkpoint_every": 4, **DECOUPLED})
    save = learner_loop.LearnerLoop.save

    def save_then_die(loop):
        save(loop)
        if loop.step == 12:  # killed right after the last step's save, in the final sync
            raise local_runtime._HaltError

    monkeypatch.setattr(learner_loop.LearnerLoop, "save", save_then_die)
    _halted(cfg, tmp_path, after=13)  # (no step 13: only the save above stops them)
    monkeypatch.undo()
    assert _steps(tmp_path / "checkpoints" / "learner_0")[-1] == 12
    shutil.rmtree(tmp_path / "checkpoints" / "syncer_0")
    first = len(_read(tmp_path / "merges.jsonl"))
    # Nothing is left to merge: Θ is its initial draw, and the run says it failed.
    with pytest.raises(launch.ModelNotFiniteError, match="no offer was merged"):
        launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    cuts = {e["learner"]: e for e in _read(tmp_path / "events.jsonl") if e["event"] == "resume_cut"}
    for m in (0, 1):
        assert (cuts[m]["lost_steps"], cuts[m]["skipped_steps"], cuts[m]["step"]) == (12, 0, 12)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rolled_back_merges"] == first and summary["merges"] == 0


@pytest.mark.slow
def test_a_learner_killed_in_its_final_sync_before_its_last_save_resumes_to_its_last_step(
    small_config, tmp_path, monkeypatch
):
    """Killed after its final offers went out (fragment 0's merged up to step 12) but before
    the last step's save: resumed from step 8, it is cut to Θ's clock, 12, and must not
    take a 13th step (whose offers and heartbeats the syncer refuses as past the run)."""
    cfg = small_config(**{"train.steps": 12, "train.checkpoint_every": 4, **DECOUPLED,
                          "diloco.final_wait": 5.0})  # fmt: skip
    save = learner_loop.LearnerLoop.save

    def die_before_the_last_save(loop):
        if loop.step == 12:  # dies once its final offer of fragment 0 is merged
            deadline = time.monotonic() + 30.0
            while not any(
                isinstance(msg, Merged) and msg.fragment == 0
                and dict(zip(msg.learners, msg.steps, strict=True)).get(loop.m) == 12
                for msg in list(loop.link.inbox.queue)
            ):  # fmt: skip
                assert time.monotonic() < deadline, "the final offer was never merged"
                time.sleep(0.02)
            raise local_runtime._HaltError
        save(loop)

    monkeypatch.setattr(learner_loop.LearnerLoop, "save", die_before_the_last_save)
    _halted(cfg, tmp_path, after=13)  # (no step 13: only the save above stops them)
    monkeypatch.undo()
    assert _steps(tmp_path / "checkpoints" / "learner_0")[-1] == 8
    summary = launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    assert summary["steps"] == 12
    rows = [r for r in _read(tmp_path / "metrics.jsonl") if r["learner"] in (0, 1)]
    assert max(r["step"] for r in rows) <= 12
    events = _read(tmp_path / "events.jsonl")
    assert not [e for e in events if e["event"] in ("reject", "final_sync_unconfirmed")]
    # Both skipped from step 8 to Θ's clock, 12 (not redoing steps Θ holds).
    cuts = {e["learner"]: (e["step"], e["skipped_steps"]) for e in events
            if e["event"] == "resume_cut"}  # fmt: skip
    assert cuts == {0: (12, 4), 1: (12, 4)}


@pytest.mark.slow  # a whole run: ~13 s on 2 cores
def test_a_stop_request_reaches_a_learner_out_of_the_membership(small_config, tmp_path):
    """Ray's Ctrl-C asks each learner to stop through its inbox: learner 1, between two
    membership windows (out from the run's step 8 to its step 3000), must see the request
    now, not when its next window opens. (Windows in seconds, 0-2 s then from 60 s, missed
    the first window on a machine whose start-up took longer than 2 s: a cold compilation
    cache here.)"""
    from decoupled_diloco.runtime.learner_loop import StopRequest

    windows = [[0, 0.0, 1e9], [1, 0.0, 8.0], [1, 3000.0, 1e9]]
    cfg = small_config(**{"train.steps": 4000, **DECOUPLED, "faults.unit": "steps",
                          "faults.membership": windows})  # fmt: skip
    rt = LocalRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False)
    thread = threading.Thread(target=rt.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120

    def out() -> bool:  # it left, and its final sync is over
        left = any(e["event"] == "leave" and e["learner"] == 1
                   for e in _read(tmp_path / "events.jsonl"))  # fmt: skip
        return left and rt.loops[1].proto is None

    try:
        while not out():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1.0)  # its final sync is over: it only waits for its next window
        rt.learner_inboxes[1].put(StopRequest())
        asked = time.monotonic()
        while not rt.loops[1]._stop_requested and time.monotonic() < asked + 10:
            time.sleep(0.1)
        seen = rt.loops[1]._stop_requested
    finally:  # end the run (a failed test's run, left going, slowed every later test)
        for inbox in rt.learner_inboxes.values():
            inbox.put(StopRequest())
        thread.join(120)
    assert seen and rt.loops[1].interrupted
    assert not thread.is_alive()


@pytest.mark.slow
def test_a_resume_after_a_kill_takes_a_life_the_syncer_has_not_seen(small_config, tmp_path):
    """Learner 1 crashes and rejoins (incarnation 1, in the syncer's checkpoint but in no
    checkpoint of its own), then the process is killed: resumed, it must not come back as
    incarnation 0, whose Join the restored syncer refuses for good."""
    cfg = small_config(**{"train.steps": 16, "train.checkpoint_every": 0, **DECOUPLED,
                          "faults.unit": "steps", "faults.crashes": [[1, 3]],
                          "faults.restart_delay_s": 0.1, "diloco.join_timeout": 30.0,
                          "diloco.syncer_checkpoint_seconds": 0.05,
                          "diloco.syncer_checkpoint_duty": 1.0})  # fmt: skip
    _halted(cfg, tmp_path, after=10)
    joins = [e for e in _read(tmp_path / "events.jsonl") if e["event"] == "join"]
    assert {(e["learner"], e["incarnation"]) for e in joins} >= {(1, 0), (1, 1)}
    summary = launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    assert summary["steps"] == 16
    events = _read(tmp_path / "events.jsonl")
    assert not [e for e in events if e.get("kind") == "old_incarnation"]


def test_a_learner_that_leaves_for_good_is_not_allocated_after_it(small_config, tmp_path):
    """Goodput counts a learner's time from its first step to its last: one that leaves the
    membership for good stops counting when it leaves, not when the run ends."""
    cfg = small_config(**{"train.steps": 24, **DECOUPLED, "faults.unit": "steps",
                          "faults.membership": [[1, 0, 4]]})  # fmt: skip
    rt = LocalRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False)
    summary = rt.run()
    assert summary["goodput"] > 0.9, summary["goodput"]


@pytest.mark.slow  # a whole run: ~6 s on 2 cores
def test_a_run_whose_members_all_leave_early_warns_that_it_ended_short(
    small_config, tmp_path, caplog
):
    """Windows in seconds cannot be checked against train.steps at start-up (the steps'
    version of this schedule is refused there): every learner gone after 3 s ends the run
    short of its 100000 steps, with exit 0, and that is said (it was silent)."""
    import logging

    cfg = small_config(**{"train.steps": 100_000, **DECOUPLED,
                          "faults.membership": [[0, 0, 3.0], [1, 0, 3.0]]})  # fmt: skip
    with caplog.at_level(logging.WARNING):
        summary = LocalRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False).run()
    assert 0 < summary["steps"] < 100_000
    assert f"the run ended at step {summary['steps']}, short of train.steps (100000)" in caplog.text


def test_a_learner_whose_membership_ends_while_it_is_down_counts_its_crash_loss(
    small_config, tmp_path
):
    """Learner 0 crashes after step 6 and its window ends at the run's step 12 while it is
    down (a 30 s restart): no rejoin counts what the crash lost, so its `learner_gone` does,
    as a crash loss, from what Θ holds of its steps at the end (it counted none). Learner 1
    steps at half the speed, so that it does not reach step 12 first (learner 0 would then
    leave before its crash)."""
    cfg = small_config(**{"train.steps": 24, **DECOUPLED, "faults.unit": "steps",
                          "faults.membership": [[0, 0, 12], [1, 0, 24]],
                          "faults.speed_factors": [1.0, 2.0],
                          "faults.crashes": [[0, 6]], "faults.restart_delay_s": 30.0})  # fmt: skip
    summary = LocalRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False).run()
    events = _read(tmp_path / "events.jsonl")
    gone = [e for e in events if e["event"] == "learner_gone"]
    assert [(e["learner"], e["step"], e["life_start"]) for e in gone] == [(0, 6, 0)]
    held = {p: 0 for p in range(2)}
    for rec in _read(tmp_path / "merges.jsonl"):
        for m, step in zip(rec["learners"], rec["steps"], strict=True):
            if m == 0:
                held[rec["fragment"]] = max(held[rec["fragment"]], step)
    assert summary["crash_lost_steps"] == max(6 - h for h in held.values()) > 0, held
    assert summary["syncer_lost_steps"] == 0 and summary["resume_lost_steps"] == 0


@pytest.mark.slow
def test_a_final_sync_that_runs_out_of_time_says_what_it_did_not_see_merged(small_config, tmp_path):
    cfg = small_config(**{"train.steps": 12, **DECOUPLED, "diloco.final_wait": 0.0,
                          "faults.link_latency_s": [0.3, 0.3]})  # fmt: skip
    LocalRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False).run()
    left = [e for e in _read(tmp_path / "events.jsonl") if e["event"] == "final_sync_unconfirmed"]
    assert left and all(
        len(e["unmerged_steps"]) == 2 and sum(e["unmerged_steps"]) > 0 for e in left
    )
    held = collections.Counter()
    for rec in _read(tmp_path / "merges.jsonl"):
        for m, c in zip(rec["learners"], rec["c_steps"], strict=True):
            held[m, rec["fragment"]] += c
    # It reports what it did not see merged: what Θ lacks of its 12 steps, and at most the
    # offers still in flight on top (Θ may merge those after the learner stopped waiting).
    lacks = {e["learner"]: [12 - held[e["learner"], p] for p in range(2)] for e in left}
    assert any(sum(v) for v in lacks.values())  # work this run's Θ never got
    for e in left:
        assert all(
            n >= lack for n, lack in zip(e["unmerged_steps"], lacks[e["learner"]], strict=True)
        )


@pytest.mark.slow
def test_a_record_cut_short_by_a_kill_does_not_block_the_resume(small_config, tmp_path):
    """A process killed while writing a metrics line leaves it without its end: the resume
    stopped on it ("Unterminated string", no file named) and `report` raised. The torn line
    is dropped (warned of), the next record starts on a line of its own; a bad line in the
    middle of a file is an error naming the file and line."""
    from decoupled_diloco.metrics import JsonlWriter, parse_jsonl

    base = {"train.steps": 8, "train.checkpoint_every": 4}
    _halted(small_config(**base), tmp_path, after=6)
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a", encoding="utf-8") as f:
        f.write('{"learner": 0, "step": 7, "loss": 1.2')  # the kill came mid-line
    summary = launch.run(config_lib.validate(small_config(**base)), str(tmp_path), verbose=False)
    assert summary["steps"] == 8
    text = metrics.read_text()
    assert text.endswith("\n")
    rows = [json.loads(line) for line in text.splitlines()]  # every line a whole record
    assert max(r["step"] for r in rows if r.get("learner") == 0) == 8

    assert parse_jsonl('{"a": 1}\n{"a": 2}', "f") == [{"a": 1}, {"a": 2}]  # newline missing
    assert parse_jsonl('{"a": 1}\n{"a": ', "f") == [{"a": 1}]
    with pytest.raises(ValueError, match=r"^f: line 2 is not a JSON record"):
        parse_jsonl('{"a": 1}\n{"a": \n{"a": 3}\n', "f")
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"a": 1}\n{"a"')
    writer = JsonlWriter(str(torn))
    writer.write({"a": 2})
    writer.close()
    assert torn.read_text() == '{"a": 1}\n{"a": 2}\n'
    torn.write_text('{"a": 1}\n{"a": 2}')  # whole, only the newline lost: kept, as read
    writer = JsonlWriter(str(torn))
    writer.write({"a": 3})
    writer.close()
    assert parse_jsonl(torn.read_text(), "f") == [{"a": 1}, {"a": 2}, {"a": 3}]


@pytest.mark.slow
def test_a_run_without_its_run_config_is_not_resumed_on_trust(small_config, tmp_path):
    """run_config.json removed from a run that trained: the resume compared nothing and took
    any config ("changed": []). Refused unless forced; a forced resume writes it anew."""
    base = {"train.steps": 8, "train.checkpoint_every": 4}
    _halted(small_config(**base), tmp_path, after=6)
    (tmp_path / "run_config.json").unlink()
    other = config_lib.validate(small_config(**base, **{"train.learning_rate": 0.5}))
    with pytest.raises(ValueError, match=r"trained .metrics, checkpoints. but no run_config"):
        launch.run(other, str(tmp_path), verbose=False)
    assert launch.run(other, str(tmp_path), verbose=False, force=True)["steps"] == 8
    assert (tmp_path / "run_config.json").exists()


def test_a_workdir_that_is_a_file_is_one_line(small_config, tmp_path):
    """A file where the workdir (or a folder above it) would be raised FileExistsError /
    NotADirectoryError tracebacks; now the start refuses it, naming the file."""
    from decoupled_diloco.preflight import FatalRunError

    (tmp_path / "afile").write_text("x")
    run = config_lib.validate(small_config())
    with pytest.raises(FatalRunError, match=r"afile is a file: give a folder$"):
        launch.run(run, str(tmp_path / "afile"), verbose=False)
    with pytest.raises(FatalRunError, match=r"afile/sub lies below a file \(.*afile\)"):
        launch.run(run, str(tmp_path / "afile" / "sub"), verbose=False)
    # A link whose target is gone (a disk not mounted): a FileExistsError traceback.
    (tmp_path / "link").symlink_to(tmp_path / "unmounted")
    for where in (tmp_path / "link", tmp_path / "link" / "sub"):
        with pytest.raises(FatalRunError, match=r"link is a link to .*unmounted, which does"):
            launch.run(run, str(where), verbose=False)


@pytest.mark.parametrize("section", ["model", "train"])
def test_a_run_config_whose_section_is_not_an_object_is_named(tmp_path, section):
    """A run_config.json without its digest (older, or edited by hand) whose section is not
    an object was an AttributeError traceback at start-up, not a named run file."""
    (tmp_path / run_files.RUN_CONFIG).write_text(json.dumps({section: 3}))
    with pytest.raises(preflight.FatalRunError, match=r"run_config.json holds not a run config"):
        preflight.check_workdir_files(str(tmp_path))


def test_a_swapped_or_damaged_tokenizer_model_is_named(small_config, tmp_path, fresh_corpora):
    """The run's tokenizer.model was read on trust: another valid model was used to score
    (5.73 against 4.80), garbage raised sentencepiece's RuntimeError, and a resume's remedy
    (spm_model_path=<workdir>/tokenizer.model) trained on the swapped vocabulary. Its
    sha256 is written beside it and checked wherever it is read."""
    pytest.importorskip("sentencepiece")
    from decoupled_diloco.data import DataConfig, get_tokenizer

    folder = _text_corpus(tmp_path / "corpus")
    data = DataConfig(source="path", path=str(folder), tokenizer="sentencepiece",
                      spm_vocab_size=300, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    run = config_lib.validate(small_config(**{"model.vocab_size": 512}))
    run = dataclasses.replace(run, data=data)
    wd = tmp_path / "run"
    assert run_files.check_corpus(str(wd), data, force=False) == []
    run_files.write(str(wd), run, get_tokenizer(data))
    assert run_files.read_tokenizer(str(wd), data).vocab_size == 300  # as written: read
    (folder / "extra.txt").write_text("zq zq xv xv\n" * 500)  # another model, valid
    fresh_corpora()
    other = get_tokenizer(data).model_proto
    (wd / run_files.TOKENIZER).write_bytes(other)
    kept = dataclasses.replace(data, spm_model_path=f"{wd}/{run_files.TOKENIZER}")
    for read in (
        lambda: run_files.read_tokenizer(str(wd), data),
        lambda: run_files.check_corpus(str(wd), kept, force=True),  # the old remedy
    ):
        with pytest.raises(
            ValueError, match=r"tokenizer.model is not the sentencepiece model the run wrote"
        ):
            read()
    (wd / run_files.TOKENIZER_SHA256).unlink()  # a run from before the digest: unchecked...
    (wd / run_files.TOKENIZER).write_bytes(b"\x00 not a model")
    with pytest.raises(ValueError, match=r"tokenizer.model is not a readable sentencepiece"):
        run_files.read_tokenizer(str(wd), data)  # ...but garbage is named, not a traceback


@pytest.mark.slow
def test_a_resume_evaluates_theta_where_the_earlier_attempt_left_off(small_config, tmp_path):
    """A resumed run evaluated Θ at once and then once per watch turn until its evaluation
    counter, started at train.eval_every again, caught up with the restored lead: global rows
    for steps the earlier attempt had evaluated, several for one step."""
    base = {**DECOUPLED, "train.steps": 16, "train.checkpoint_every": 4, "train.eval_every": 2}
    _halted(small_config(**base), tmp_path, after=10)
    launch.run(config_lib.validate(small_config(**base)), str(tmp_path), verbose=False)
    steps = [r["step"] for r in _read(tmp_path / "metrics.jsonl") if r["learner"] == "global"]
    assert steps == sorted(set(steps)), steps  # one row per evaluated step, in order
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    assert steps and min(gaps, default=2) >= 1 and steps[-1] == 16, steps


@pytest.mark.slow
def test_a_run_whose_checkpoints_are_gone_starts_over_without_doubling_its_rows(
    small_config, tmp_path, caplog
):
    """Checkpoints removed: the run restarted at step 0 silently, and metrics.jsonl held
    the earlier attempt's steps twice (a kill -9 trims them back to the checkpoint)."""
    import logging

    base = {"train.steps": 8, "train.checkpoint_every": 4}
    _halted(small_config(**base), tmp_path, after=6)
    shutil.rmtree(tmp_path / "checkpoints")
    with caplog.at_level(logging.WARNING):
        summary = launch.run(
            config_lib.validate(small_config(**base)), str(tmp_path), verbose=False
        )
    assert summary["steps"] == 8
    assert "no learner checkpoint to resume from: the run starts over at step 0" in caplog.text
    steps = [r["step"] for r in _read(tmp_path / "metrics.jsonl") if r.get("learner") == 0]
    assert steps == sorted(set(steps)) and steps[-1] == 8


def test_a_ctrl_c_stops_the_fault_clock_where_training_stopped(small_config, tmp_path):
    """What the run does after a Ctrl-C (final offers, checkpoints: minutes for a large
    model) is not on the fault timeline: the attempt records the moment training stopped,
    and the resumed attempt applies the faults due after it (they were skipped)."""
    import time

    run = config_lib.validate(small_config(**{"faults.crashes": [[0, 50.0]]}))
    rt = LocalRuntime(run, str(tmp_path), verbose=False, fault_offset_s=30.0)
    rt.loops, rt.t0 = [], time.monotonic() - 4.0  # 4 s into training
    rt._interrupt(learner_threads=[])
    stopped = rt.fault_clock()
    time.sleep(0.05)
    assert 34.0 <= stopped < 35.0 and rt.fault_clock() == stopped
    assert rt.schedule.is_up(0, 22.0)  # in the crash at 50 s of the run clock, which is held back
    rt.log.close()


@pytest.mark.slow
def test_a_run_in_which_no_learner_took_a_step_says_so(tmp_path):
    """Every learner's membership window closes before its first step (in seconds, which
    start-up cannot check): the run ends with the initial model and says why, instead of
    a plain `done: ... steps=0`."""
    import subprocess
    import sys

    windows = "[[0,0,0.01],[1,0,0.01]]"
    args = [sys.executable, "-m", "decoupled_diloco.main", "--config=configs/tiny_decoupled.py",
            f"--workdir={tmp_path}", "--config.diloco.learners=2", "--config.train.steps=20",
            "--config.train.batch_size=8", "--config.data.seq_len=64",
            "--config.data.max_corpus_bytes=400000", "--config.train.eval_batches=2",
            f"--config.faults.membership={windows}"]  # fmt: skip
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(args, cwd=repo, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning: no learner took a step" in done.stderr, done.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["tokens"] == 0


@pytest.mark.slow
def test_a_resume_from_an_older_checkpoint_does_not_replay_a_step_crash(small_config, tmp_path):
    """Learner 1 crashes at step 10 (after its checkpoint at 8) and the process dies at
    step 14; the resume restores step 8 and skips ahead to the steps Θ holds of it. The
    crash at 10 fired once: attempts.jsonl says learner 1 checked its schedule past 10 (the
    rule "a crash at or before the first step resumed at has fired" replayed it)."""
    cfg = small_config(**{"train.steps": 20, **DECOUPLED, "train.checkpoint_every": 8,
                          "faults.unit": "steps", "faults.crashes": [[1, 10]],
                          "faults.restart_delay_s": 0.2})  # fmt: skip
    _halted(cfg, tmp_path, after=14)
    assert _read(tmp_path / "attempts.jsonl")[0]["fault_steps"]["learners"][1] >= 10
    summary = launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    downs = [e for e in _read(tmp_path / "events.jsonl")
             if e["event"] == "learner_down" and e["learner"] == 1]  # fmt: skip
    killed = summary["interrupted_attempts"]  # each counted as a failure too
    assert len(downs) == 1 and summary["failures"] == 1 + killed == 2, (downs, summary)


def test_a_resumed_runs_refused_offers_are_summed_over_its_attempts(tmp_path):
    """summary.json's rejected_offers / dropped_offers count every attempt's (a killed one's
    by its last heartbeat), as its failures and lost steps do."""
    from decoupled_diloco.runtime.accounting import Ledger

    first = workdir.Attempt(str(tmp_path), [], forced=False)
    ledger = Ledger(2, 4, 1)
    ledger.dropped_offers, ledger.rejected_offers = 3, 1
    first.watch(workdir.counters_of(ledger))
    first.stop()  # killed: what its last heartbeat wrote
    total = workdir.Attempt(str(tmp_path), [], forced=False).finish(
        {"dropped_offers": 2, "rejected_offers": 0}
    )
    assert (total["dropped_offers"], total["rejected_offers"]) == (5, 1)


def test_a_counted_failure_is_recorded_at_once_not_at_the_next_heartbeat(tmp_path):
    """A crash's rejoin (and its lost steps) reaches attempts.jsonl when it is counted: a
    kill before the next heartbeat (every 5 s) left the summary short of failures and lost
    steps the events recorded (0 of 2 lost steps, 1 of 2 failures)."""
    from decoupled_diloco.runtime.accounting import Ledger
    from decoupled_diloco.runtime.records import RunLog

    attempt = workdir.Attempt(str(tmp_path), [], forced=False, every=1e6)  # no heartbeat
    log = RunLog(str(tmp_path), Ledger(2, 4, 1))
    attempt.watch(workdir.counters_of(log.ledger))
    log.on_counted = attempt.write_now
    log.event({"event": "learner_down", "learner": 0, "step": 22, "time": 1.0})
    log.event({"event": "rejoin", "learner": 0, "step": 22, "lost_steps": 2,
               "lost_spans": {"0": [[20, 22]]}, "time": 2.0})  # fmt: skip
    own = _read(tmp_path / "attempts.jsonl")[0]["own"]  # (the process is killed here)
    assert (own["failures"], own["restarts"], own["crash_lost_steps"]) == (1, 1, 2)
    attempt.stop()
    log.close()


@pytest.mark.slow
def test_a_rollback_a_learner_saw_is_not_counted_again_by_a_resume(small_config, tmp_path):
    """A syncer restore rolls back merges of both learners' steps (`syncer_lost_steps`);
    the run is killed before either learner crashes. Each learner notes the rolled-back
    steps it saw as counted at its next step boundary, so the resume's cut does not count
    them again as `resume_lost_steps` (36 of 32 steps were accounted for)."""
    from decoupled_diloco import checkpoint, fault_steps

    cfg = _restored_once(small_config)
    _halted(cfg, tmp_path, after=20)
    events = _read(tmp_path / "events.jsonl")
    (restore,) = [e for e in events if e["event"] == "syncer_restore" and e["after_failure"]]
    rolled = {0: [], 1: []}  # each learner's merged spans the restore took back
    for r in _read(tmp_path / "merges.jsonl"):
        if r["time"] < restore["time"] and r["version"] > restore["versions"]["0"]:
            for m, c, s in zip(r["learners"], r["c_steps"], r["steps"], strict=True):
                rolled[m].append((s - c, s))
    # (Which learners' merges the restore took back depends on thread timing: learner 1,
    # the slower, may not have merged before the crash.)
    assert rolled[0] or rolled[1]
    noted = {}
    for m in (0, 1):
        ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints" / f"learner_{m}"))
        noted[m] = checkpoint.load_counted(ckpt).get(0, [])
        ckpt.close()
        # The rolled-back steps it saw (those of merges it had received) were noted, and
        # nothing else (no crash or cut counted any).
        assert all(any(a <= lo and hi <= b for a, b in fault_steps.merge_windows(rolled[m]))
                   for lo, hi in noted[m])  # fmt: skip
    assert noted[0] or noted[1]
    launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    for e in _read(tmp_path / "events.jsonl"):
        if e["event"] == "resume_cut":
            for lo, hi in e["lost_spans"].get("0", []):
                assert not any(a < hi and lo < b for a, b in noted[e["learner"]]), e


@pytest.mark.slow
def test_a_rollback_a_killed_learner_never_saw_is_not_counted_again_by_a_resume(
    small_config, tmp_path
):
    """As above, but the learners are killed before they note the rollback (their notes
    beside the checkpoints are emptied, as if the kill came before the boundary that writes
    them): the attempt's record keeps the rolled-back steps the run counted
    (`syncer_lost_steps`), and the resume's cut leaves them out of `resume_lost_steps`."""
    from decoupled_diloco import checkpoint
    from decoupled_diloco.runtime.accounting import span_steps, spans_minus

    cfg = _restored_once(small_config)
    _halted(cfg, tmp_path, after=14)
    (first,) = _read(tmp_path / "attempts.jsonl")
    assert first["own"]["syncer_lost_steps"] > 0
    recorded = {int(m): [tuple(s) for s in by_p.get("0", [])]
                for m, by_p in first["rolled_spans"].items()}  # fmt: skip
    assert sum(map(span_steps, recorded.values())) >= first["own"]["syncer_lost_steps"]
    for m in (0, 1):
        ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints" / f"learner_{m}"))
        checkpoint.save_counted(ckpt, {})  # what a learner that never saw it would have
        ckpt.close()
    # The kill came before the syncer's next save: the resume's Θ lacks what the restore
    # took back (and, whatever thread timing merged since, everything: Θ_0, the version the
    # restore went back to here).
    assert restore_versions(tmp_path) == {"0": 0}
    shutil.rmtree(tmp_path / "checkpoints" / "syncer_0")
    summary = launch.run(config_lib.validate(cfg), str(tmp_path), verbose=False)
    cuts = [e for e in _read(tmp_path / "events.jsonl") if e["event"] == "resume_cut"]
    overlapped = 0
    for e in cuts:
        rolled = recorded.get(e["learner"], [])
        own = [p for lo, hi in e["lost_spans"].get("0", []) for p in spans_minus(lo, hi, rolled)]
        assert e["lost_steps"] == span_steps(own), (e, rolled)
        overlapped += e.get("rolled_back_steps", 0)
    assert overlapped > 0  # the resume met rolled-back steps Θ lacks, and left them out
    assert summary["resume_lost_steps"] == sum(e["lost_steps"] for e in cuts)
    assert _read(tmp_path / "attempts.jsonl")[1]["rolled_spans"]  # kept for a third attempt


def restore_versions(wd):
    (restore,) = [e for e in _read(wd / "events.jsonl") if e["event"] == "syncer_restore"]
    return restore["versions"]


def _restored_once(small_config):
    """Two learners of speeds 2 and 3 and a syncer crash at step 9, its checkpoints 1000 s
    apart: the restore rolls back the merges made before the crash."""
    return small_config(**{"train.steps": 32, "train.checkpoint_every": 4, **DECOUPLED,
                           "diloco.fragments": 1, "faults.unit": "steps",
                           "faults.syncer_crashes": [9], "faults.syncer_restart_delay_s": 0.2,
                           "faults.speed_factors": [2.0, 3.0],
                           "diloco.syncer_checkpoint_seconds": 1000.0})  # fmt: skip
