"""In-process transport: queues between learner threads and syncer threads.

Every learner has one sender thread that turns offers into wire payloads (device→host,
outer gradient, compression) in FIFO order with its other messages, and sleeps for the
fault schedule's link latency and bandwidth, so a slow link delays that learner's offers
but never its training.
"""

import queue
import threading
import time
from collections.abc import Callable

from decoupled_diloco.diloco.messages import Offer
from decoupled_diloco.diloco.transport import LearnerLink, SyncerLink


def _drain(q: queue.Queue, timeout: float) -> list:
    out = []
    try:
        out.append(q.get(timeout=timeout) if timeout > 0 else q.get_nowait())
        while True:
            out.append(q.get_nowait())
    except queue.Empty:
        pass
    return out


class LocalLearnerLink(LearnerLink):
    def __init__(
        self,
        learner: int,
        syncer_inboxes: list[queue.Queue],
        shard_of_fragment: Callable[[int], int],
        compression: str,
        link_seconds: Callable[[int], float] = lambda nbytes: 0.0,
        on_sent: Callable[[Offer], None] = lambda offer: None,
    ):
        self.learner, self.inbox = learner, queue.Queue()
        self._syncers, self._shard_of = syncer_inboxes, shard_of_fragment
        self._compression, self._link_seconds, self._on_sent = compression, link_seconds, on_sent
        self._outbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(
            target=self._send_loop, daemon=True, name=f"learner{learner}-sender"
        )
        self._thread.start()

    def send(self, msg) -> None:
        self._outbox.put(msg)

    def receive(self, timeout: float = 0.0) -> list:
        return _drain(self.inbox, timeout)

    def flush(self) -> None:
        """Blocks until everything sent so far has been delivered."""
        done = threading.Event()
        self._outbox.put(done)
        done.wait()

    def drop_pending(self) -> None:
        """A crash: what was not yet on the wire is lost with the process."""
        _drain(self._outbox, 0.0)

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if isinstance(msg, threading.Event):
                msg.set()
                continue
            if isinstance(msg, Offer):
                msg.payload = msg.payload.materialize(self._compression)
                msg.nbytes = msg.payload.nbytes()
                delay = self._link_seconds(msg.nbytes)
                if delay > 0:
                    time.sleep(delay)
                self._syncers[self._shard_of(msg.fragment)].put(msg)
                self._on_sent(msg)
            else:  # joins, leaves and heartbeats go to every syncer shard
                for q in self._syncers:
                    q.put(msg)


class LocalSyncerLink(SyncerLink):
    def __init__(
        self,
        inbox: queue.Queue,
        learner_inboxes: dict[int, queue.Queue],
        reply_seconds: Callable[[int, int], float] = lambda m, nbytes: 0.0,
    ):
        self.inbox, self._learners, self._reply_seconds = inbox, learner_inboxes, reply_seconds

    def receive(self, timeout: float) -> list:
        return _drain(self.inbox, timeout)

    def send(self, learner: int, msg) -> None:
        q = self._learners.get(learner)
        if q is None:
            return
        delay = self._reply_seconds(learner, getattr(msg, "nbytes", 0))
        if delay > 0:
            threading.Timer(delay, q.put, (msg,)).start()
        else:
            q.put(msg)
