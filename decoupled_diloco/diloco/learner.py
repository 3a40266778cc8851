"""The learner protocol: what a learner offers, when, and how it applies merged fragments.

Numpy only: no devices, threads or transports. A runtime's learner loop drives it next to
the learner's device replica (`train/replica.py`): after every inner step `stepped`, then
`due_offers` (whose fragment copies the loop turns into `Offer`s with `materialize`, on
another thread),
`handle` for what arrived, and `apply_due`, whose updates the replica applies on device.

Bookkeeping per fragment p. The learner keeps G_p, a host copy of the last version of Θ_p
it applied, and the invariant θ_p = G_p + W_p, where W_p is all its work on p that no
version it knows of holds; c_steps/c_tokens count the steps and tokens in W_p. An offer
sends v = G_p − θ_p = −W_p, so every step of work travels in an offer until a version holds
it. At most one offer per fragment is in flight: a fragment that falls due meanwhile is
offered as soon as the earlier offer is resolved (merged or dropped), so no two offers
hold the same step and no reply delay can make the syncer merge a step twice.

Applying version Θ_new (decided by the version's vector clock, see messages.py):
  "rebase" (default): if Θ_new holds our offer from step s, θ ← Θ_new + (θ − θ_s): the
      steps since s survive (and, with lossy offers, what the syncer did not receive: error
      feedback), and their counters stay. If it holds none of our work, θ ← θ + (Θ_new −
      G): all of W moves onto the new global fragment. The merge is applied at the first
      step boundary ≥ s + τ (a merge without our offer at once). With τ = 0 and every
      learner in every merge (DiLoCo) this is exactly the overwrite.
  "land": the rebase's bookkeeping, the overwrite's position. If Θ_new holds our offer from
      step s, θ ← α·θ + (1 − α)·Θ_new, and the steps since s wait aside, on the devices (the
      replica's `held` R_p ← R_p + (1 − α)·(θ − φ_s), φ_s = θ_s + R_p the point offered),
      until our next offer of p sends them: offers copy φ = θ + R (and the bookkeeping above
      is φ's). φ follows the rebase (up to float32 rounding of 1 − α), so no step is lost or
      merged twice, and the counters are the rebase's; only where the learner trains from
      differs. The steps a learner takes while its offer is in flight continue its own drift
      from a point the merge then averages away; carried on top of the merge they pull it
      apart from the others again: at the tiny CPU scale, inner lr 0.036, the decoupled arm
      ended 1.045x synchronous streaming rebasing and 1.024x landing
      (experiments/results/apply_land/). A version without our offer is a rebase (R_p
      stays).
  "overwrite" (Streaming DiLoCo): θ ← α·θ + (1 − α)·Θ_new at the first boundary ≥ s + τ
      of our offer in flight; merging our offer resets the counters, so the α-discarded
      work is not counted as merged.
`alpha` also mixes rebases: θ ← θ + (1 − α)·δ.

A restored syncer announces its new life with a Snapshot. The learner rebases on it like on
a merge: θ ← θ + (Θ_restored − G) (plus our offer if the restored clock holds it; with
"overwrite", a Θ_restored that holds our offer is overwritten onto, as the merge was). The
global progress the syncer lost leaves the learner too, and only its own unmerged work is
offered again: nothing is replayed through the outer optimizer. A Snapshot of the life the
learner already follows (a Join its link retried across a restore, answered late) is only
a version of each fragment, applied like a merge: newer than ours, or ignored.

A refused offer (`Dropped`) leaves its work in W, to be offered again. The first retry
goes at the next step boundary; after the k-th refusal in a row the fragment sits out
2^(k−2) boundaries (at most H) first, so a learner whose offers the syncer keeps refusing (a
fragment it holds to be off-scale, say) does not flood it, least of all during the final
sync, where each round of its loop waits for replies instead of steps. The wait counts
boundaries, not seconds, so every host of a multi-host learner decides alike; while it
waits, each boundary tells the syncer our step (a heartbeat), so the retry is not taken for
an offer from the future. A merge of the fragment's offer resets the count.

Inner AdamW state is kept when merges are applied (it lives in the replica).
"""

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from decoupled_diloco.diloco import compression
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragment_members import join_members
from decoupled_diloco.diloco.fragments import FragmentPlan
from decoupled_diloco.diloco.messages import (
    Dropped,
    Heartbeat,
    Join,
    Leave,
    Merged,
    Offer,
    Snapshot,
)
from decoupled_diloco.diloco.updates import Decoded, Rebase, Update, rebase_delta, resolve

