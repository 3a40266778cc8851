"""The data loader at scale: records read a batch at a time (one `__getitems__` call, not one
read per record), each host of a multi-host learner reading only its own rows (its own
sub-shard and position), the global batch formed on device from the hosts' rows, and each
host's position checkpointed and restored as its own."""

import json
import random
import string

import jax
import numpy as np
import pytest

from decoupled_diloco import checkpoint, sharding, transfer
from decoupled_diloco.checkpoint import Checkpointer
from decoupled_diloco.data import ByteTokenizer, DataConfig, make_iterator
from decoupled_diloco.data.iterator import TokenBatchIterator
from decoupled_diloco.data.pipeline import record_windows
from decoupled_diloco.data.tfds_source import RecordRange

SEQ_LEN, NUM_DOCS = 16, 300


class FakeSource:
    """A random-access source like `tfds.data_source` (array_record), counting its reads."""

    def __init__(self, batched: bool = True):
        rng = random.Random(0)
        self.docs = [
            "".join(rng.choices(string.ascii_lowercase + " ", k=rng.randint(1, 60)))
            for _ in range(NUM_DOCS)
        ]
        self.single_reads, self.batched_reads, self.records_read = 0, 0, 0
        if not batched:
            self.__getitems__ = None  # like a source without batched reads

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, key: int) -> dict:
        self.single_reads += 1
        self.records_read += 1
        return {"text": self.docs[key].encode()}

    def __getitems__(self, keys) -> list[dict]:
        self.batched_reads += 1
        self.records_read += len(keys)
        return [{"text": self.docs[k].encode()} for k in keys]


def _iterator(source, batch_size=8, shard=0, shards=1) -> TokenBatchIterator:
    records = RecordRange(source, 0, len(source), "text")
    stream = record_windows(ByteTokenizer(), records, SEQ_LEN, shard, shards, seed=3)
    return TokenBatchIterator(stream, batch_size, "train", shard, shards)


def test_records_are_read_a_batch_at_a_time_with_the_same_windows():
    batched, single = FakeSource(), FakeSource(batched=False)
    a, b = _iterator(batched), _iterator(single)
    for _ in range(40):  # > 2 epochs of this small corpus
        np.testing.assert_array_equal(next(a), next(b))
    assert a.get_state() == b.get_state()
    assert batched.single_reads == 0 and single.batched_reads == 0
    # One read per batch (plus the first, which learns the documents' mean length), each of
    # many records, instead of one read per record.
    assert batched.batched_reads <= 45 and single.single_reads >= 4 * batched.batched_reads
    assert batched.records_read <= 1.3 * single.records_read  # little read twice


def test_batched_reads_resume_exactly_from_a_json_state():
    it = _iterator(FakeSource(), shard=1, shards=3)
    for _ in range(11):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(9)]
    resumed = _iterator(FakeSource(), shard=1, shards=3)
    resumed.set_state(state)
    for e in expected:
        np.testing.assert_array_equal(e, next(resumed))


