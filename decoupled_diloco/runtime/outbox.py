"""A learner's outbox: its messages on their way to its link, in order, off its thread.

Offers leave the learner's step boundary as on-device fragment copies (their host transfer
already started), or as their outer gradient computed there (`diloco.device_rebase`); the
outbox's thread waits for the bytes, computes the outer gradient if it is not computed yet,
encodes it (`Learner.materialize`) and hands the wire message to the link. Joins, heartbeats
and leaves queue behind earlier offers, so the syncer sees them in the learner's order.
This is learner work on a learner-owned thread: the transport only carries the result.

A learner spanning several hosts (multi-controller JAX) gathers fragments with a
collective every host must issue in the same order on its step thread, so its outbox
materialises inline (`inline=True`).
"""

import queue
import threading
import time
from collections.abc import Callable

from decoupled_diloco.diloco.transport import LearnerLink
from decoupled_diloco.runtime.links import CLOSE_TIMEOUT_S, join_thread

_CLOSE = object()  # queued by `close`: the thread ends there


class Outbox:
    def __init__(self, link: LearnerLink | None, materialize: Callable, to_host: Callable,
                 inline: bool = False):  # fmt: skip
        """`materialize(ticket, host arrays, outer)` makes the wire offer
        (`diloco.learner.materialize`); `to_host(copies)` waits for a fragment's bytes (the
        replica's). `link` None: a non-leading host of a multi-host learner (it sends
        nothing)."""
        self.link, self._materialize, self._to_host = link, materialize, to_host
        self.inline = inline
        self._queue: queue.Queue = queue.Queue()
        # Messages are sent only by the life that queued them (`drop` starts a new one):
        # the lock makes "still this life? then send" one step against `drop`.
        self._life, self._lock = 0, threading.Lock()
        self._error: BaseException | None = None  # what ended the thread's work
        self._thread = None
        if not inline:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="outbox")
            self._thread.start()

    def offer(self, ticket, copies: dict, outer: bool = False) -> None:
        """Queues an offer: `ticket` from `Learner.due_offers`, `copies` of its leaves (or,
        `outer`, its outer gradient computed on the devices)."""
        self._check()
        if self.inline:
            self._send(self._make(ticket, copies, outer))
        else:
            self._queue.put((ticket, (copies, outer), self._life))

    def send(self, msg) -> None:
        self._check()
        if self.inline:
            self._send(msg)
        else:
            self._queue.put((msg, None, self._life))

    def flush(self, timeout: float = 600.0, deliver_timeout: float | None = None) -> bool:
        """Blocks until everything queued is on the link (offers materialised: the
        learner's own work) and the link delivered it; False if that did not happen in
        time. At most `timeout` s in all, or, given `deliver_timeout`, up to `timeout` for
        the first and `deliver_timeout` for the link."""
        deadline = time.monotonic() + timeout
        if not self.inline:
            done = threading.Event()
            self._queue.put((done, None, self._life))
            if not done.wait(timeout):
                return False
            self._check()
        if self.link is None:
            return True
        left = deadline - time.monotonic() if deliver_timeout is None else deliver_timeout
        return self.link.flush(max(left, 0.0))

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Ends the thread once everything queued before is on the link, then closes the
        link (idempotent; each waits at most `timeout` s). Its loop holds the learner's
        `materialize`, so a thread left running would keep the learner, its device state
        included, alive for the life of the process."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put((_CLOSE, None, None))
        join_thread(thread, timeout, "outbox")
        if self.link is not None:
            self.link.close()

    def drop(self) -> None:
        """The learner's process died: nothing queued here leaves (an offer the thread is
        making included), nothing arrived counts."""
        with self._lock:
            self._life += 1
            try:
                while True:
                    item, _, _ = self._queue.get_nowait()
                    if isinstance(item, threading.Event):
                        item.set()
            except queue.Empty:
                pass
            if self.link is not None:
                self.link.reset()

    def _check(self) -> None:
        """Raises, on the learner's thread, what ended the outbox thread's work: else the
        learner's messages would queue behind it unsent for the rest of the run."""
        if self._error is not None:
            e = self._error
            raise RuntimeError(f"the learner's outbox failed: {type(e).__name__}: {e}") from e

    def _make(self, ticket, copies: dict, outer: bool = False):
        return self._materialize(ticket, self._to_host(copies), outer)

    def _send(self, msg) -> None:
        if self.link is not None:
            self.link.send(msg)

    def _loop(self) -> None:
        while True:
            item, copies, life = self._queue.get()
            if item is _CLOSE:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self._error is not None:  # failed: nothing more leaves (`_check` tells)
                continue
            try:
                msg = self._make(item, *copies) if copies is not None else item
                with self._lock:
                    if life == self._life:
                        self._send(msg)
            except Exception as e:  # (a failed transfer, encoding or link)
                if life == self._life:  # (a dead life's offer may fail with its devices)
                    self._error = e
