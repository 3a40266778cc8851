"""TFDS corpora read lazily, a batch of records at a time, through `tfds.data_source`
(array_record).

Nothing is loaded up front: a split is a range of record indices into a random-access
source, so a multi-TB corpus costs only the records actually read. TensorFlow is not needed
(`tfds.load` would need it). TFDS shuffles records when it prepares a dataset, so the tail
of the train split is an unbiased held-out sample when no eval split is given.
"""

import dataclasses
import hashlib
from typing import Any

from decoupled_diloco.data.config import DataConfig


@dataclasses.dataclass(frozen=True)
class RecordRange:
    """Records [start, stop) of a random-access TFDS source; document i is record start + i."""

    # len(source), source[i] -> dict of features; source.__getitems__(keys) -> list, if any
    source: Any
    start: int
    stop: int
    text_key: str

    def __len__(self) -> int:
        return self.stop - self.start

    def text(self, i: int) -> str:
        """Text of document i (utf-8, bad bytes replaced)."""
        return self.texts([i])[0]

    def texts(self, indices) -> list[str]:
        """Texts of documents `indices`, read in one batched call when the source has one
        (array_record's `__getitems__` reads the records in parallel)."""
        indices = [int(i) for i in indices]
        bad = [i for i in indices if not 0 <= i < len(self)]
        if bad:
            raise IndexError(f"documents {bad[:5]} outside a range of {len(self)} records")
        keys = [self.start + i for i in indices]
        return [self._text(record) for record in _read(self.source, keys)]

    def _text(self, record) -> str:
        if self.text_key not in record:
            raise ValueError(
                f"data.tfds_text_key={self.text_key!r}: records have features {sorted(record)}"
            )
        text = record[self.text_key]
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        if isinstance(text, str):
            # NUL is the byte tokenizer's document separator (id 0): one inside a record
            # would cut it in two, as the in-memory sources' readers keep it from doing.
            return text.replace("\0", "\ufffd")
        raise ValueError(
            f"data.tfds_text_key={self.text_key!r}: that feature holds "
            f"{type(text).__name__} values, not text (features: {sorted(record)})"
        )

    def head(self, max_bytes: int) -> "RecordRange":
        """The first records holding about `max_bytes` of utf-8 text (at least one record)."""
        total, stop = 0, self.start
        while stop < self.stop and (stop == self.start or total < max_bytes):
            total += len(self.text(stop - self.start).encode("utf-8"))
            stop += 1
        return dataclasses.replace(self, stop=stop)


def fingerprint(records: RecordRange) -> dict:
    """What identifies a split without reading it: its record range and a sha256 of its first
    and last documents (a dataset prepared again, shuffled otherwise, changes them)."""
    digest = hashlib.sha256(f"{records.start}:{records.stop}".encode())
    for text in records.texts([0, len(records) - 1]):
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return {"documents": len(records), "sha256": digest.hexdigest()}


def _read(source, keys: list[int]) -> list:
    """Records `keys` of `source`, in one `__getitems__` call where it has a working one."""
    many = getattr(source, "__getitems__", None)
    if many is not None:
        try:
            return list(many(keys))
        except TypeError:  # tfds.testing.mock_data patches a __getitems__ that cannot be called
            pass
    return [source[k] for k in keys]