@pytest.fixture
def path_cfg(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(6):
        rng = random.Random(i)
        words = " ".join("".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(300))
        (folder / f"doc{i}.txt").write_text(f"<{i}> {words}\n")
    return DataConfig(source="path", path=str(folder), seq_len=SEQ_LEN)


def test_each_host_reads_only_its_rows_and_one_host_is_todays_stream(path_cfg):
    B, M, hosts = 8, 2, 4
    one = make_iterator(path_cfg, "train", B, 1, M)
    same = make_iterator(path_cfg, "train", B, 1, M, host_index=0, num_hosts=1)
    assert one.get_state() == same.get_state()
    for _ in range(3):
        np.testing.assert_array_equal(next(one), next(same))
    rows = {}
    for m in range(M):
        for h in range(hosts):
            it = make_iterator(path_cfg, "train", B, m, M, host_index=h, num_hosts=hosts)
            batches = [next(it) for _ in range(5)]
            assert batches[0].shape == (B // hosts, SEQ_LEN + 1)
            rows[m, h] = {tuple(r) for b in batches for r in b.tolist()}
    keys = list(rows)
    for i, x in enumerate(keys):  # hosts and learners never read the same window
        for y in keys[i + 1 :]:
            assert not rows[x] & rows[y], (x, y)


def test_a_host_refuses_another_hosts_position(path_cfg):
    state = make_iterator(path_cfg, "train", 8, 0, 1, host_index=1, num_hosts=2).get_state()
    other = make_iterator(path_cfg, "train", 8, 0, 1, host_index=0, num_hosts=2)
    with pytest.raises(ValueError, match="host_index"):
        other.set_state(state)
    with pytest.raises(ValueError, match="multiple of the learner's 3 hosts"):
        make_iterator(path_cfg, "train", 8, 0, 1, host_index=0, num_hosts=3)


def test_a_hosts_position_is_on_disk_before_its_step_commits(tmp_path, monkeypatch):
    """A multi-host learner killed between its checkpoint's commit and the write of its
    host's data position left a committed step the resume refused ("written by N hosts:
    resume on a slice of the same topology"). The position is written first, whole."""
    ckpt = Checkpointer(str(tmp_path / "learner_0"))
    monkeypatch.setattr(checkpoint, "_process", lambda: (1, 2))
    seen = []

    def save(step, arrays, meta, wait=True):  # the commit: what is on disk by then
        seen.append((tmp_path / "learner_0.hosts" / str(step) / "1.json").exists())
        raise KeyboardInterrupt  # killed as the step commits

    monkeypatch.setattr(ckpt, "save", save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_learner(ckpt, {"w": np.ones(3, np.float32)}, {"position": 5}, 4, 0)
    assert seen == [True]
    ckpt.close()


def test_one_process_batch_to_device_is_the_whole_batch():
    mesh = sharding.make_mesh(jax.devices()[:4])
    batch_sharding = sharding.batch_sharding(mesh)
    rows = np.arange(8 * 5, dtype=np.int32).reshape(8, 5)
    out = transfer.batch_to_device(rows, batch_sharding)
    assert out.shape == rows.shape and out.sharding == batch_sharding
    np.testing.assert_array_equal(np.asarray(out), rows)


def test_each_host_of_a_learner_checkpoints_its_own_position(tmp_path, monkeypatch):
    ckpt = Checkpointer(str(tmp_path / "learner_0"))
    state = {"w": np.ones(3, np.float32)}
    for host in (0, 1):  # process 0 writes the side-car; each host its own position
        monkeypatch.setattr(checkpoint, "_process", lambda h=host: (h, 2))
        ckpt.manager.wait_until_finished()
        if host == 1:
            checkpoint._save_host_data(ckpt, 4, {"host_index": 1, "position": 7}, 1)
        else:
            checkpoint.save_learner(ckpt, state, {"host_index": 0, "position": 5}, 4, 0)
    for host, position in ((0, 5), (1, 7)):
        monkeypatch.setattr(checkpoint, "_process", lambda h=host: (h, 2))
        step, data, _, _ = checkpoint.restore_learner(ckpt, None, params_too=False)
        assert step == 4 and data == {"host_index": host, "position": position}
    # A learner spanning more hosts than wrote the checkpoint: refused by name (it was a
    # bare FileNotFoundError, and a 1-host checkpoint resumed on 2 hosts met it too).
    monkeypatch.setattr(checkpoint, "_process", lambda: (2, 3))
    with pytest.raises(ValueError, match="no data position of host 2 .*same topology"):
        checkpoint.restore_learner(ckpt, None, params_too=False)
    # A damaged position is named with its file and step (it was a bare JSONDecodeError).
    monkeypatch.setattr(checkpoint, "_process", lambda: (1, 2))
    position = tmp_path / "learner_0.hosts" / "4" / "1.json"
    for damage, why in (('{"position": 7', "does not parse"), ("[7]", "is a list")):
        position.write_text(damage)
        with pytest.raises(
            ValueError, match=f"1.json: the data position of host 1 at step 4 {why}"
        ):
            checkpoint.restore_learner(ckpt, None, params_too=False)
    ckpt.close()


def test_a_tfds_corpus_that_is_not_prepared_is_refused_without_a_download(tmp_path):
    """A registered dataset under an empty data_dir: named, and nothing fetched there."""
    pytest.importorskip("tensorflow_datasets")
    from decoupled_diloco.data.config import DataConfig
    from decoupled_diloco.data.tfds_source import open_tfds_splits

    empty = tmp_path / "tfds"
    cfg = DataConfig(source="tfds", tfds_name="mnist", tfds_data_dir=str(empty))
    with pytest.raises(ValueError, match="data.tfds_name='mnist'.*runs never download"):
        open_tfds_splits(cfg)
    assert not empty.exists() or not any(empty.rglob("*"))
