"""The in-process links: in-order delivery, pipelined latency, serialised bandwidth."""

import queue
import threading
import time

import pytest
from conftest import threads_left

from decoupled_diloco.diloco.messages import Heartbeat, Merged
from decoupled_diloco.runtime.links import LocalLearnerLink, LocalSyncerLink
from decoupled_diloco.runtime.outbox import Outbox


class _Stamped(queue.Queue):
    """A queue that remembers when each item was put."""

    def put(self, item, block=True, timeout=None):
        super().put((item, time.monotonic()), block, timeout)


def _arrivals(q: _Stamped, n: int, t0: float, timeout: float = 5.0) -> list:
    out = []
    for _ in range(n):
        msg, at = q.get(timeout=timeout)
        out.append((msg, at - t0))
    return out


def test_latency_overlaps_messages_in_flight_and_keeps_their_order():
    syncer_q = _Stamped()
    link = LocalLearnerLink(0, [syncer_q], lambda p: 0, link_seconds=lambda n: 0.3)
    t0 = time.monotonic()
    for step in range(5):
        link.send(Heartbeat(0, 0, step, 0.1, 0.0))
    got = _arrivals(syncer_q, 5, t0)
    assert [m.step for m, _ in got] == list(range(5))
    # One latency for all of them (a serial link would take 5 x 0.3 s).
    assert all(0.25 <= t < 0.9 for _, t in got), got
    link.flush()  # returns once everything sent before it has arrived
    assert syncer_q.empty()
    link.close()


def test_bandwidth_serialises_replies_per_learner_and_latency_adds_once():
    inboxes = {0: _Stamped(), 1: _Stamped()}
    # 0.1 s latency; 10 kB/s, so a 2 kB reply occupies the downlink for 0.2 s.
    link = LocalSyncerLink(queue.Queue(), inboxes, lambda m, n: 0.1 + n / 10_000)
    t0 = time.monotonic()
    for v in range(3):
        link.send(0, Merged(0, v, None, (0,), 0.0, nbytes=2_000))
    link.send(1, Merged(0, 0, None, (0,), 0.0, nbytes=2_000))  # its own downlink
    got = _arrivals(inboxes[0], 3, t0)
    assert [m.version for m, _ in got] == [0, 1, 2]
    for (_, t), expected in zip(got, (0.3, 0.5, 0.7), strict=True):
        assert expected - 0.05 <= t <= expected + 0.3, got
    ((_, t1),) = _arrivals(inboxes[1], 1, t0)
    assert t1 < 0.45  # not queued behind learner 0's replies
    link.close()


def test_a_closed_link_has_delivered_what_it_was_given_and_its_threads_are_gone():
    """A learner's link delivers what it was handed before its threads end; the syncer's
    closes after the run, when replies still on the wire are for learners that are done:
    it drops them instead of waiting them out."""
    before = set(threading.enumerate())
    syncer_q, inboxes = queue.Queue(), {0: queue.Queue()}
    up = LocalLearnerLink(0, [syncer_q], lambda p: 0, link_seconds=lambda n: 0.2)
    down = LocalSyncerLink(queue.Queue(), inboxes, lambda m, n: 5.0)
    for step in range(3):
        up.send(Heartbeat(0, 0, step, 0.1, 0.0))
        down.send(0, Merged(0, step, None, (0,), 0.0))
    up.close()
    assert [syncer_q.get_nowait().step for _ in range(3)] == [0, 1, 2] and syncer_q.empty()
    t0 = time.monotonic()
    down.close()
    assert time.monotonic() - t0 < 1.0 and inboxes[0].empty()
    assert threads_left(before) == []


