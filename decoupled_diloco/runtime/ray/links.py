"""The transport over Ray: actor calls carry the messages, the object store their payloads.

Both ends reuse the in-process links (`runtime/links.py`) and only swap what is behind
their queues: a learner's sender thread delivers to `SyncerPoster`s (one per syncer shard)
instead of queues, and a syncer delivers replies to `LearnerMailboxes` instead of queues.
Payloads are `compression.Encoded` numpy arrays (never device arrays): Ray pickles them
out-of-band into its shared-memory object store, and a reply sent to M learners is put
there once.

Failures: actors are created with `max_task_retries=0`, so a call to a shard that Ray is
restarting fails at once with ActorUnavailableError (Ray does not queue it), as does a call
in flight when the process died. The poster holds such a message and retries it with the
next message (a heartbeat at the latest) or in `flush`: joins and leaves in order, only the
latest offer per fragment (a newer offer's parameters contain the older one's work) and the
latest heartbeat. The sender thread, not the learner, waits, and the restored syncer gets
the offers (offers anchored on versions of the syncer's lost life are rejected, see
`Offer.epoch`, until the learner has taken the restored syncer's snapshot). Meanwhile the
learner's later offers wait in its link's outbox as device copies, about one fragment per
step of the outage (not coalesced). ActorDiedError means the shard's restarts are
exhausted: the poster drops everything from then on. Replies to a learner that is down are
dropped, as in process.
"""

import contextlib
import pickle
import threading
import time

import numpy as np
import ray

from decoupled_diloco.diloco.messages import Heartbeat, Offer
from decoupled_diloco.diloco.transport import LearnerLink
from decoupled_diloco.runtime.links import LocalLearnerLink

_CALL_TIMEOUT_S = 10.0  # between checks on a call a busy shard has not answered yet


def actor_name(run_id: str, role: str, index: int, host: int = 0) -> str:
    """Name of a run's actor: role "learner" (host > 0: a non-leading host of its slice) or
    "syncer" (index = shard)."""
    return f"dd-{run_id}-{role}-{index}" + (f"-host{host}" if host else "")


def actor_handle(name: str, timeout: float = 120.0):
    """The named actor's handle; the driver creates every actor of a run before waiting on
    any, so a name can only be missing for a moment (or for good in a broken run)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(name)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class SyncerPoster:
    """A learner's delivery to one syncer shard (`.put`, called by its sender thread only)."""

    def __init__(self, name: str, retry_seconds: float = 0.5):
        self.name, self.retry_seconds = name, retry_seconds
        self._handle = None
        self._held: list = []  # undelivered, oldest first
        self.dead = False

    def put(self, msg) -> None:
        if self.dead:
            return
        self._hold(msg)
        self._deliver_held()

    def drain(self, timeout: float) -> bool:
        """Retries held messages for up to `timeout` s; True once nothing is held."""
        deadline = time.monotonic() + timeout
        while self._held and time.monotonic() < deadline:
            self._deliver_held()
            if self._held:
                time.sleep(self.retry_seconds)
        return not self._held

    def _hold(self, msg) -> None:
        if isinstance(msg, Offer):  # a newer offer of a fragment holds the older one's work
            older = [h for h in self._held if isinstance(h, Offer) and h.fragment == msg.fragment]
            for old in older:
                self._held.remove(old)
        elif isinstance(msg, Heartbeat):
            self._held = [h for h in self._held if not isinstance(h, Heartbeat)]
        self._held.append(msg)

    def _deliver_held(self) -> None:
        if self._handle is None:
            self._handle = actor_handle(self.name)
        while self._held:
            ref = self._handle.post.remote(self._held[0])
            try:
                while True:
                    try:
                        ray.get(ref, timeout=_CALL_TIMEOUT_S)
                        break
                    except ray.exceptions.GetTimeoutError:
                        pass  # accepted by a busy shard: wait, never post it twice
            except ray.exceptions.ActorUnavailableError:
                return  # the call failed: keep the message for the next attempt
            except ray.exceptions.ActorDiedError:
                self.dead, self._held = True, []
                return
            self._held.pop(0)


class RayLearnerLink(LocalLearnerLink):
    """A learner's end: the local link's sender thread, posting to syncer shard actors."""

    def __init__(self, learner: int, shard_names: list[str], link_seconds):
        self.posters = [SyncerPoster(n) for n in shard_names]
        super().__init__(
            learner, self.posters, lambda p: p % len(shard_names), link_seconds=link_seconds
        )

    def flush(self, timeout: float = 600.0) -> bool:
        """Waits until the sender thread has handed everything over and the shards have it,
        at most `timeout` s in all."""
        deadline = time.monotonic() + timeout
        if not super().flush(timeout):
            return False
        return all(p.drain(max(deadline - time.monotonic(), 0.0)) for p in self.posters)


