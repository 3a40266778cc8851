"""TokenBatchIterator: endless, deterministic, resumable batches of one shard of one split."""

from typing import Protocol

import numpy as np
from absl import logging


class WindowStream(Protocol):
    kind: str  # names the stream type in the saved state
    seq_len: int
    windows_per_epoch: int | None  # None: not known before reading (windows cut from records)

    def take(self, count: int) -> np.ndarray: ...  # int32 [count, seq_len + 1]

    def get_state(self) -> dict: ...  # "epoch", "position", "size" (items per epoch), ...

    def set_state(self, state: dict) -> bool: ...  # True: moved to fit a changed stream


class TokenBatchIterator:
    """Yields int32 [batch_size, seq_len + 1]: model input [:, :-1], targets [:, 1:]
    (`batch_size`: this host's rows of a learner's global batch).

    Never raises StopIteration: epochs follow one another, each reshuffled. The state is a
    small JSON-serialisable dict; it records which split / shard / seq_len it belongs to so a
    learner cannot silently resume another learner's stream.
    """

    def __init__(
        self,
        stream: WindowStream,
        batch_size: int,
        split: str,
        shard_index: int,
        num_shards: int,
        host_index: int = 0,
        num_hosts: int = 1,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self._stream = stream
        self.batch_size = batch_size
        self.seq_len = stream.seq_len
        self.tokens_per_batch = batch_size * stream.seq_len  # target tokens per batch
        self._identity = {
            "kind": stream.kind,
            "split": split,
            "shard_index": shard_index,
            "num_shards": num_shards,
            "seq_len": stream.seq_len,
        }
        if num_hosts > 1:  # (absent with one host: states stay those of older runs)
            self._identity.update(host_index=host_index, num_hosts=num_hosts)

    def __iter__(self) -> "TokenBatchIterator":
        return self

    def __next__(self) -> np.ndarray:
        return self._stream.take(self.batch_size)

    @property
    def windows_per_epoch(self) -> int | None:
        """This shard's windows in one epoch, or None when not known in advance."""
        return self._stream.windows_per_epoch

    @property
    def batches_per_epoch(self) -> int | None:
        """Batches that read every window of this shard at least once (the last one partly
        from the next epoch), or None when the stream's windows are not known in advance."""
        windows = self._stream.windows_per_epoch
        return None if windows is None else -(-windows // self.batch_size)

    def get_state(self) -> dict:
        return {**self._identity, **self._stream.get_state()}

    def set_state(self, state: dict) -> None:
        """Resumes at `state`. A state of another stream (kind, split, shard, host) is refused.
        One of this stream as it was before a forced resume changed its corpus or cut
        (seq_len, learners, hosts; runtime/workdir.py, run_files.check_corpus) continues at
        the same share of its epoch, with a warning: positions of another cut cannot be
        exact."""
        for key in _OWN:
            if key in self._identity and state.get(key) != self._identity[key]:
                raise ValueError(
                    f"data iterator state has {key}={state.get(key)!r}, this iterator has "
                    f"{key}={self._identity[key]!r}: it belongs to another stream"
                )
        cut = [k for k in _CUT if state.get(k, _ONE.get(k)) != self._identity.get(k, _ONE.get(k))]
        moved = self._stream.set_state(state)
        if cut or moved:
            new = self._stream.get_state()
            logging.warning(
                "data: the %s stream of shard %d changed since its checkpoint (%s): "
                "continuing at epoch %d, %d of %d items (was %s of %s)",
                self._identity["split"], self._identity["shard_index"],
                ", ".join(cut) or "its corpus", new["epoch"], new["position"], new["size"],
                state.get("position"), state.get("size", "?"),
            )  # fmt: skip


# State keys that name whose stream it is (never adapted) and how the stream was cut (a
# forced resume may change them; absent host keys mean one host).
_OWN = ("kind", "split", "shard_index", "host_index")
_CUT = ("seq_len", "num_shards", "num_hosts")
_ONE = {"host_index": 0, "num_hosts": 1}