def open_tfds_splits(cfg: DataConfig) -> dict[str, RecordRange]:
    """{"train": ..., "eval": ...} record ranges for `cfg` (max_corpus_bytes applies to each
    opened split before the hold-out)."""
    import tensorflow_datasets as tfds

    def open_split(split: str) -> RecordRange:
        try:
            # Never a download: a wrong data_dir must not start preparing the corpus (C4 is
            # terabytes) on every host; it is prepared once, ahead of the run.
            source = tfds.data_source(
                cfg.tfds_name, split=split, data_dir=cfg.tfds_data_dir or None, download=False
            )
        except Exception as e:
            raise ValueError(
                f"data.tfds_name={cfg.tfds_name!r} (split {split!r}, data_dir "
                f"{cfg.tfds_data_dir!r}): cannot open a prepared copy with tfds.data_source, "
                "which reads array_record files (runs never download; prepare it first: "
                f"`tfds build {cfg.tfds_name.split(':')[0]} --file_format=array_record`, also "
                f"for a copy prepared as tfrecord): {e}"
            ) from e
        records = RecordRange(source, 0, len(source), cfg.tfds_text_key)
        if not len(records):
            raise ValueError(f"data.tfds_name={cfg.tfds_name!r}: split {split!r} is empty")
        records.text(0)  # a wrong data.tfds_text_key fails at start-up, not in a learner
        return records.head(cfg.max_corpus_bytes) if cfg.max_corpus_bytes else records

    train = open_split(cfg.tfds_split)
    if cfg.tfds_eval_split:
        held = open_split(cfg.tfds_eval_split)
        shared = _shared_records(cfg.tfds_split, train, cfg.tfds_eval_split, held)
        if shared:
            raise ValueError(
                f"data.tfds_eval_split={cfg.tfds_eval_split!r} shares records with "
                f"data.tfds_split={cfg.tfds_split!r} ({shared}): the model would be scored on "
                "text it trained on; give disjoint slices (e.g. 'train[:99%]' and "
                "'train[99%:]') or another split"
            )
        return {"train": train, "eval": held}
    if len(train) < 2:
        raise ValueError(
            f"data.tfds_split={cfg.tfds_split!r}: need at least 2 records to hold some out "
            "(or set data.tfds_eval_split)"
        )
    num_eval = min(max(1, round(cfg.eval_fraction * len(train))), len(train) - 1)
    cut = train.stop - num_eval
    return {
        "train": dataclasses.replace(train, stop=cut),
        "eval": dataclasses.replace(train, start=cut),
    }


def training_text(records: RecordRange, max_bytes: int) -> str:
    """Documents from the start of `records`, about `max_bytes` of them, newline-joined."""
    head = records.head(max_bytes)
    return "\n".join(head.text(i) for i in range(len(head)))


def _records_read(spec: str, records: RecordRange) -> dict[str, list[tuple[int, int]]]:
    """{split name: [(first, end) record intervals]} that `records`, opened from the split
    `spec` (TFDS slicing, e.g. "train[:10%]+validation"), reads: the spec's pieces resolved
    against the dataset's split sizes, concatenated as TFDS does, cut to [start, stop)."""
    import tensorflow_datasets as tfds

    splits = records.source.dataset_info.splits
    out: dict[str, list[tuple[int, int]]] = {}
    offset = 0
    for piece in tfds.core.ReadInstruction.from_spec(spec).to_absolute(splits):
        size = splits[piece.splitname].num_examples
        first = 0 if piece.from_ is None else piece.from_
        end = size if piece.to is None else piece.to
        lo, hi = max(first, first + records.start - offset), min(end, first + records.stop - offset)
        if lo < hi:
            out.setdefault(piece.splitname, []).append((lo, hi))
        offset += end - first
    return out


def _shared_records(train_spec: str, train: RecordRange, eval_spec: str, held: RecordRange) -> str:
    """The records both ranges read ("train 0..3 (4 records)"), or "" if none or unknown (a
    source without TFDS's split table, as a test's mock may be)."""
    try:
        a, b = _records_read(train_spec, train), _records_read(eval_spec, held)
    except (AttributeError, KeyError, TypeError):
        return ""
    shared = []
    for name in sorted(set(a) & set(b)):
        for lo_a, hi_a in a[name]:
            for lo_b, hi_b in b[name]:
                lo, hi = max(lo_a, lo_b), min(hi_a, hi_b)
                if lo < hi:
                    shared.append(f"{name} {lo}..{hi - 1} ({hi - lo} records)")
    return ", ".join(shared)
