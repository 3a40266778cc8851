"""A run whose workdir, checkpoints and tokenizer live on gs:// (tests/fake_gcs.py serves
gs:// from a local folder through fsspec and TensorStore, the routes gcsfs and orbax take)."""

import json
import os
import time

import numpy as np
import pytest
from etils import epath
from fake_gcs import fake_gcs

from decoupled_diloco import config as config_lib
from decoupled_diloco import paths, preflight, run_files
from decoupled_diloco.checkpoint import Checkpointer
from decoupled_diloco.metrics import JsonlWriter
from decoupled_diloco.runtime import launch, workdir_lock


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # where a path mistaken for a local one would land
    with fake_gcs(str(tmp_path / "gcs")) as root:
        yield root


def _objects(root: str, prefix: str) -> set[str]:
    base = os.path.join(root, prefix)
    return {
        os.path.relpath(os.path.join(d, f), base) for d, _, files in os.walk(base) for f in files
    }


def test_the_stand_in_refuses_appends_like_gcs(gcs):
    with pytest.raises(OSError, match="cannot append"):
        epath.Path("gs://bkt/x.txt").open("a")


@pytest.mark.slow
def test_a_run_with_its_workdir_on_gcs_keeps_everything_there(gcs, small_config, tmp_path):
    cfg = small_config(
        **{
            "diloco.learners": 2,
            "diloco.sync_every": 4,
            "diloco.fragments": 2,
            "train.steps": 8,
            "train.checkpoint_every": 4,
            "data.tokenizer": "sentencepiece",
            "data.spm_vocab_size": 512,
            "data.cache_dir": "gs://bkt/cache",
            "model.vocab_size": 512,
        }
    )
    run = config_lib.validate(cfg)
    summary = launch.run(run, "gs://bkt/run", verbose=False)
    assert summary["steps"] == 8 and np.isfinite(summary["final_eval_loss"])

    written = _objects(gcs, "bkt/run")
    for name in ("metrics.jsonl", "merges.jsonl", "events.jsonl", "summary.json",
                 "run_config.json", "attempts.jsonl", "tokenizer.model"):  # fmt: skip
        assert name in written, name
    assert "run.lock" not in written  # released
    for role in ("learner_0/8", "learner_1/8", "syncer_0"):
        assert any(f.startswith(f"checkpoints/{role}/") for f in written), role
    with open(os.path.join(gcs, "bkt/run/metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    assert {r["step"] for r in rows if r["learner"] == 0} == set(range(1, 9))
    assert any(f.startswith("spm/bpe512-") for f in _objects(gcs, "bkt/cache"))
    for run_name in ("learner_0", "learner_1", "global"):  # TensorBoard beside the JSONL
        assert any(f.startswith(f"tensorboard/{run_name}/events.out.tfevents.") for f in written)
    assert os.listdir(os.getcwd()) == []  # no ./gs:/... (nor anything else) locally

    # What reads a run reads it from gs:// too: a re-run finds it finished, load() its model.
    assert launch.run(run, "gs://bkt/run", verbose=False) == summary
    from decoupled_diloco.loading import load

    model = load("gs://bkt/run")
    assert model.tokenizer.vocab_size == 512 and "syncer checkpoints" in model.source


def test_a_corrupt_step_on_gcs_is_moved_aside(gcs):
    ckpt = Checkpointer("gs://bkt/c/learner_0", max_to_keep=3)
    w = np.arange(4096, dtype=np.float32)
    for step in (1, 2):
        assert ckpt.save(step, {"w": w + step}, {"step": step})
    data = [f for f in _objects(gcs, "bkt/c/learner_0/2") if "/d/" in f]
    for f in data:  # every array data object of step 2 damaged
        with open(os.path.join(gcs, "bkt/c/learner_0/2", f), "r+b") as fh:
            raw = bytearray(fh.read())
            raw[len(raw) // 2 :] = bytes(len(raw) - len(raw) // 2)
            fh.seek(0)
            fh.write(raw)
    arrays, meta = ckpt.restore({"w": np.zeros_like(w)})
    assert meta["step"] == 1 and np.array_equal(arrays["w"], w + 1)
    [(step, _, moved)] = ckpt.refused
    assert moved == "gs://bkt/c/corrupt/learner_0-2" and epath.Path(moved).exists()
    assert not epath.Path("gs://bkt/c/learner_0/2").exists() and ckpt.latest_step() == 1
    ckpt.close()


def test_remote_jsonl_is_rewritten_whole_and_continued_on_resume(gcs):
    w = JsonlWriter("gs://bkt/r/metrics.jsonl")
    for i in range(5):
        w.write({"step": i})
    w._file.flush()
    assert len(epath.Path("gs://bkt/r/metrics.jsonl").read_text().splitlines()) == 5
    assert w.retain(lambda r: r["step"] < 3) == 2
    w.close()
    again = JsonlWriter("gs://bkt/r/metrics.jsonl")  # a resumed run appends to what is there
    again.write({"step": 3})
    again.close()
    lines = epath.Path("gs://bkt/r/metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3]


def test_a_remote_workdir_lock_is_a_lease(gcs, monkeypatch):
    monkeypatch.setattr(workdir_lock, "RENEW_SECONDS", 0.05)
    path = epath.Path("gs://bkt/w/run.lock")
    with workdir_lock.lock("gs://bkt/w") as lease:
        first = json.loads(path.read_text())
        busy = pytest.raises(workdir_lock.WorkdirBusyError, match="in use by another run")
        with busy, workdir_lock.lock("gs://bkt/w"):
            pass
        time.sleep(0.3)
        assert json.loads(path.read_text())["renewed"] > first["renewed"]  # kept alive
        assert lease.lost is None
    assert not path.exists()  # released

    # A holder that died without releasing: its lease runs out and the next run takes over.
    path.write_text(json.dumps({"host": "dead", "pid": 1, "token": "x", "renewed": 0.0}))
    with workdir_lock.lock("gs://bkt/w") as lease:
        assert json.loads(path.read_text())["token"] == lease.holder["token"]
    path.write_text(json.dumps({"host": "alive", "pid": 1, "token": "y", "renewed": time.time()}))
    with (
        pytest.raises(workdir_lock.WorkdirBusyError, match="host alive"),
        workdir_lock.lock("gs://bkt/w"),
    ):
        pass


def test_a_tokenizer_on_gcs_is_read_and_a_trained_one_is_shared(gcs, small_config):
    spm = {"data.tokenizer": "sentencepiece", "data.spm_vocab_size": 512, "model.vocab_size": 512}
    cfg = small_config(**spm, **{"data.cache_dir": "gs://bkt/cache"})
    run = config_lib.validate(cfg)
    shared = run_files.with_shared_tokenizer(run, "gs://bkt/ckpt")
    assert shared.data.spm_model_path == "gs://bkt/ckpt/tokenizer.model"
    from decoupled_diloco.data import get_tokenizer

    trained, read = get_tokenizer(run.data), get_tokenizer(shared.data)
    assert read.model_proto == trained.model_proto
    assert run_files.with_shared_tokenizer(shared, "gs://bkt/other") is shared  # given: kept


def test_gcs_paths_without_gcsfs_fail_before_the_run_with_the_install_hint(
    gcs, small_config, monkeypatch
):
    import fsspec

    def missing(protocol):
        raise ImportError("Install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    run = config_lib.validate(small_config())
    with pytest.raises(preflight.FatalRunError, match=r"--workdir=.*decoupled_diloco\[tpu\]"):
        preflight.check(run, "gs://bkt/nowhere")
    assert paths.resolve("rel/dir") == epath.Path(os.path.abspath("rel/dir"))


def test_a_text_corpus_on_gcs_is_read_as_a_local_one(gcs, tmp_path):
    from decoupled_diloco.data import DataConfig, sources

    texts = {"a.txt": "first document\n" * 50, "sub/b.txt": "second one\n" * 50}
    for name, text in texts.items():
        epath.Path(f"gs://bkt/corpus/{name}").write_text(text)
        (tmp_path / "local" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "local" / name).write_text(text)
    epath.Path("gs://bkt/corpus/.hidden").write_text("not a document")
    remote = sources.path_files("gs://bkt/corpus")
    local = sources.path_files(str(tmp_path / "local"))
    assert [n for n, _ in remote] == [n for n, _ in local] == ["a.txt", "sub/b.txt"]
    docs = sources.read_documents(remote)
    assert [d.text for d in docs] == [texts["a.txt"], texts["sub/b.txt"]]
    globbed = sources.path_files("gs://bkt/corpus/**/*.txt")
    # Named below the glob's fixed folder, as a folder's files are (local or remote).
    assert [n for n, _ in globbed] == ["a.txt", "sub/b.txt"]
    assert [n for n, _ in sources.path_files("gs://bkt//corpus//**/*.txt")] == [
        "a.txt",
        "sub/b.txt",
    ]
    sources.corpus_files(DataConfig(path="gs://bkt/corpus"))  # the config route


def test_a_tokenizer_is_pre_trained_once_onto_gcs_and_used_from_there(gcs, small_config):
    from decoupled_diloco import tokenizer as tokenizer_cli
    from decoupled_diloco.data import get_tokenizer

    spm = {"data.tokenizer": "sentencepiece", "data.spm_vocab_size": 512, "model.vocab_size": 512}
    cfg = small_config(**spm)
    assert tokenizer_cli.train_and_save(config_lib.data_config(cfg), "gs://bkt/t/bpe.model") == 512
    cfg.data.spm_model_path = "gs://bkt/t/bpe.model"
    run = config_lib.validate(cfg)  # reads the model's vocabulary size from gs://
    text = "def f(x):\n    return x\n"
    assert get_tokenizer(run.data).decode(get_tokenizer(run.data).encode(text)) == text
    with pytest.raises(ValueError, match="only sentencepiece"):
        tokenizer_cli.train_and_save(config_lib.data_config(small_config()), "gs://bkt/t/x")


def test_the_published_default_tokenizer_validates_offline_and_is_checked_when_read(
    gcs, small_config
):
    """The TPU configs name T5's C4 model on gs://: a config validates without reading it
    (its size is known), and the file read at start-up must hold that many pieces."""
    from decoupled_diloco import tokenizer as tokenizer_cli
    from decoupled_diloco.data import get_tokenizer
    from decoupled_diloco.data.config import KNOWN_SPM_PIECES, T5_C4_SPM_MODEL

    spm = {"data.tokenizer": "sentencepiece", "model.vocab_size": 32_768}
    cfg = small_config(**spm, **{"data.spm_model_path": T5_C4_SPM_MODEL})
    run = config_lib.validate(cfg)  # nothing is at that path in the stand-in bucket
    with pytest.raises(ValueError, match="model.vocab_size"):
        config_lib.validate(small_config(**{**spm, "model.vocab_size": 31_999},
                                         **{"data.spm_model_path": T5_C4_SPM_MODEL}))  # fmt: skip
    with pytest.raises(ValueError, match="no such file"):
        get_tokenizer(run.data)
    small = small_config(**{"data.tokenizer": "sentencepiece", "data.spm_vocab_size": 512})
    tokenizer_cli.train_and_save(config_lib.data_config(small), T5_C4_SPM_MODEL)
    with pytest.raises(
        ValueError, match=f"512 pieces, not the {KNOWN_SPM_PIECES[T5_C4_SPM_MODEL]}"
    ):
        get_tokenizer(run.data)
