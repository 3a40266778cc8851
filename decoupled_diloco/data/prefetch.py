"""Batches read ahead on a background thread, so a learner's step never waits for its data.

`Prefetch(source, depth, put)` wraps any batch iterator with `get_state`/`set_state` (the
`TokenBatchIterator` protocol). A daemon thread reads up to `depth` batches ahead and passes
each through `put` (the replica's host->device placement), so both the read and the
transfer overlap the steps the device is running. The state is the consumer's, not the
reader's: `get_state()` names the position after the last batch handed out, so a
checkpoint taken mid-run resumes at exactly the next batch the learner would have trained
on, however far ahead the thread had read. `set_state` stops the thread, moves the source
and starts reading again from there.

An error in the reader (a corrupt record, an exhausted finite source) reaches the consumer
at the `next()` that would have returned that batch, not earlier and never lost.
"""

import queue
import threading
import time
from collections.abc import Callable

_POLL_S = 0.05  # how often a blocked reader checks whether it was asked to stop


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetch:
    def __init__(self, source, depth: int, put: Callable | None = None):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._source, self._depth = source, depth
        self._put = put if put is not None else (lambda batch: batch)
        self._state = source.get_state()
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self.wait_seconds = 0.0  # time next() spent waiting for the reader (data-bound)

    @property
    def batch_size(self):
        return self._source.batch_size

    def __iter__(self) -> "Prefetch":
        return self

    def __next__(self):
        if self._thread is None:
            self._start()
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            t0 = time.perf_counter()
            item = self._queue.get()
            self.wait_seconds += time.perf_counter() - t0
        if isinstance(item, _Failure):
            self._thread.join()
            self._thread = None  # a later next() retries from the failed position:
            self._source.set_state(self._state)  # (the reader had gone past it)
            raise item.error
        batch, self._state = item
        return batch

    def skip(self, n: int) -> None:
        """Moves past the next `n` batches without placing them: read on this thread (a
        record stream's batches depend on what it reads) but never sent to the devices,
        as `next` would (a rejoin skipping the steps Θ already holds)."""
        self.close()
        for _ in range(n):
            next(self._source)
        self._state = self._source.get_state()

    def get_state(self) -> dict:
        return self._state

    def set_state(self, state: dict) -> None:
        self.close()
        self._source.set_state(state)
        self._state = self._source.get_state()

    def close(self) -> None:
        """Stops the reader; batches read ahead are discarded (the source is rewound to the
        consumer's position, so nothing is skipped)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._source.set_state(self._state)

    def _start(self) -> None:
        self._queue, self._stop = queue.Queue(self._depth), threading.Event()
        self._thread = threading.Thread(
            target=self._read, args=(self._queue, self._stop), daemon=True, name="prefetch"
        )
        self._thread.start()

    def _read(self, out: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = (self._put(next(self._source)), self._source.get_state())
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, in order
                item = _Failure(e)
            while not stop.is_set():
                try:
                    out.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return
