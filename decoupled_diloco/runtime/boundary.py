"""A learner's step boundary: the protocol (`diloco/learner.py`) meets its device replica.

Shared by every runtime's learner loop and by the tests' simulated learners (numpy
replicas). What the learner's own thread does here is bookkeeping and dispatch; the bytes
move elsewhere:
- offers leave as on-device fragment copies through the outbox, whose thread waits for
  the device->host transfer, computes the outer gradient and encodes it;
- a merged version that arrives is turned into its update x = Θ_new − G + v̂ on the
  `MergeStager`'s thread while the device keeps stepping (with `diloco.device_rebase`,
  on the learner's devices from Θ_new and v̂ placed there; else on the host, then placed),
  so the boundary that applies it only dispatches the on-device add (and, for a learner
  that never waits, applies it at a later boundary if it is not placed yet).
"""

import concurrent.futures
import functools
import threading
import time

from decoupled_diloco.diloco.learner import Learner
from decoupled_diloco.diloco.messages import Snapshot
from decoupled_diloco.diloco.updates import Update
from decoupled_diloco.runtime.outbox import Outbox

# A version first seen at the boundary that applies it is waited for when its placement is
# expected to end within this share of a step, or within the learner's slack
# (MergeStager.ready), else deferred.
WAIT_SHARE = 0.1

# The least a finished learner waits for its link to deliver its last messages (once they
# are materialised), even with `diloco.final_wait` spent or 0: time for a working link to
# deliver the final offers and the leave (a slow one is not waited for beyond it).
HANDOVER_S = 5.0


