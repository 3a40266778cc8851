"""In-process transport: queues between learner threads and syncer threads.

Every learner link has one sender thread that delivers its messages in order. Links follow
the fault schedule: a message occupies its link for bytes / bandwidth (messages queue behind each
other) and then arrives one latency later (messages in flight overlap, as on a real
network), so a slow link delays that learner's offers but never its training.
"""

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

from decoupled_diloco.diloco.messages import Offer
from decoupled_diloco.diloco.transport import LearnerLink, SyncerLink

_CLOSE = object()  # queued by `LocalLearnerLink.close`: its sender thread ends there
# How long a close waits for a thread to deliver what it holds: a learner's flush has
# waited for its messages already; a shard that takes a call and never answers must not
# keep a finished or failed learner from ending (a failed Ray learner from restarting).
CLOSE_TIMEOUT_S = 30.0


def join_thread(thread: threading.Thread | None, timeout: float, name: str) -> None:
    """Waits up to `timeout` s for `thread` (None: none) to end; warns if it has not."""
    if thread is None:
        return
    thread.join(timeout)
    if thread.is_alive():
        logging.warning("thread %s still delivering after %.0f s; left to end by itself",
                        name, timeout)  # fmt: skip


def _drain(q: queue.Queue, timeout: float) -> list:
    out = []
    try:
        out.append(q.get(timeout=timeout) if timeout > 0 else q.get_nowait())
        while True:
            out.append(q.get_nowait())
    except queue.Empty:
        pass
    return out


class _InFlight:
    """Messages on the wire: each is put into its destination queue at its arrival time.

    One daemon thread; arrivals in time order, ties in send order. Per link, arrival times
    never decrease (`Link.send`), so a link delivers in order.
    """

    def __init__(self):
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False  # `close`: the thread ends once the heap is empty

    def put(self, at: float, dest: queue.Queue | threading.Event, msg=None) -> None:
        with self._cv:
            heapq.heappush(self._heap, (at, next(self._seq), dest, msg))
            if self._thread is None and not self._closing:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="in-flight")
                self._thread.start()
            self._cv.notify()

    def close(self, deliver: bool = True, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Delivers what is on the wire at its time (`deliver`; else drops it), then ends
        the thread (idempotent; waits at most `timeout` s)."""
        with self._cv:
            thread, self._closing = self._thread, True
            if not deliver:
                self._heap.clear()
            self._cv.notify()
        join_thread(thread, timeout, "in-flight")

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    if not self._heap and self._closing:
                        self._thread = None
                        return
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cv.wait(wait)
                _, _, dest, msg = heapq.heappop(self._heap)
            if isinstance(dest, threading.Event):
                dest.set()
            else:
                dest.put(msg)


class Link:
    """One direction of one learner's link: serialisation at the bandwidth, then latency.

    `seconds(nbytes)` is the fault schedule's latency + 8·nbytes / bandwidth; the latency is
    its value at 0 bytes.
    """

    def __init__(self, seconds: Callable[[int], float]):
        self._seconds = seconds
        self._free_at = 0.0  # when the link has finished serialising what it was given
        self._last_arrival = 0.0

    def send(self, nbytes: int, now: float) -> tuple[float, float]:
        """(when the link has sent it, when it arrives) for `nbytes` handed over at `now`."""
        latency = self._seconds(0)
        start = max(now, self._free_at)
        self._free_at = start + max(self._seconds(nbytes) - latency, 0.0)
        self._last_arrival = max(self._free_at + latency, self._last_arrival)
        return self._free_at, self._last_arrival


class LocalLearnerLink(LearnerLink):
    def __init__(
        self,
        learner: int,
        syncer_inboxes: list[queue.Queue],
        shard_of_fragment: Callable[[int], int],
        link_seconds: Callable[[int], float] = lambda nbytes: 0.0,
    ):
        self.learner, self.inbox = learner, queue.Queue()
        self._syncers, self._shard_of = syncer_inboxes, shard_of_fragment
        self._link = Link(link_seconds)
        self._slow = link_seconds(0) > 0 or link_seconds(1 << 20) > 0
        self._in_flight = _InFlight()
        self._outbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(
            target=self._send_loop, daemon=True, name=f"learner{learner}-sender"
        )
        self._thread.start()

    def send(self, msg) -> None:
        self._outbox.put(msg)

    def receive(self, timeout: float = 0.0) -> list:
        return _drain(self.inbox, timeout)

    def flush(self, timeout: float = 600.0) -> bool:
        done = threading.Event()
        self._outbox.put(done)
        return done.wait(timeout)

    def reset(self) -> None:
        _drain(self._outbox, 0.0)
        _drain(self.inbox, 0.0)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._outbox.put(_CLOSE)
        join_thread(thread, timeout, f"learner{self.learner}-sender")
        self._in_flight.close(timeout=timeout)

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is _CLOSE:
                return
            if isinstance(msg, threading.Event):  # flush: set once all before it arrived
                self._deliver(msg, None, 0)
                continue
            if isinstance(msg, Offer):
                self._deliver(self._syncers[self._shard_of(msg.fragment)], msg, msg.nbytes)
            else:  # joins, leaves and heartbeats go to every syncer shard
                for q in self._syncers:
                    self._deliver(q, msg, 0)

    def _deliver(self, dest, msg, nbytes: int) -> None:
        if not self._slow:
            dest.set() if isinstance(dest, threading.Event) else dest.put(msg)
            return
        now = time.monotonic()
        sent, arrives = self._link.send(nbytes, now)
        time.sleep(max(sent - now, 0.0))  # the uplink is busy until the bytes are out
        self._in_flight.put(arrives, dest, msg)


class LocalSyncerLink(SyncerLink):
    def __init__(
        self,
        inbox: queue.Queue,
        learner_inboxes: dict[int, queue.Queue],
        reply_seconds: Callable[[int, int], float] = lambda m, nbytes: 0.0,
    ):
        self.inbox, self._learners, self._reply_seconds = inbox, learner_inboxes, reply_seconds
        self._links: dict[int, Link] = {}  # per learner: the syncer's downlink to it
        self._in_flight = _InFlight()

    def receive(self, timeout: float) -> list:
        return _drain(self.inbox, timeout)

    def close(self) -> None:
        """After the run: replies still on the wire are for learners that are done (they
        are dropped, not waited for), and the link's thread ends."""
        self._in_flight.close(deliver=False)

    def send(self, learner: int, msg) -> None:
        q = self._learners.get(learner)
        if q is None:
            return
        nbytes = getattr(msg, "nbytes", 0)
        if self._reply_seconds(learner, nbytes) <= 0:
            q.put(msg)
            return
        link = self._links.get(learner)
        if link is None:
            link = self._links[learner] = Link(lambda n, m=learner: self._reply_seconds(m, n))
        self._in_flight.put(link.send(nbytes, time.monotonic())[1], q, msg)