class LearnerMailboxes:
    """The syncer's delivery to learner actors: `boxes[m].put(msg)` calls `deliver` on m."""

    def __init__(self, names: dict[int, str]):
        self._names = names
        self._handles: dict = {}
        self._lock = threading.Lock()
        self._last: tuple = (None, None)  # (message, its object ref): one put per broadcast
        self._inflight: list = []
        self.boxes = {m: _Box(self, m) for m in names}

    def deliver(self, m: int, msg) -> None:
        with self._lock:
            if m not in self._handles:
                self._handles[m] = actor_handle(self._names[m])
            if self._last[0] is not msg:
                self._last = (msg, ray.put(msg))
            self._inflight.append(self._handles[m].deliver.remote(self._last[1]))
            self._reap()

    def _reap(self) -> None:
        # Consume the outcome of finished calls: a learner that is down just misses replies.
        if not self._inflight:
            return
        done, self._inflight = ray.wait(self._inflight, num_returns=len(self._inflight), timeout=0)
        for ref in done:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(ref)


class _Box:
    def __init__(self, boxes: LearnerMailboxes, m: int):
        self._boxes, self._m = boxes, m

    def put(self, msg) -> None:
        self._boxes.deliver(self._m, msg)


MIN_BROADCAST_BYTES = 256  # the smallest padded payload of a slice's broadcast
_SIZE_BYTES = 8  # the payload's size, in front of it in a receive's first broadcast


class SliceLink(LearnerLink):
    """A learner spanning several hosts (multi-controller JAX): every host runs the same
    program, so every host must see the same messages at the same step boundaries.

    Host 0 owns the real link (`inner`); the others pass None and send nothing. Received
    messages are broadcast from host 0 inside the slice. (Offers are gathered to host
    memory on the learner thread, a collective every host must issue in the same order:
    the learner's outbox materialises inline.) Every decision a host takes by its own clock
    (a wait's end, a deadline, membership) is host 0's (`agree`). Tested with threads for
    hosts, and its broadcasts with two JAX processes on CPU (tests/test_multihost_learners.py),
    not on a multi-host TPU slice.
    """

    def __init__(self, inner: RayLearnerLink | None):
        self.inner = inner

    def send(self, msg) -> None:
        if self.inner is not None:
            self.inner.send(msg)

    def receive(self, timeout: float = 0.0) -> list:
        """Host 0's messages, on every host: one broadcast of MIN_BROADCAST_BYTES holding
        their size and, when they fit (most boundaries: none arrived), the messages; else a
        second one with the rest."""
        from jax.experimental import multihost_utils

        msgs = self.inner.receive(timeout) if self.inner is not None else []
        blob = np.frombuffer(pickle.dumps(msgs), np.uint8)
        first = np.zeros(MIN_BROADCAST_BYTES, np.uint8)
        first[:_SIZE_BYTES] = np.frombuffer(np.int64(blob.size).tobytes(), np.uint8)
        head = min(blob.size, MIN_BROADCAST_BYTES - _SIZE_BYTES)
        first[_SIZE_BYTES : _SIZE_BYTES + head] = blob[:head]
        first = np.asarray(multihost_utils.broadcast_one_to_all(first))
        size = int(np.frombuffer(first[:_SIZE_BYTES].tobytes(), np.int64)[0])
        head = min(size, MIN_BROADCAST_BYTES - _SIZE_BYTES)
        data = first[_SIZE_BYTES : _SIZE_BYTES + head]
        if size > head:
            # Each shape broadcast is a program compiled for it: the rest travels padded to
            # a power of two, so that a run compiles a few dozen, not one per message size.
            rest = size - head
            padded = np.zeros(max(MIN_BROADCAST_BYTES, 1 << (rest - 1).bit_length()), np.uint8)
            tail = blob[head:size]  # (host 0's; the others' are replaced by the broadcast)
            padded[: tail.size] = tail
            padded = np.asarray(multihost_utils.broadcast_one_to_all(padded))
            data = np.concatenate([data, padded[:rest]])
        return pickle.loads(data.tobytes())

    def agree(self, decision: bool) -> bool:
        """Host 0's decision, on every host (their clocks, and how long each took over its
        part of a save, differ: a loop one host left while another went round once more
        would leave that host's broadcast unmatched)."""
        from jax.experimental import multihost_utils

        return bool(multihost_utils.broadcast_one_to_all(np.bool_(decision)))

    def flush(self, timeout: float = 600.0) -> bool:
        return self.inner.flush(timeout) if self.inner is not None else True

    def reset(self) -> None:
        if self.inner is not None:
            self.inner.reset()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