# Boundaries in a row a rebase may wait for its update to be placed on the devices
# (`apply_due`'s `ready`) before the learner waits for it instead.
DEFER_LIMIT = 4


@dataclasses.dataclass
class InFlight:
    """An offer not resolved yet (neither held by a version we know of, nor dropped)."""

    fragment: int
    step: int
    c_steps: int
    c_tokens: int
    anchor: dict | Decoded  # G_p when the offer was made (the outer gradient's reference)
    envelope: Offer  # the message without its payload
    method: str  # wire compression of the outer gradient
    keep: bool  # keep v as the syncer decodes it (`sent`): rebasing subtracts it later
    # Names `anchor` like `Rebase.anchor_key` (fragment, incarnation, epoch, anchor count,
    # version): a runtime holding G on the devices under this name may compute v there.
    anchor_key: tuple
    sent: dict | None = None  # set by `materialize`


@dataclasses.dataclass
class _Fragment:
    anchor: dict | Decoded  # G_p
    version: int = 0
    epoch: int = 0
    c_steps: int = 0
    c_tokens: int = 0
    in_flight: InFlight | None = None
    wanted: bool = False  # due while an offer was in flight: offer when it resolves
    arrived: Merged | None = None  # the newest version received and not applied yet
    anchored: int = 0  # bumped whenever `anchor` is replaced (names it in Update keys)
    refused: int = 0  # offers of this fragment refused in a row (`Dropped`)
    deferred: int = 0  # boundaries in a row its arrived version was not ready to apply
    sit_out: int = 0  # boundaries to let pass before it is offered again (after refusals)
    # Our newest step a version of Θ_p we received held (in any syncer life: a restore that
    # rolls it back does not lower it, the rollback's own count has those steps).
    merged_through: int = 0


def materialize(ticket: InFlight, local: dict[str, np.ndarray], outer: bool = False) -> Offer:
    """The wire offer of `ticket` from the host copy of θ_p at its step: v = G_p − θ_p,
    encoded (`outer`: `local` is v itself, computed on the devices from the G that
    `ticket.anchor_key` names: the same float32 subtraction, but XLA may flush subnormals).

    Touches nothing but `ticket.sent`, so it may run on another thread than the protocol
    (the anchor it reads is never modified in place).
    """
    if outer:
        v = {k: np.asarray(x, np.float32) for k, x in local.items()}
    else:
        anchor = resolve(ticket.anchor)
        v = {k: np.subtract(anchor[k], local[k], dtype=np.float32) for k in anchor}
    encoded = compression.encode(v, ticket.method, copy=False)  # v is never written again
    if ticket.keep:
        ticket.sent = v if ticket.method == "none" else compression.decode(encoded)
    return dataclasses.replace(ticket.envelope, payload=encoded, nbytes=encoded.nbytes())


