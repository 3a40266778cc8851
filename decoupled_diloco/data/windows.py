"""Window streams: where the [seq_len + 1]-token training windows of one shard come from.

Window k of a token stream holds tokens [k·L, k·L + L] (L = seq_len): consecutive windows
share one token, so every token is a prediction target exactly once. Each stream's state is
a few ints and resumes exactly.
"""

from collections.abc import Callable

import numpy as np

from decoupled_diloco.data.order import ShardedOrder


class PackedWindows:
    """Windows of one in-memory token array (documents joined by the separator), shuffled
    window by window: window k belongs to shard k % num_shards."""

    kind = "packed"

    def __init__(
        self, tokens: np.ndarray, seq_len: int, shard_index: int, num_shards: int, seed: int
    ):
        num_windows = (len(tokens) - 1) // seq_len
        if num_windows < 1:
            raise ValueError(
                f"data.seq_len={seq_len}: this split has only {len(tokens)} tokens, fewer than "
                "seq_len + 1; use a shorter seq_len or more data (data.max_corpus_bytes)"
            )
        self._tokens = tokens
        self.seq_len = seq_len
        self.order = ShardedOrder(num_windows, shard_index, num_shards, seed)
        self._epoch, self._position = 0, 0

    def take(self, count: int) -> np.ndarray:
        """The next `count` windows, int32 [count, seq_len + 1]."""
        ids, self._epoch, self._position = self.order.take(self._epoch, self._position, count)
        index_NT = ids[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return self._tokens[index_NT].astype(np.int32)

    def get_state(self) -> dict:
        return {"epoch": self._epoch, "position": self._position}

    def set_state(self, state: dict) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.order.size:
            raise ValueError(f"data state {state}: position outside [0, {self.order.size})")
        self._epoch, self._position = epoch, position


class RecordWindows:
    """Windows packed on the fly from documents read lazily (e.g. TFDS records).

    Document d belongs to shard d % num_shards; each epoch the shard reads its documents in a
    fresh permutation, tokenizes each (plus separator) and cuts the concatenation into windows.
    State = (epoch, position of the document the next window starts in, token offset in it).
    """

    kind = "records"

    def __init__(
        self,
        read_tokens: Callable[[int], np.ndarray],
        num_documents: int,
        seq_len: int,
        shard_index: int,
        num_shards: int,
        seed: int,
    ):
        self._read_tokens = read_tokens  # document index -> int32 ids [n >= 1], separator last
        self.seq_len = seq_len
        self.order = ShardedOrder(num_documents, shard_index, num_shards, seed)
        self._epoch, self._position, self._offset = 0, 0, 0
        self._last = (None, None)  # ((epoch, position), tokens) of the last document read

    def _document(self, epoch: int, position: int) -> np.ndarray:
        if self._last[0] != (epoch, position):
            (doc,) = self.order.items(epoch, np.array([position]))
            tokens = self._read_tokens(int(doc))
            if len(tokens) < 1:
                raise ValueError(f"document {doc} gave no tokens (not even the separator)")
            self._last = ((epoch, position), tokens)
        return self._last[1]

    def take(self, count: int) -> np.ndarray:
        """The next `count` windows, int32 [count, seq_len + 1]."""
        target = count * self.seq_len  # where the window after these starts
        chunks, got, resume = [], 0, None
        epoch, position, offset = self._epoch, self._position, self._offset
        while got <= target:
            piece = self._document(epoch, position)[offset:]
            if resume is None and got + len(piece) > target:
                resume = (epoch, position, offset + target - got)
            chunks.append(piece)
            got += len(piece)
            epoch, position = self.order.next(epoch, position)
            offset = 0
        self._epoch, self._position, self._offset = resume
        stream = np.concatenate(chunks)[: target + 1]
        index_NT = np.arange(count)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return stream[index_NT].astype(np.int32)

    def get_state(self) -> dict:
        return {"epoch": self._epoch, "position": self._position, "offset": self._offset}

    def set_state(self, state: dict) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        offset = int(state["offset"])
        if epoch < 0 or not 0 <= position < self.order.size or offset < 0:
            raise ValueError(f"data state {state}: position outside [0, {self.order.size})")
        if offset >= len(self._document(epoch, position)):
            raise ValueError(f"data state {state}: offset past the end of its document")
        self._epoch, self._position, self._offset = epoch, position, offset