def test_closing_a_link_stuck_in_a_delivery_gives_up_after_its_timeout(caplog):
    """A shard that takes a call and never answers must not keep a finished or failed
    learner from ending (a failed Ray learner from dying and being restarted)."""
    stuck = threading.Event()

    class Hung:
        def put(self, msg):
            stuck.set()
            threading.Event().wait(30)

    link = LocalLearnerLink(0, [Hung()], lambda p: 0)
    link.send(Heartbeat(0, 0, 1, 0.1, 0.0))
    assert stuck.wait(5)
    t0 = time.monotonic()
    link.close(timeout=0.5)
    assert time.monotonic() - t0 < 2.0
    assert "learner0-sender still delivering" in caplog.text


def test_unlimited_links_deliver_at_once():
    inboxes = {0: queue.Queue()}
    link = LocalSyncerLink(queue.Queue(), inboxes)
    link.send(0, Merged(0, 1, None, (0,), 0.0, nbytes=10**9))
    assert inboxes[0].get_nowait().version == 1
    link.send(5, Merged(0, 1, None, (0,), 0.0))  # a learner without an inbox: dropped


def test_an_outbox_flush_waits_at_most_its_timeout_in_all():
    """A finished learner's last flush is bounded by what is left of diloco.final_wait: over
    a link too slow for its messages it returns False at the timeout, not after the outbox's
    wait and then the link's, each with the whole timeout (or after the link's 600 s)."""
    link = LocalLearnerLink(0, [queue.Queue()], lambda p: 0, link_seconds=lambda n: 30.0)

    def materialize(ticket, host, outer):  # 0.4 s of the outbox's thread
        time.sleep(0.4)
        return Heartbeat(0, 0, 1, 0.1, 0.0)

    outbox = Outbox(link, materialize, to_host=lambda copies: copies)
    outbox.offer(None, {})  # then 30 s on the wire
    t0 = time.monotonic()
    assert outbox.flush(timeout=0.6) is False
    assert 0.5 <= time.monotonic() - t0 < 0.9
    outbox.link = None  # the message is 30 s from arriving: close the link without waiting
    outbox.close(timeout=0.5)
    link.close(timeout=0.1)


class _ListLink:
    def __init__(self):
        self.sent, self.resets = [], 0

    def send(self, msg):
        self.sent.append(msg)

    def reset(self):
        self.resets += 1

    def flush(self, timeout):
        return True

    def close(self):
        pass


def test_a_failure_on_the_outbox_thread_reaches_the_learner_at_once():
    """A failed transfer or encoding ended the outbox thread with a printed traceback only:
    every later offer, heartbeat and the Leave queued unsent, and the learner's last flush
    waited its full timeout (600 s) before the run ended as if nothing had happened."""

    def materialize(ticket, host, outer):
        if ticket == "bad":
            raise OSError("transfer failed")
        return ticket

    link = _ListLink()
    outbox = Outbox(link, materialize, to_host=lambda copies: copies)
    outbox.offer("bad", {})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="outbox failed: OSError: transfer failed"):
        outbox.flush(timeout=30.0)
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(RuntimeError, match="outbox failed"):
        outbox.send("heartbeat")
    outbox.close()
    assert link.sent == []


@pytest.mark.parametrize("fails", [False, True])
def test_an_offer_in_the_making_when_the_learner_crashes_never_leaves(fails):
    """`drop` (an emulated crash) emptied the queue but not the offer the thread was making
    (waiting for its bytes): it went out after the crash, under the dead life, and a round
    closing before the new life's Join merged it. `fails`: the dead life's copy fails as its
    device state goes, which is not the next life's outbox failing."""
    entered, release = threading.Event(), threading.Event()

    def to_host(copies):  # the device->host copy of the dead life's fragment
        entered.set()
        release.wait(10.0)
        if fails:
            raise RuntimeError("buffer deleted")
        return copies

    link = _ListLink()
    outbox = Outbox(link, lambda ticket, host, outer: ticket, to_host)
    outbox.offer("offer of life 0", {})
    assert entered.wait(10.0)
    outbox.drop()
    release.set()
    outbox.send("join of life 1")
    assert outbox.flush(timeout=10.0)
    assert link.sent == ["join of life 1"] and link.resets == 1
    outbox.close()