class MergeStager:
    """Computes updates ahead of the boundary that applies them, on one worker thread, and
    places their arrays on the replica's devices (`replica.place`).

    Keyed by `Update.key`: an update applied with the key of a staged one takes its device
    arrays (waiting for them if the worker is still busy: they are then at least as early
    as computing them here); any other update is computed at the boundary as before. A
    staged entry another version replaced is discarded unused.

    `ready` says whether a learner that never waits should apply an update now: yes once it
    is placed. One staged at an earlier boundary and still not placed is deferred (its
    placement took longer than a step). One staged at this very boundary (the version was
    first seen here; versions mostly arrive during the step before the one that applies
    them) is waited for only while that costs the device nothing or little: when the
    placements so far (`job_seconds`, a moving average of computing and placing one update)
    say it ends within the time the learner waits for its device each step anyway (`slack`,
    kept by its loop: the device is still busy with the steps queued ahead), or within
    `WAIT_SHARE` of a step, or nothing is known yet. Deferring those always made nearly
    every merge a step later where placing is quick; waiting for them always stalled the
    learner where it takes longer than a step (a `mid` fragment's ~23 MB of host math and
    transfer against a 10 ms accelerator step: decoupled / plain 0.61 with an emulated
    10 ms device on 2 CPU cores, 0.48 on the H200).
    """

    def __init__(self, replica, executor: concurrent.futures.Executor | None = None,
                 clock=time.perf_counter, device_rebase: bool = False):  # fmt: skip
        """`executor`: where updates are computed and placed (default: one worker thread);
        `clock`: what placements are timed with; `device_rebase` (`diloco.device_rebase`):
        rebases are computed on the replica's devices (see `_rebase`)."""
        self._replica, self._clock, self.device_rebase = replica, clock, device_rebase
        # Per fragment, (`Rebase.after_key`, device arrays) of the last Θ_new this stager
        # placed: the next rebase's G once that update is applied. One copy of the fragment
        # members per fragment in device memory (a version that supersedes it before it is
        # applied places its own G).
        self._anchors: dict[int, tuple[tuple, dict]] = {}
        self._life = 0  # bumped by `clear`: a job of an earlier life keeps nothing
        self._anchor_lock = threading.Lock()  # _anchors, _life (a job may run inside `stage`)
        self.rebases = 0  # rebases computed on the devices
        self.anchor_moves = 0  # of those, how many had to place G (not kept from before)
        self.offers_on_device = 0  # offers whose v = G − θ the devices computed (`anchor`)
        self._own_pool = executor is None  # `close` shuts down only a pool made here
        self._pool = executor or concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="stager"
        )
        # key -> (its computation and placement, the boundary it was staged at, when it is
        # expected to be placed: the worker runs one job at a time, in order)
        self._staged: dict[tuple, tuple[concurrent.futures.Future, int, float]] = {}
        self._tail = 0.0  # when the last job staged is expected to be placed
        self._boundary = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.job_seconds = 0.0  # moving average: computing and placing one update
        # Seconds per step the learner waits for its device anyway (set by its loop).
        self.slack = 0.0
        self._timing = threading.Lock()  # job_seconds (a job may run inside `stage`)

    def next_boundary(self) -> None:
        """A new step boundary begins (what is staged from now on is staged "here")."""
        self._boundary += 1

    def stage(self, updates: list[Update]) -> None:
        with self._lock:
            for u in updates:
                if u.key is None or u.key in self._staged:
                    continue
                # An older version of the same fragment will not be applied any more.
                for k in [k for k in self._staged if k[:2] == u.key[:2]]:
                    self._staged.pop(k)[0].cancel()
                future = self._pool.submit(self._place, u, self._life)
                with self._timing:
                    self._tail = max(self._tail, self._clock()) + self.job_seconds
                self._staged[u.key] = (future, self._boundary, self._tail)

    def _place(self, u: Update, life: int) -> dict | tuple[dict, dict]:
        t0 = self._clock()
        if self.device_rebase and u.rebase is not None:
            placed = self._rebase(u.rebase, life, land=u.kind == "land")
        elif u.kind == "land":
            placed = self._replica.place(u.arrays), self._replica.place(u.rebase.new_arrays())
        else:
            placed = self._replica.place(u.arrays)
        seconds = self._clock() - t0
        with self._timing:
            ema = 0.8 * self.job_seconds + 0.2 * seconds
            self.job_seconds = ema if self.job_seconds else seconds
        return placed

    def _rebase(self, r, life: int, land: bool = False) -> dict | tuple[dict, dict]:
        """x = Θ_new − G + v̂ computed on the devices: places Θ_new (and v̂ if the version
        holds our offer), takes G from the version placed before if it is that one (else
        places G too), and keeps Θ_new as the next rebase's G (`land`: returns (x, Θ_new),
        what `Replica.land` takes). The host does no arithmetic:
        on an H100 host the host rebase of a `mid` fragment (~23 MB, 3 reads and a write)
        took 20-31 ms of a 10.6 ms step (experiments/results/quality_targets_mid_h100/)."""
        p = r.anchor_key[0]
        anchor = self.anchor(r.anchor_key)
        if anchor is None:
            anchor = self._replica.place(r.anchor_arrays())
            self.anchor_moves += 1
        new = self._replica.place(r.new_arrays())
        sent = None if r.sent is None else self._replica.place(r.sent)
        x = self._replica.rebase_delta(new, anchor, sent)
        with self._anchor_lock:
            self.rebases += 1
            if life == self._life:
                self._anchors[p] = (r.after_key, new)
        return (x, new) if land else x

    def anchor(self, key: tuple) -> dict | None:
        """The device arrays of the version of Θ_p named `key` (`Rebase.anchor_key`,
        `InFlight.anchor_key`) if this stager placed it last for that fragment, else None."""
        with self._anchor_lock:
            named, arrays = self._anchors.get(key[0], (None, None))
        return arrays if named == key else None

    def ready(self, key: tuple, step_seconds: float = 0.0) -> bool:
        """Whether the update with this key can be applied now (`step_seconds`: the
        learner's time per step, 0 if unknown): True once it is on the devices, or if it was
        never staged (computed at the boundary); False while one staged at an earlier
        boundary is still being computed or placed; for one staged at this boundary, True
        if it is expected to be placed within the learner's `slack` or `WAIT_SHARE` of a
        step. See the class."""
        with self._lock:
            future, at, eta = self._staged.get(key, (None, None, 0.0))
        with self._timing:
            known = bool(self.job_seconds)
        if future is None or future.done():
            return True
        if at != self._boundary:
            return False
        if not known or not step_seconds:
            return True  # nothing to go by yet: as fast as computing it here
        # `eta` counts the jobs queued ahead of it (taking it waits for them too).
        return eta - self._clock() <= max(WAIT_SHARE * step_seconds, self.slack)

    def take(self, u: Update) -> dict | None:
        """Device arrays of `u` if it was staged, else None (compute it at the boundary)."""
        with self._lock:
            future = self._staged.pop(u.key, (None,))[0]
        if future is None:
            self.misses += 1
            return None
        self.hits += 1
        return future.result()

    def close(self) -> None:
        """Ends the worker thread once its current job is done (the stager's own; a pool
        passed in is the caller's to shut down); what is staged is dropped."""
        self.clear()
        if self._own_pool:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def clear(self) -> None:
        """The learner crashed or restarted: nothing staged for its old life applies (and
        its device queue, the slack, starts empty)."""
        with self._lock:
            for future, *_ in self._staged.values():
                future.cancel()
            self._staged.clear()
        with self._anchor_lock:
            self._anchors.clear()
            self._life += 1
        self.slack = 0.0