class Learner:
    """Learner m's side of the DiLoCo protocol (see the module docstring)."""

    def __init__(
        self,
        learner_id: int,
        cfg: DilocoConfig,
        plan: FragmentPlan,
        tokens_per_step: int,
        clock: Callable[[], float],
        incarnation: int = 0,
        step: int = 0,
    ):
        self.id, self.cfg, self.plan, self.clock = learner_id, cfg, plan, clock
        self.tokens_per_step, self.incarnation, self.step = tokens_per_step, incarnation, step
        self.frags: list[_Fragment] = []
        self.started = False
        self.applied_merges = 0
        self.resyncs = 0  # snapshots of a new syncer life applied (restores seen)
        # (fragment, lo, hi): our steps (lo, hi] that versions we received held and a syncer
        # restore rolled back (the run counts them as `syncer_lost_steps`)
        self.rolled_back: list[tuple[int, int, int]] = []
        self.deferrals = 0  # boundaries at which an arrived merge waited for its placement
        # Round trips of our offers: steps from an offer to the boundary that applied the
        # first version holding it (sum, count), τ at best; past H they merge less often.
        self.delay_steps, self.delays = 0, 0
        self.step_seconds = 0.0  # moving average of seconds per step, sent in heartbeats
        self._last_step_at: float | None = None
        self.timed_intervals = 0  # step intervals measured since the last (re)start
        self._last_heartbeat = -math.inf

    # --- joining -----------------------------------------------------------------------
    def join(self) -> Join:
        return Join(self.id, self.incarnation, self.clock(), self.step, self.tokens_per_step)

    def start(self, snapshots: list[Snapshot]) -> dict[str, np.ndarray]:
        """Takes the syncer's snapshots (one per shard, covering every fragment) as G and
        returns the parameters to start from (whole leaves): the global model, counters at
        zero."""
        params = {}
        self.frags = [None] * self.plan.num_fragments
        for snap in snapshots:
            params.update(snap.params)
            for p, version in snap.versions.items():
                anchor = {k: snap.params[k] for k in self.plan.names[p]}
                self.frags[p] = _Fragment(anchor, int(version), snap.epoch)
        missing = [p for p, f in enumerate(self.frags) if f is None]
        if missing:
            raise ValueError(f"learner {self.id}: no snapshot of fragments {missing}")
        self.started = True
        self._last_heartbeat = -math.inf
        return join_members(params)  # whole leaves (the embedding may come in row slices)

    @staticmethod
    def covered(snapshots: list[Snapshot]) -> set[int]:
        return {p for s in snapshots for p in s.versions}

    # --- steps -------------------------------------------------------------------------
    def stepped(self) -> None:
        """One inner step of `tokens_per_step` tokens is done (work on every fragment)."""
        now = self.clock()
        if self._last_step_at is not None:
            # The first interval after a (re)start holds the step's compilation: seconds
            # where a step takes milliseconds, which would inflate the syncer's grace window.
            if self.timed_intervals > 0:
                dt = now - self._last_step_at
                ema = 0.8 * self.step_seconds + 0.2 * dt
                self.step_seconds = dt if self.step_seconds == 0 else ema
            self.timed_intervals += 1
        self._last_step_at = now
        self.step += 1
        for f in self.frags:
            f.c_steps += 1
            f.c_tokens += self.tokens_per_step

    def due_offers(self, final: bool = False) -> list[InFlight]:
        """Offers to make at this step boundary: fragments due now (or due earlier while an
        offer was in flight) with unmerged work; `final`: every fragment with work."""
        for p in self.plan.due(self.step):
            self.frags[p].wanted = True
            if self.frags[p].in_flight is not None:
                # The offer waits for its earlier one: tell the syncer our step now, which
                # makes the earlier one count for the slot we reached (syncer.slot).
                self._last_heartbeat = -math.inf
        out = []
        for p, f in enumerate(self.frags):
            if not (f.wanted or final) or f.in_flight is not None:
                continue
            if f.sit_out > 0 and f.c_steps:  # backing off after refusals (module docstring)
                f.sit_out -= 1
                self._last_heartbeat = -math.inf
                continue
            f.wanted = False
            if f.c_steps == 0:
                continue
            envelope = Offer(
                learner=self.id,
                incarnation=self.incarnation,
                fragment=p,
                step=self.step,
                c_steps=f.c_steps,
                c_tokens=f.c_tokens,
                base_version=f.version,
                time=self.clock(),
                epoch=f.epoch,
            )
            keep = self.cfg.apply in ("rebase", "land")
            f.in_flight = InFlight(
                p, self.step, f.c_steps, f.c_tokens, f.anchor, envelope, self.cfg.compression, keep,
                (p, self.incarnation, f.epoch, f.anchored, f.version),
            )  # fmt: skip
            out.append(f.in_flight)
        return out

    # --- messages from the syncer ------------------------------------------------------
    def handle(self, msgs: list) -> list[Update]:
        """Stores arrived versions and drops; a Snapshot of a restored syncer is applied at
        once (returned updates), one of the syncer life we know is a version like a merge's.
        Messages of lost syncer lives and old versions are ignored."""
        updates = []
        for msg in msgs:
            if isinstance(msg, Merged):
                self._arrive(msg)
            elif isinstance(msg, Dropped):
                f = self.frags[msg.fragment]
                t = f.in_flight
                # Ours, and of the syncer life it was made in: a drop of an offer to a lost
                # life may arrive after we offered that work again, at the same step.
                ours = (msg.step, msg.incarnation, msg.epoch)
                # A version that arrived holding it outranks the drop (a retrying link or a
                # router may refuse a copy of an offer the syncer merged): applied at s + τ,
                # it takes the offer's work out of W; offered again, it would count twice.
                held = f.arrived is not None and self._holds(f.arrived.merged, t)
                if t is not None and not held and ours == (t.step, self.incarnation,
                                                           t.envelope.epoch):  # fmt: skip
                    f.in_flight, f.wanted = None, True  # its work is still in W: offer again
                    f.refused += 1
                    if f.refused > 1:
                        cap = max(self.plan.sync_every, 1)
                        f.sit_out = min(2 ** min(f.refused - 2, cap.bit_length()), cap)
            elif isinstance(msg, Snapshot):
                updates += self._resync(msg)
        return updates

    def _arrive(self, msg: Merged) -> None:
        f = self.frags[msg.fragment]
        newest = f.arrived.version if f.arrived is not None else f.version
        if msg.epoch == f.epoch and msg.version > newest:
            f.arrived = msg
            # Θ_p holds our work up to there from now, though it is applied at s + τ.
            inc, step = msg.merged.get(self.id, msg.merged.get(str(self.id), (-1, -1)))
            if inc == self.incarnation:
                f.merged_through = max(f.merged_through, int(step))

    def _holds(self, clock: dict, t: InFlight | None) -> bool:
        """Does a version with vector clock `clock` hold our offer `t`?"""
        if t is None:
            return False
        inc, step = clock.get(self.id, clock.get(str(self.id), (-1, -1)))
        return inc == self.incarnation and step >= t.step

    def _resync(self, snap: Snapshot) -> list[Update]:
        out = []
        for p, version in snap.versions.items():
            f = self.frags[p]
            theta = {k: snap.params[k] for k in self.plan.names[p]}
            if snap.epoch == f.epoch:
                # The life we know: the reply to a Join it got late (a link retrying it
                # across a syncer restore). Not a new life, just a version of Θ_p with its
                # clock, like a merge's: a resync would forget an offer in flight that a
                # later version holds, and offer its steps again.
                payload = compression.encode(theta, "none")
                clock = snap.merged.get(p, {})
                self._arrive(Merged(p, int(version), payload, (), snap.time, epoch=snap.epoch,
                                    merged=clock))  # fmt: skip
                continue
            clock = snap.merged.get(p, {})
            kept = int(clock.get(self.id, clock.get(str(self.id), (-1, 0)))[1])
            if f.merged_through > kept:  # versions holding steps up to there are gone
                self.rolled_back.append((p, kept, f.merged_through))
            held = self._holds(clock, f.in_flight)
            if held and self.cfg.apply == "overwrite":
                # Θ_restored holds our offer: overwrite onto it, as onto the merge the lost
                # life sent (a rebase would keep the offer's steps in θ on top of it, and our
                # next offer, counted from zero, would merge them a second time).
                out.append(Update("mix", theta, self.cfg.alpha))
                f.c_steps = f.c_tokens = 0
                f.merged_through = max(f.merged_through, f.in_flight.step)
                f.in_flight = None
            else:
                sent = f.in_flight.sent if held else None
                delta = rebase_delta(resolve(f.anchor), theta, sent, self.cfg.merge_threads)
                out.append(Update("add", delta))
                if held:
                    self._consume(f)
            # Offers in flight to the lost life die with it; their work is still in W.
            f.in_flight, f.wanted, f.arrived = None, f.wanted or f.in_flight is not None, None
            f.anchor, f.version, f.epoch = theta, int(version), snap.epoch
            f.anchored += 1
            f.refused = f.sit_out = 0  # refusals of the lost life say nothing
            f.deferred = 0
        self._last_heartbeat = -math.inf  # tell the new life our step at once
        self.resyncs += bool(out)
        return out

    # --- applying merges ---------------------------------------------------------------
    def unresolved(self) -> list[int]:
        """Fragments whose offer in flight is past s + τ with no version holding it here."""
        tau = self.cfg.overlap
        out = []
        for p, f in enumerate(self.frags):
            t = f.in_flight
            if t is None or self.step < t.step + tau:
                continue
            if f.arrived is None or not self._holds(f.arrived.merged, t):
                out.append(p)
        return out

    def apply_due(self, final: bool = False, ready=None) -> list[Update]:
        """Updates for every arrived version that may be applied at this boundary (`final`:
        training is over, so the τ overlap steps no longer exist).

        `ready(key) -> bool` (optional): whether the update with this `Update.key` can be
        applied without waiting (a runtime still placing it on the devices says no). A
        rebase that is not ready waits for a later boundary, where it is just as exact (its
        δ does not depend on θ), at most DEFER_LIMIT boundaries in a row; then it is
        applied, waiting (so is a landing: the steps it sets aside are as exact later).
        Overwrites are never deferred: they discard the steps since their offer, and a
        later boundary would discard more."""
        out = []
        tau = 0 if final else self.cfg.overlap
        for p, f, msg, t, held in self._arrived():
            waits = held or (t is not None and self.cfg.apply == "overwrite")
            if waits and self.step < t.step + tau:
                continue
            # θ = θ_s (rebase at the offer's own step): the result is Θ_new itself, exactly.
            exact = held and self.step == t.step and self.cfg.compression == "none"
            update = self._update(p, f, msg, held, exact)
            deferable = ready is not None and not final and update.kind in ("add", "land")
            if deferable and f.deferred < DEFER_LIMIT and not ready(update.key):
                f.deferred += 1
                self.deferrals += 1
                continue
            f.deferred = 0
            out.append(update)
            if held and self.cfg.apply == "overwrite":
                f.c_steps = f.c_tokens = 0
                f.merged_through = max(f.merged_through, t.step)
                f.in_flight, f.refused, f.sit_out = None, 0, 0
            elif held:
                self._consume(f)
            if held:
                self.delay_steps += self.step - t.step
                self.delays += 1
            f.anchor, f.version, f.arrived = Decoded(msg.payload), msg.version, None
            f.anchored += 1
            self.applied_merges += 1
        return out

    def upcoming(self) -> list[Update]:
        """The updates the versions that arrived will most likely become, computable now
        (their keys match `apply_due`'s unless something changes first: a newer version, a
        restored syncer, or the exact-rebase case)."""
        out = []
        for p, f, msg, t, held in self._arrived():
            if held and t.keep and t.sent is None:
                continue  # not materialised yet (cannot be merged yet either)
            out.append(self._update(p, f, msg, held, exact=False))
        return out

    def _arrived(self):
        """(p, fragment, version arrived, offer in flight, whether the version holds it) for
        every fragment with a version not applied yet."""
        for p, f in enumerate(self.frags):
            if f.arrived is not None:
                yield p, f, f.arrived, f.in_flight, self._holds(f.arrived.merged, f.in_flight)

    @staticmethod
    def update_kinds(cfg: DilocoConfig, training: bool = False) -> tuple[str, ...]:
        """The kinds of Update this configuration's learners can apply: "add" (rebases, and
        the resync onto a restored syncer's snapshot whatever `apply` is), "land" (merges
        of our offer with `apply` "land"), "mix" (`_update`: overwrites, and exact rebases,
        which need uncompressed offers). `training`: only those of the steps, not of the
        final sync, where exact rebases need τ = 0 (a merge applied at its offer's own
        step)."""
        if cfg.apply == "land":
            return ("add", "land")
        exact = cfg.compression == "none" and (cfg.overlap == 0 or not training)
        return ("add", "mix") if cfg.apply == "overwrite" or exact else ("add",)

    def _update(self, p: int, f: _Fragment, msg: Merged, held: bool, exact: bool) -> Update:
        """The Update applying version `msg` to fragment `f`; captures what it reads, so
        `arrays` may be computed later, on another thread."""
        apply = self.cfg.apply
        # A landing sets θ to Θ_new (exactly) whether or not steps came since the offer.
        mix = apply == "overwrite" or (exact and apply == "rebase")
        key = (p, msg.epoch, msg.version, self.incarnation, f.anchored, held, mix)
        payload = msg.payload
        if mix:
            return Update("mix", lambda: compression.decode(payload), self.cfg.alpha, key)
        anchor, sent = f.anchor, (f.in_flight.sent if held else None)
        threads = self.cfg.merge_threads

        def delta():
            return rebase_delta(resolve(anchor), compression.decode(payload), sent, threads)

        inc = self.incarnation
        parts = Rebase(payload, anchor, sent, (p, inc, f.epoch, f.anchored, f.version),
                       (p, inc, msg.epoch, f.anchored + 1, msg.version))  # fmt: skip
        # Mixing scales δ by 1 − α; the replica does it with the add (no host pass).
        kind = "land" if held and apply == "land" else "add"
        return Update(kind, delta, self.cfg.alpha, key, rebase=parts)

    def _consume(self, f: _Fragment) -> None:
        t = f.in_flight
        f.c_steps -= t.c_steps
        f.c_tokens -= t.c_tokens
        f.merged_through = max(f.merged_through, t.step)
        f.in_flight = None
        f.refused = f.sit_out = 0

    # --- liveness ----------------------------------------------------------------------
    def heartbeat(self) -> Heartbeat | None:
        now = self.clock()
        if now - self._last_heartbeat < self.cfg.heartbeat_every:
            return None
        self._last_heartbeat = now
        return Heartbeat(self.id, self.incarnation, self.step, self.step_seconds, now)

    def leave(self, finished: bool) -> Leave:
        return Leave(self.id, self.incarnation, self.clock(), finished)

    def merged_through(self) -> list[int]:
        """Per fragment, our newest step a version of Θ_p we received held, in this syncer
        life or a lost one (0: none yet)."""
        return [f.merged_through for f in self.frags]

    def in_flight(self) -> list[int]:
        """Fragments with an offer in flight."""
        return [p for p, f in enumerate(self.frags) if f.in_flight is not None]

    def retrying(self) -> list[int]:
        """Fragments whose unmerged work was refused and is not offered again yet."""
        return [p for p, f in enumerate(self.frags)
                if f.in_flight is None and f.c_steps and f.refused]  # fmt: skip

    def unmerged_steps(self) -> list[int]:
        """Per fragment: steps of work no version known here holds (in flight included)."""
        return [f.c_steps for f in self.frags]
