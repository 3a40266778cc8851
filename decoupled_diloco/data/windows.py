"""Window streams: where the [seq_len + 1]-token training windows of one shard come from.

Window k of a token stream holds tokens [k·L, k·L + L] (L = seq_len): consecutive windows
share one token, so every token after the first is a prediction target exactly once per
epoch, up to the last whole window (the fewer than L tokens after it never are: the end of
the stream's last document). Each stream's state is a few ints and resumes exactly.
"""

from collections.abc import Callable

import numpy as np

from decoupled_diloco.data.order import ShardedOrder


class PackedWindows:
    """Windows of one in-memory token array (documents joined by the separator), shuffled
    window by window: window k belongs to shard k % num_shards."""

    kind = "packed"

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        shard_index: int,
        num_shards: int,
        seed: int,
        what: str = "this split",
        remedy: str = "more data",
    ):
        """`what` names the tokens and `remedy` what else to change in the error raised
        when they hold no window."""
        num_windows = (len(tokens) - 1) // seq_len
        if num_windows < 1:
            raise ValueError(
                f"data.seq_len={seq_len}: {what} has only {len(tokens)} tokens, fewer than "
                f"seq_len + 1; use a shorter seq_len or {remedy}"
            )
        self._tokens = tokens
        self.seq_len = seq_len
        self.order = ShardedOrder(num_windows, shard_index, num_shards, seed)
        self.windows_per_epoch = self.order.size  # this shard's windows
        self._epoch, self._position = 0, 0

    def take(self, count: int) -> np.ndarray:
        """The next `count` windows, int32 [count, seq_len + 1]."""
        ids, self._epoch, self._position = self.order.take(self._epoch, self._position, count)
        index_NT = ids[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return self._tokens[index_NT].astype(np.int32)

    def get_state(self) -> dict:
        return {"epoch": self._epoch, "position": self._position, "size": self.order.size}

    def set_state(self, state: dict) -> bool:
        self._epoch, self._position, moved = resume_at(state, self.order.size)
        return moved


class RecordWindows:
    """Windows packed on the fly from documents read lazily (e.g. TFDS records).

    Document d belongs to shard d % num_shards; each epoch the shard reads its documents in a
    fresh permutation, tokenizes each (plus separator) and cuts the concatenation into windows.
    State = (epoch, position of the document the next window starts in, token offset in it).

    Documents are read in groups (`read_documents` takes a whole group in one call: one
    batched read of the source), sized from the mean document length seen so far so that one
    group usually covers a batch. The groups are an implementation detail: the windows are a
    function of the state alone, and the documents read but not used yet are dropped by
    `set_state` and re-read.
    """

    kind = "records"
    MAX_GROUP = 4096  # documents per read, at most
    windows_per_epoch = None  # documents are cut into windows as they are read

    def __init__(
        self,
        read_documents: Callable[[np.ndarray], list[np.ndarray]],
        num_documents: int,
        seq_len: int,
        shard_index: int,
        num_shards: int,
        seed: int,
    ):
        # document indices [N] -> their int32 ids, each [n >= 1] with the separator last
        self._read_documents = read_documents
        self.seq_len = seq_len
        self.order = ShardedOrder(num_documents, shard_index, num_shards, seed)
        self._epoch, self._position, self._offset = 0, 0, 0
        self._ahead: list[tuple[tuple[int, int], np.ndarray]] = []  # read from the state on
        self._docs_read, self._tokens_read = 0, 0  # for the group size

    def _ahead_tokens(self) -> int:
        return sum(len(t) for _, t in self._ahead) - self._offset

    def _read_ahead(self, tokens: int) -> None:
        """Reads groups of documents until those ahead of the state hold `tokens` tokens."""
        missing = tokens - self._ahead_tokens()
        while missing > 0:
            mean = self._tokens_read / self._docs_read if self._docs_read else self.seq_len
            # A quarter more than the mean suggests: one read usually covers the batch (the
            # rest stays ahead for the next one).
            group = int(min(np.ceil(1.25 * missing / max(mean, 1.0)) + 1, self.MAX_GROUP))
            if self._ahead:
                at = self.order.next(*self._ahead[-1][0])
            else:
                at = (self._epoch, self._position)
            ids, _, _ = self.order.take(*at, group)
            docs = self._read_documents(ids)
            if len(docs) != len(ids):
                raise ValueError(f"read {len(docs)} documents for {len(ids)} indices")
            for doc, tokens_n in zip(ids, docs, strict=True):
                if len(tokens_n) < 1:
                    raise ValueError(f"document {doc} gave no tokens (not even the separator)")
                self._ahead.append((at, tokens_n))
                at = self.order.next(*at)
                missing -= len(tokens_n)
            self._docs_read += len(docs)
            self._tokens_read += sum(len(t) for t in docs)

    def take(self, count: int) -> np.ndarray:
        """The next `count` windows, int32 [count, seq_len + 1]."""
        target = count * self.seq_len  # where the window after these starts
        self._read_ahead(target + 1)
        lengths = np.array([len(t) for _, t in self._ahead])
        ends = np.cumsum(lengths) - self._offset  # in tokens from the state's position
        stream = np.concatenate([t for _, t in self._ahead])[self._offset :]
        j = int(np.searchsorted(ends, target, side="right"))  # the document holding `target`
        self._epoch, self._position = self._ahead[j][0]
        self._offset = int(target - (ends[j] - lengths[j]))
        del self._ahead[:j]  # documents wholly before the new position are done
        index_NT = np.arange(count)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return stream[index_NT].astype(np.int32)

    def get_state(self) -> dict:
        return {"epoch": self._epoch, "position": self._position, "offset": self._offset,
                "size": self.order.size}  # fmt: skip

    def set_state(self, state: dict) -> bool:
        epoch, position, moved = resume_at(state, self.order.size)
        offset = 0 if moved else int(state["offset"])
        if offset < 0:
            raise ValueError(f"data state {state}: negative offset")
        (doc,) = self.order.items(epoch, np.array([position]))
        (tokens,) = self._read_documents(np.array([doc]))
        if offset >= len(tokens):  # its document is another one now (a forced resume)
            offset, moved = 0, True
        self._epoch, self._position, self._offset = epoch, position, offset
        self._ahead = [((epoch, position), tokens)]
        return moved


def resume_at(state: dict, size: int) -> tuple[int, int, bool]:
    """(epoch, position, moved) to resume `state` at in a stream of `size` items per epoch.
    A state saved on a stream of another size (its corpus or cut changed: only a forced
    resume gets here) moves to the same share of its epoch."""
    epoch, position = int(state["epoch"]), int(state["position"])
    if epoch < 0 or position < 0:
        raise ValueError(f"data state {state}: negative epoch or position")
    saved = int(state.get("size", size))  # (states of older runs did not say)
    if saved == size and position < size:
        return epoch, position, False
    if position < saved:
        return epoch, min(position * size // max(saved, 1), size - 1), True
    return epoch + 1, 0, True  # an older state past this stream's end: the next epoch