def apply_updates(replica, updates, stager: MergeStager | None = None) -> None:
    for u in updates:
        staged = stager.take(u) if stager is not None else None
        if u.kind == "land":
            x, new = staged if staged is not None else (u.arrays, u.rebase.new_arrays())
            replica.land(x, new, u.alpha)
        else:
            replica.apply(u.kind, staged if staged is not None else u.arrays, u.alpha)


def handle(proto: Learner, replica, msgs: list, stager: MergeStager | None = None) -> None:
    """Arrived messages: a restored syncer's snapshot is applied at once; versions that
    will be applied later start staging."""
    apply_updates(replica, proto.handle(msgs))
    if stager is not None:
        if any(isinstance(m, Snapshot) for m in msgs):
            stager.clear()  # what was staged for the lost syncer life is never applied
        stager.stage(proto.upcoming())


def offer_and_receive(proto: Learner, replica, outbox: Outbox, receive, stager=None) -> None:
    """First half of a step boundary: offers due now leave through the outbox (as device
    copies), and what arrived is handled (a restored syncer's snapshot applied at once)."""
    if stager is not None:
        stager.next_boundary()
    # Offer first: with tau = 0 a fragment offered at step t is applied at boundary t.
    for ticket in proto.due_offers():
        names = proto.plan.names[ticket.fragment]
        device = stager is not None and stager.device_rebase
        anchor = stager.anchor(ticket.anchor_key) if device else None
        if anchor is not None:  # v = G − θ on the devices, from the G the stager kept
            outbox.offer(ticket, replica.outer_gradient(names, anchor), outer=True)
            stager.offers_on_device += 1
        else:
            outbox.offer(ticket, replica.fragment_copies(names))
    handle(proto, replica, receive(0.0), stager)


def apply_and_beat(proto: Learner, replica, outbox: Outbox, stager=None,
                   defer: bool = True) -> None:  # fmt: skip
    """Second half, after any wait for late merges: due merges are applied, a heartbeat
    goes out when one is due. A learner that never waits (`diloco.max_wait` 0) does not
    wait for the stager either: a rebase still being placed is applied at a later boundary
    (`Learner.apply_due`), so the device keeps its queue of steps. `defer=False`: wait
    (a multi-host learner, whose hosts must apply the same updates at the same boundary,
    and whose stagers finish at different times)."""
    never_waits = defer and stager is not None and proto.cfg.wait_seconds == 0
    ready = (
        functools.partial(stager.ready, step_seconds=proto.step_seconds) if never_waits else None
    )
    apply_updates(replica, proto.apply_due(ready=ready), stager)
    beat(proto, outbox)


def beat(proto: Learner, outbox: Outbox) -> None:
    """Sends a heartbeat if one is due (at once after a restart or a resync)."""
    heartbeat = proto.heartbeat()
    if heartbeat is not None:
        outbox.send(heartbeat)


def step_boundary(proto: Learner, replica, outbox: Outbox, receive, clock, stager=None,
                  defer: bool = True, stopping=None, agree=bool) -> float:  # fmt: skip
    """A step boundary; waits up to `diloco.max_wait` for merges of offers past s + τ
    (`defer`: see `apply_and_beat`), heartbeating meanwhile (a learner waiting longer
    than `diloco.heartbeat_timeout` for a round is alive, and its offers stay valid);
    `stopping()` true ends the wait (the run is interrupted: the learner goes on to its
    final offers and leaves, so no round waits for it). `agree`: the link's
    (`LearnerLink.agree`; the hosts of a learner go round the wait alike). Returns the
    seconds spent waiting."""
    offer_and_receive(proto, replica, outbox, receive, stager)
    waited, limit = 0.0, proto.cfg.wait_seconds
    if limit > 0 and proto.unresolved():
        # Steps are dispatched asynchronously: finish our own first, so that the wait
        # below is time the device really idles, not this step's compute.
        replica.ready()
        start = clock()
        while agree(
            proto.unresolved()
            and clock() - start < limit
            and not (stopping is not None and stopping())
        ):
            handle(proto, replica, receive(max(min(limit - (clock() - start), 1.0), 0.0)),
                   stager)  # fmt: skip
            beat(proto, outbox)
        waited = clock() - start
    apply_and_beat(proto, replica, outbox, stager, defer)
    return waited


