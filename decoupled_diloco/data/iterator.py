"""TokenBatchIterator: endless, deterministic, resumable batches of one shard of one split."""

from typing import Protocol

import numpy as np


class WindowStream(Protocol):
    kind: str  # names the stream type in the saved state
    seq_len: int

    def take(self, count: int) -> np.ndarray: ...  # int32 [count, seq_len + 1]

    def get_state(self) -> dict: ...

    def set_state(self, state: dict) -> None: ...


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

    def get_state(self) -> dict:
        return {**self._identity, **self._stream.get_state()}

    def set_state(self, state: dict) -> None:
        for key, expected in self._identity.items():
            if state.get(key) != expected:
                raise ValueError(
                    f"data iterator state has {key}={state.get(key)!r}, this iterator has "
                    f"{key}={expected!r}: it belongs to another stream"
                )
        self._stream.set_state(state)