def final_offers(proto: Learner, replica, outbox: Outbox) -> None:
    """Offers every fragment's unmerged work that no offer in flight may hold yet."""
    for ticket in proto.due_offers(final=True):
        outbox.offer(ticket, replica.fragment_copies(proto.plan.names[ticket.fragment]))


def finish(proto: Learner, replica, outbox: Outbox, receive, clock, finished: bool = True,
           offer_work: bool = True, on_left=None, bounded: bool = True,
           agree=bool) -> bool:  # fmt: skip
    """Training is over (`finished`: the step budget is done; else the learner leaves the
    membership). With `diloco.final_sync` every step of its work reaches Θ: it offers all
    unmerged work, leaves (so rounds no longer wait for it), and as each offer still in
    flight resolves (waiting up to `diloco.final_wait`), offers the steps taken after it
    (a refused one again, after its retry wait). `offer_work=False` (its last steps
    diverged): it leaves, offering nothing, and waits only for the offers in flight to
    resolve (the caller counts what they did not bring); none of its unmerged work may reach
    Θ. `on_left()` runs
    once the final offers and the leave are on their way (the learner's last checkpoint:
    saved while they travel, not before them, which held up the others' rounds).

    Returns whether every message reached the link's far end: `bounded`, what is left of
    `diloco.final_wait` (after `on_left`), though never less than `HANDOVER_S`, also bounds
    the wait for the link to deliver them once they are materialised (a link too slow for
    its offers held a run for minutes past final_wait); what is still on its way is left to
    the link. Not `bounded` (a learner leaving the membership, whose outbox is dropped
    next): the outbox's own flush timeout. `agree`: as for `step_boundary` (each host's
    save in `on_left` takes its own time, and so would its deadline)."""
    cfg = proto.cfg
    sync = cfg.final_sync and offer_work
    # (not offering its work, it still waits for the offers in flight, which say whether
    # their steps reached Θ)
    settle = cfg.final_sync
    # A merge deferred at the last boundary (not yet placed) first: it resolves the offer it
    # holds, so the final offers below carry the steps after it.
    apply_updates(replica, proto.apply_due(final=True))
    if sync:
        final_offers(proto, replica, outbox)
    outbox.send(proto.leave(finished))
    if on_left is not None:
        on_left()
    lives = proto.resyncs
    deadline = clock() + cfg.final_wait
    while agree(settle and (proto.in_flight() or (sync and proto.retrying()))
                and clock() < deadline):  # fmt: skip
        apply_updates(replica, proto.handle(receive(0.2)))
        if proto.resyncs != lives:
            # A restored syncer: its checkpoint may predate our Leave, and the offers we
            # make it now would confirm us as live (rounds would wait for us): leave again.
            # It may also predate our (re)join: the heartbeat first makes it admit this life
            # (registry.py), else it refuses our Leave and offers as another incarnation's.
            beat(proto, outbox)
            outbox.send(proto.leave(finished))
            lives = proto.resyncs
        else:
            # The syncer may be a restored life that knows no learner (its checkpoint
            # predates everyone, or there was none): it announces itself to nobody, our
            # offers died with its predecessor or are refused as from an unknown learner, and
            # nothing would resolve them before final_wait. A heartbeat (every
            # diloco.heartbeat_every) is taken as our join there, answered with its snapshot
            # (handled above); a syncer that knows us only notes that we wait.
            beat(proto, outbox)
        apply_updates(replica, proto.apply_due(final=True))
        if sync:
            final_offers(proto, replica, outbox)
    if not settle:
        apply_updates(replica, proto.handle(receive(0.0)))
        apply_updates(replica, proto.apply_due(final=True))
    if not bounded:
        return outbox.flush()
    return outbox.flush(deliver_timeout=max(deadline - clock(), HANDOVER_S))
