"""The syncer: quorum, adaptive grace window, weighted RDA merge, outer step, replies.

Pure logic driven by its runtime: `handle(msg, now)` and `tick(now)` return the messages to
send, `next_deadline()` says when `tick` must run again. No threads, queues or sockets here,
so the same object runs in-process, in a Ray actor, or under a fake clock in tests.

Offers carry outer gradients v_m = Θ_p^(base) − θ_m,p, all of the learner's work on p that
no version holds (diloco/learner.py): the syncer keeps no history of Θ, and every step
reaches it in exactly one merged offer (an offer holding merged work is rejected).

Rounds follow the fragment schedule ("scheduled"): an offer made at step offset_p + r·H
belongs to slot r. A round closes when K offers of a slot not covered yet ("fresh") are in
and the grace window has passed (or every live learner has an offer in), merges every
pending offer, and covers the K-th highest fresh slot: rounds go at the pace of the K-th
fastest learner. Late offers ride along with the next round, or close a catch-up round
once every live learner the last round missed has offered.

Each merge's outer gradient is weighted by the share of the roster it holds (the live
learners whose work reaches Θ: registry.py; `merge.weigh`, normalize = "roster") and the
outer momentum advances by the rounds of work it carries (`outer.py`), so partial and late
merges add up to what synchronous rounds do.

A merge sends the new version with the fragment's vector clock (messages.py): whether it
holds each learner's offer. An offer that will never be merged (rejected, stale, its
learner timed out) is answered with `Dropped`: the learner keeps the work for its next one.
A merged offer delivered again is dropped unanswered (the version that holds it answers).

Trust no message: every one is validated before it changes anything (offer_checks.py,
message_checks.py, registry.py), an offer's size is held against the recent offers' scale
(offer_scale.py), and whatever is refused is logged and counted (refusals.py), never raised.

Every life of a syncer has an `epoch` (a restored syncer gets a new one): it re-creates
version numbers its lost life had used, so offers anchored in a lost life are dropped (the
learner rebases on the new life's snapshot and offers its unmerged work again).
"""

import time as _time
from collections.abc import Callable

import numpy as np

from decoupled_diloco.diloco import compression, merge, refusals, rounds, syncer_state
from decoupled_diloco.diloco import offer_checks as checks
from decoupled_diloco.diloco.chunks import Scratch
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragments import FragmentPlan
from decoupled_diloco.diloco.grace import GraceWindow
from decoupled_diloco.diloco.message_checks import check_message
from decoupled_diloco.diloco.messages import Join, Leave, Merged, Offer, Snapshot, plain
from decoupled_diloco.diloco.offer_checks import Reason, RunBounds
from decoupled_diloco.diloco.offer_scale import OfferScale
from decoupled_diloco.diloco.registry import Registry
from decoupled_diloco.diloco.reply_buffers import ReplyBuffers


class Syncer:
    """Owns the global fragments `fragments` (all of them unless the syncer is sharded).
    `bounds`: what the run's config makes plausible for a learner's reports."""

    def __init__(
        self,
        cfg: DilocoConfig,
        plan: FragmentPlan,
        params: dict[str, np.ndarray],
        fragments: list[int] | None = None,
        record: Callable[[dict], None] | None = None,
        epoch: int = 0,
        bounds: RunBounds | None = None,
    ):
        self.cfg, self.plan, self.num_learners = cfg, plan, cfg.learners
        self.bounds = bounds or RunBounds()
        self.epoch = epoch  # this life of the syncer (a restored syncer gets a new one)
        self.owned = list(range(plan.num_fragments)) if fragments is None else list(fragments)
        self._emit = record or (lambda r: None)
        self.log_position = 0  # records emitted (merges and events), across restores
        parts = plan.split({k: np.asarray(v, np.float32) for k, v in params.items()})
        self.theta = {p: {k: v.copy() for k, v in parts[p].items()} for p in self.owned}
        self.outer = {p: merge.OuterState.zeros(self.theta[p]) for p in self.owned}
        self.version = {p: 0 for p in self.owned}
        self.last_slot = {p: -1 for p in self.owned}  # the slot the last round covered
        # fragment -> learner -> (incarnation, step, version) of its latest merged offer
        self.merged_into: dict[int, dict[int, tuple[int, int, int]]] = {p: {} for p in self.owned}
        # learner -> the slot its latest merged offer stood for (rounds.offer_slot at the
        # merge: its reported step counts), against which `last_slot` was covered; -1 once
        # a new life of it joined (that life has reached no slot yet)
        self.merged_slot: dict[int, dict[int, int]] = {p: {} for p in self.owned}
        # fragment -> learner -> (offer, decoded outer gradient, its per-leaf ‖v‖²)
        self.pending: dict[int, dict[int, tuple[Offer, dict, dict]]] = {p: {} for p in self.owned}
        self.round_open: dict[int, float | None] = {p: None for p in self.owned}
        self.quorum_at: dict[int, float | None] = {p: None for p in self.owned}
        self.quorum_lost: set[int] = set()  # rounds that had their quorum and lost it since
        self.registry = Registry(cfg.learners, cfg.heartbeat_timeout, cfg.confirm_timeout)
        self.learners = self.registry.learners  # learner -> LearnerInfo
        self.grace = GraceWindow(cfg.grace_gamma, cfg.max_grace, cfg.overlap, cfg.ema_decay)
        self._timed_at: dict[int, tuple[int, int]] = {}  # learner -> (life, step) last timed
        self.stats = dict(merges=0, bytes_in=0, bytes_out=0, offers=0, **refusals.new_stats())
        self.refusals = refusals.Refusals(self.stats, self.record, self.num_learners)
        self.scale = OfferScale(cfg.max_offer_norm_ratio, self.owned)
        self._sizes = {p: sum(v.size for v in self.theta[p].values()) for p in self.owned}
        self._total = sum(int(np.size(v)) for v in params.values())
        # Reused memory for the merge's fragment-sized temporaries (RDA's direction, the
        # reply's copy of Θ): fresh arrays page-fault on the critical path (reply_buffers.py).
        self._scratch, self.replies = Scratch(), ReplyBuffers(cfg.reply_spares)

    def record(self, rec: dict) -> None:
        """Emits one merge / event record (the runtime writes it to merges or events.jsonl)."""
        self.log_position += 1
        self._emit(rec)

    # --- liveness (diloco/registry.py) -----------------------------------------------
    def live(self, now: float) -> list[int]:
        return self.registry.live(now)

    def register(self, m: int, incarnation: int, joined: bool, now: float, *more) -> None:
        """Restores a registry entry (after the syncer itself was restored)."""
        self.registry.register(m, incarnation, joined, now, *more)

    # --- messages --------------------------------------------------------------------
    def handle(self, msg, now: float, tick: bool = True) -> list[tuple[int, object]]:
        """Processes one incoming message; returns (learner, message) pairs to send. A message
        it cannot act on is logged and dropped (refusals.py), never raised.

        `tick=False`: rounds are not closed here; the caller ticks once after a batch of
        messages (`handle_batch`), so offers that queued up together merge together."""
        if isinstance(msg, Offer):
            self._accept(msg, now)
            return self.tick(now) if tick else self._sent()
        reason = check_message(msg, self.num_learners, self.bounds)
        if reason:
            self.refusals.drop_message(msg, reason, now)
            return []
        msg = plain(msg)
        if isinstance(msg, Join):
            return self._join(msg, now) + self._sent()
        if isinstance(msg, Leave):
            reason = self.registry.leave(msg.learner, msg.incarnation, msg.finished)
            if reason == "again":
                return []
            if reason:
                self.refusals.drop_message(msg, reason, now)
                return []
            self.record({"event": "leave", "learner": msg.learner,
                         "finished": bool(msg.finished), "time": now})  # fmt: skip
            return self.tick(now) if tick else self._sent()
        seen = self.registry.heartbeat(msg.learner, msg.incarnation, msg.step, now)
        if seen == "join":
            # A learner in a life this syncer may have missed the Join of (its registry comes
            # from a checkpoint older than the learner's (re)join): treat it as that join.
            join = Join(msg.learner, msg.incarnation, msg.time, msg.step)
            return self._join(join, now, announced=False) + self._sent()
        if isinstance(seen, Reason):
            self.refusals.drop_message(msg, seen, now)
            return []
        if msg.step_seconds > 0 and self._timed_at.get(msg.learner) != (msg.incarnation, msg.step):
            # Only a learner that stepped since its last timed heartbeat: one waiting (for a
            # merge, its data, the final sync) repeats its average every heartbeat_every
            # seconds, which would weigh the grace window's step time towards the waiters.
            self._timed_at[msg.learner] = (msg.incarnation, msg.step)
            self.grace.step.update(msg.step_seconds)
        return self.tick(now) if tick else self._sent()  # a waiting offer may be fresh now

    def handle_batch(self, msgs: list, clock: Callable[[], float]) -> list[tuple[int, object]]:
        """Handles messages that arrived together, in order, then closes due rounds once.

        Offers that queued while the syncer was busy (merging) join one round per fragment
        instead of each closing its own: under load a merge takes more offers and the
        syncer fewer merges, so it catches up instead of falling further behind (on the dev
        box, four `mid` learners' offers waited 265 ms on average in the syncer's inbox, most
        of a merge delay of 16 steps, with a round closed after every offer)."""
        out = []
        for msg in msgs:
            out += self.handle(msg, clock(), tick=False)
        return out + self.tick(clock())

    def _join(self, msg: Join, now: float, announced: bool = True) -> list[tuple[int, object]]:
        """`announced`: a real Join, made at the step its life began (else a heartbeat of a
        life whose Join this syncer may have missed, which began at some earlier step)."""
        # Before the run's first merge every learner is a founding one (registry.py); a
        # syncer shard knows its own fragments' merges only.
        founding = not any(self.version.values())
        joined_at = msg.step if announced else -1
        known = self.registry.get(msg.learner)
        new_life = known is None or known.incarnation != msg.incarnation
        reason = self.registry.join(
            msg.learner, msg.incarnation, msg.step, msg.tokens_per_step, now, founding, joined_at
        )
        if reason:
            self.refusals.drop_message(msg, reason, now)
            return []
        for p in self.owned:
            # Offers of an earlier life are void. Those of this life are not: voided by its
            # Join again (a link retrying it), the learner, told neither Merged nor Dropped,
            # would keep the offer in flight and never offer p again.
            void = self.pending[p].pop(msg.learner, None) if new_life else None
            if void is not None:
                # Logged like any offer that will not be merged (its steps are accounted
                # for); no one to tell: its life is over.
                why = f"its learner rejoined as incarnation {msg.incarnation}"
                self.refusals.drop_offer(void[0], Reason("new_life", why), now, notify=False)
                self._round_gone(p)
            # The slot its earlier life reached is not this life's (a restarted process
            # resumes its checkpoint, behind it): left in, it would hold `paced_slot` there,
            # and with K < M the others' offers would wait for catch-up rounds, which wait
            # for every live learner, until the new life caught up. (-1, not removed: a
            # restore takes a missing entry from the merged step's slot.)
            if new_life and msg.learner in self.merged_slot[p]:
                self.merged_slot[p][msg.learner] = -1
        # What Θ holds of the learner's earlier lives stays in the fragments' clocks (and so
        # in this snapshot and in every checkpoint) until its new life's first merge: a
        # resume in between must not take that work for lost (or train it again).
        self.record(
            {"event": "join", "learner": msg.learner, "incarnation": msg.incarnation, "time": now}
        )
        snap = self.snapshot(now)
        self.stats["bytes_out"] += snapshot_bytes(snap)
        return [(msg.learner, snap)]

    def _sent(self) -> list[tuple[int, object]]:
        return self.refusals.sent()

    def _accept(self, offer: Offer, now: float) -> None:
        self.stats["offers"] += 1
        offer = plain(offer)
        info = self.registry.get(getattr(offer, "learner", None))
        reason = checks.check_envelope(offer)
        if not reason and offer.epoch != self.epoch and 0 <= offer.learner < self.num_learners:
            # Made before this syncer life's snapshot reached the learner: its base version
            # belongs to a lost life. The learner rebases on the snapshot and offers again.
            # (Before its sender's checks: the learner may not have joined this life yet, or
            # be known to it at another incarnation; neither makes the offer a bad one.)
            self.stats["bytes_in"] += offer.nbytes
            why = f"epoch {offer.epoch}: made before the syncer restore"
            self.refusals.drop_offer(offer, Reason("epoch", why), now)
            return
        reason = reason or checks.check_sender(offer, info, self.num_learners, self.version)
        if reason:
            self.refusals.reject(offer, reason, now)
            return
        self.stats["bytes_in"] += offer.nbytes
        p = offer.fragment
        merged = self.merged_into[p].get(offer.learner)
        cfg, bounds = self.cfg, self.bounds
        version, H = self.version[p], self.plan.sync_every
        reason = checks.check_counters(offer, info, version, cfg.max_staleness, H, merged, bounds)
        waiting = self.pending[p].get(offer.learner, (None,))[0]
        if not reason and waiting is not None and waiting.incarnation == offer.incarnation \
                and waiting.step >= offer.step:  # fmt: skip
            # Delivered again, or after the newer offer that holds its work (links deliver
            # in order; a retried call need not): replacing that would lose work.
            reason = Reason("duplicate", f"its offer at step {waiting.step} is pending")
        decoded = size = None
        if not reason:
            reason, decoded = checks.check_payload(offer, self.theta[p])
        if not reason:
            size = self.scale.size(decoded[1], offer.c_steps, self._sizes[p])
            reason = self.scale.check(p, size, self.theta[p])
        if reason and reason.kind == "duplicate":  # its version tells its learner
            self.refusals.drop_offer(offer, reason, now, notify=False)
            return
        if reason:
            self.refusals.reject(offer, reason, now)
            if reason.kind == "stale":
                self._bring_up_to_date(offer, now)
            return
        self.scale.add(p, size)
        self.registry.touch(offer.learner, now)
        info.step, info.confirmed = max(info.step, offer.step), True
        info.counted = True  # its work reaches Θ: in the roster from now (registry.py)
        if offer.c_steps:
            info.tokens_per_step = round(offer.c_tokens / offer.c_steps)
        eager = self.cfg.rounds == "eager"
        fresh = eager or self.slot(offer) > self.paced_slot(p, set(self.live(now)))
        if self.round_open[p] is None and fresh:  # a late offer does not open a round
            self.round_open[p] = now
        # A newer offer of the same life holds the older one's work (both are anchored on
        # versions that hold neither), so it replaces it.
        self.pending[p][offer.learner] = (offer, *decoded)

    def _bring_up_to_date(self, offer: Offer, now: float) -> None:
        """After refusing an offer as stale, sends its learner the fragment's version if it
        no longer gets every version (it left, and is in its final sync): it would offer the
        work again on the same base, staler with each merge, and be refused until its final
        wait ran out. A live learner gets each version anyway."""
        m, p = offer.learner, offer.fragment
        if m in self.live(now):
            return
        payload = compression.encode(self.theta[p], self.cfg.reply_compression)
        self.stats["bytes_out"] += payload.nbytes()
        self.refusals.queue(m, Merged(p, self.version[p], payload, (), now, payload.nbytes(),
                                      epoch=self.epoch, merged=self.clock(p)))  # fmt: skip

    # --- rounds ----------------------------------------------------------------------
    def grace_window(self) -> float:
        """Seconds a round with its quorum waits for more offers (diloco/grace.py)."""
        return self.grace.seconds()

    def _drop_dead(self, now: float) -> None:
        # Offers of a learner that left cleanly stay valid; those of a silent one are dropped.
        dead = self.registry.dead(now)
        for p in self.owned:
            for m in [m for m in self.pending[p] if m in dead]:
                offer = self.pending[p].pop(m)[0]
                self.refusals.drop_offer(offer, Reason("not_live", "learner not live"), now)
                self._round_gone(p)

    def _round_gone(self, p: int) -> None:
        """Fragment p's round has no offer left (its offers were void or dropped): the next
        offer opens a new one, whose quorum wait and grace start then."""
        if not self.pending[p]:
            self.round_open[p] = self.quorum_at[p] = None
            self.quorum_lost.discard(p)

    def slot(self, offer: Offer) -> int:
        """The schedule slot an offer stands for (diloco/rounds.py)."""
        info = self.registry.get(offer.learner)
        reported = None if info is None else (info.incarnation, info.step)
        return rounds.offer_slot(self.plan, offer, reported)

    def paced_slot(self, p: int, live: set[int]) -> int:
        """The slot an offer of fragment p must pass to be fresh: the one the last round
        covered, unless no live learner's work has been merged that far (the learners
        that reached it left: a fast one that finished its step budget, a crashed one):
        then the highest slot a live learner's work was merged in, so that the learners
        left pace the rounds again (K of them), instead of offers that can never be fresh
        waiting for catch-up rounds, which wait for every live learner."""
        reached = [slot for m, slot in self.merged_slot[p].items() if m in live]
        return min(self.last_slot[p], max(reached, default=-1))

    def fresh_offers(self, p: int, paced: int) -> int:
        """Offers counting towards the quorum of fragment p's next round (`paced`: its
        `paced_slot`)."""
        if self.cfg.rounds == "eager":
            return len(self.pending[p])
        return sum(self.slot(o) > paced for o, _, _ in self.pending[p].values())

    def tick(self, now: float) -> list[tuple[int, object]]:
        """Closes every round whose quorum and grace window are satisfied."""
        self._drop_dead(now)
        live = set(self.live(now))
        out = []
        for p in self.owned:
            pending = self.pending[p]
            everyone = bool(pending) and not self.waits_for(p, live)
            paced = self.paced_slot(p, live)
            fresh = self.fresh_offers(p, paced)
            if fresh >= self.cfg.quorum:
                if self.quorum_at[p] is None:
                    # A waiting offer turns fresh when its learner reports a later slot
                    # (rounds.offer_slot): the round opens then, not at a later offer.
                    if self.round_open[p] is None:
                        self.round_open[p] = now
                    self.quorum_at[p] = now
                    if p not in self.quorum_lost:  # (a regained quorum: sampled already)
                        self.grace.quorum.update(now - (self.round_open[p] or now))
                if everyone or now >= self.quorum_at[p] + self.grace_window():
                    out += self._merge(p, now)
                continue
            # Below quorum. One reached and lost since (offers void or dropped, the round's
            # others still pending) is not: its grace starts again when it is regained, and
            # its deadline, past, must not keep the syncer's loop from waiting.
            if self.quorum_at[p] is not None:
                self.quorum_at[p] = None
                self.quorum_lost.add(p)
            if everyone or (not fresh and self._catch_up(p, live, paced)):
                # Below quorum, but nobody else is going to offer; or a catch-up round.
                out += self._merge(p, now)
        return out + self._sent()

    def waits_for(self, p: int, live: set[int]) -> set[int]:
        """The live learners fragment p's pending offers still wait for: those with none
        pending, except a life that joined at or after the due step of the highest slot
        pending (a learner restarted there, whose offer of that slot was lost with it: its
        next offer of p at a due step stands for a later slot). Waiting for one of those held
        a synchronous round, and so every learner, forever (there, every pending offer is
        of one slot: a learner passes no due step of p before p's merge). A slot without a
        due step (slot 0 of a fragment at offset 0: only final offers stand for it) exempts
        no one."""
        pending = self.pending[p]
        if not pending:
            return set(live)
        highest = max(self.slot(o) for o, _, _ in pending.values())
        due = self.plan.offsets[p] + highest * self.plan.sync_every
        return {
            m for m in live - set(pending)
            if not (due >= 1 and m in self.learners and self.learners[m].joined_at >= due)
        }  # fmt: skip

    def next_deadline(self) -> float | None:
        times = [q + self.grace_window() for q in self.quorum_at.values() if q is not None]
        return min(times) if times else None

    def flush(self, now: float) -> list[tuple[int, object]]:
        """Merges every fragment with pending offers, quorum or not (end of a run)."""
        out = []
        for p in self.owned:
            if self.pending[p]:
                if self.quorum_at[p] is None and self.round_open[p] is not None:
                    self.quorum_at[p] = now
                out += self._merge(p, now)
        return out + self._sent()

    def _catch_up(self, p: int, live: set[int], paced: int) -> bool:
        done = rounds.current(self.plan, p, self.merged_into[p], paced)
        return rounds.catch_up(set(self.pending[p]), live, done)

    def _others_weight(self, kept: list[Offer], now: float) -> list[float]:
        """q of the roster's learners with no offer in this merge."""
        known = [o.c_tokens / o.c_steps for o in kept if o.c_steps]
        default = float(np.median(known)) if known else 1.0
        merged = {o.learner for o in kept}
        return self.registry.others_weight(merged, default, self.cfg.weights, now)

    def _merge(self, p: int, now: float) -> list[tuple[int, object]]:
        t0 = _time.perf_counter()
        offers = sorted(self.pending[p].values(), key=lambda oa: oa[0].learner)
        self.pending[p] = {}
        version = self.version[p]
        # Before merged_into takes this round's offers (the slot they are fresh against).
        eager = self.cfg.rounds == "eager"
        paced = self.last_slot[p] if eager else self.paced_slot(p, set(self.live(now)))
        kept, vs, sq_norms = [], [], []
        for o, a, q in offers:
            if version - o.base_version <= self.cfg.max_staleness:
                kept.append(o)
                vs.append(a)
                sq_norms.append(q)
            else:
                why = f"stale at merge: base {o.base_version}, now {version}"
                self.refusals.reject(o, Reason("stale", why), now)
                self._bring_up_to_date(o, now)
        quorum_wait = (self.quorum_at[p] or now) - (self.round_open[p] or now)
        grace_used = now - (self.quorum_at[p] or now)
        self.round_open[p] = self.quorum_at[p] = None
        self.quorum_lost.discard(p)
        if not kept:
            return []
        cfg, tokens, steps = self.cfg, [o.c_tokens for o in kept], [o.c_steps for o in kept]
        others = self._others_weight(kept, now)
        H = self.plan.sync_every
        w, scale, work = merge.weigh(tokens, steps, cfg.weights, cfg.normalize, H, others)
        direction = merge.direction_weights(tokens, steps, cfg.weights, cfg.normalize)
        embedding = p in self.plan.embedding_fragments
        rule = self.cfg.embedding_merge if embedding else self.cfg.merge
        # Against Θ before this step: the router the offers' outer gradients started from.
        router_divergence = merge.router_divergence(vs, w, self.theta[p])
        # In place: Θ and the momenta are the syncer's alone (snapshot() and the reply copy
        # them; state_dict()'s callers copy under the lock around handle/tick).
        outer = dict(lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.nesterov,
                     clock=cfg.momentum_clock, scale=scale, work=work)  # fmt: skip
        # The reply: uncompressed, Θ is copied into it by the outer step (reply_buffers.py).
        none = cfg.reply_compression == "none"
        payload, copy = self.replies.take(p, self.theta[p]) if none else (None, None)
        self.theta[p], self.outer[p], delta_norm = merge.merge_outer_step(
            self.theta[p], vs, w, rule, self.outer[p], **outer, inplace=True,
            sq_norms=sq_norms, return_delta_norm=True, threads=cfg.merge_threads,
            scratch=self._scratch, theta_copy=copy, direction=direction,
        )  # fmt: skip
        self.version[p] = version + 1
        slots = [self.slot(o) for o in kept]
        for o, slot in zip(kept, slots, strict=True):
            self.merged_into[p][o.learner] = (o.incarnation, o.step, version + 1)
            self.merged_slot[p][o.learner] = slot
        self.last_slot[p] = rounds.covered_slot(slots, paced, cfg.quorum, eager)
        if payload is None:
            payload = compression.encode(self.theta[p], cfg.reply_compression)
        reply = Merged(
            p, version + 1, payload, tuple(o.learner for o in kept), now, payload.nbytes(),
            steps=tuple(o.step for o in kept), incarnations=tuple(o.incarnation for o in kept),
            epoch=self.epoch, merged=self.clock(p),
        )  # fmt: skip
        # Every live learner gets the version, and so do contributors that left (their final
        # offers wait for it to know which of their steps Θ holds).
        live = sorted(set(self.live(now)) | set(reply.learners))
        merge_seconds = _time.perf_counter() - t0
        self.grace.merge.update(merge_seconds)
        self.stats["merges"] += 1
        self.stats["bytes_out"] += reply.nbytes * len(live)
        self.record(
            {
                "event": "merge",
                "fragment": p,
                "version": version + 1,
                "epoch": self.epoch,
                "learners": list(reply.learners),
                "weights": [float(x) for x in w / w.sum()] if w.sum() > 0 else [0.0] * len(w),
                "scale": scale,  # share of the roster's weight in this merge
                "work": work,  # rounds of work it carries (the momentum clock)
                "base_versions": [o.base_version for o in kept],
                "staleness": [version - o.base_version for o in kept],
                "steps": list(reply.steps),  # learner step of each merged offer
                "incarnations": list(reply.incarnations),
                "c_steps": [o.c_steps for o in kept],  # steps of work each offer brought
                # Seconds from each offer's making to this merge (its learner's clock against
                # ours): the device->host copy, outer gradient, link, our queue and the grace.
                "offer_seconds": [now - o.time for o in kept],
                "quorum_wait": quorum_wait,
                "grace": grace_used,
                "grace_window": self.grace_window(),
                "merge_seconds": merge_seconds,
                "bytes_in": int(sum(o.nbytes for o in kept)),
                "bytes_out": reply.nbytes * len(live),
                "share": self._sizes[p] / self._total,
                "delta_norm": delta_norm,  # ‖Δ‖, the merged outer gradient's L2 norm
                # Learners' router spread relative to ‖Θ_router‖, mean over the fragment's
                # router leaves (definition: merge.router_divergence); only for MoE
                # fragments merged from >= 2 weighted offers.
                **({} if router_divergence is None else {"router_divergence": router_divergence}),
                "time": now,
            }
        )
        return [(m, reply) for m in live]

    def clock(self, p: int) -> dict:
        """Fragment p's vector clock: learner -> (incarnation, step of its latest merge)."""
        return {m: (inc, step) for m, (inc, step, _) in self.merged_into[p].items()}

    def snapshot(self, now: float) -> Snapshot:
        params = {k: v.copy() for p in self.owned for k, v in self.theta[p].items()}
        clocks = {p: self.clock(p) for p in self.owned}
        return Snapshot(dict(self.version), params, now, epoch=self.epoch, merged=clocks)

    def global_params(self) -> dict[str, np.ndarray]:
        """The live Θ arrays (merges update them in place): copy to keep a version."""
        return {k: v for p in self.owned for k, v in self.theta[p].items()}

    # --- checkpointing (diloco/syncer_state.py) -------------------------------------------
    def state_dict(self) -> dict:
        return syncer_state.state_dict(self)

    def meta_dict(self) -> dict:
        return syncer_state.meta_dict(self)

    def load_state_dict(self, state: dict, meta: dict, now: float) -> None:
        syncer_state.load(self, state, meta, now)


def snapshot_bytes(snap: Snapshot) -> int:
    """What a snapshot puts on the wire: its parameters, uncompressed."""
    return int(sum(v.nbytes for v in snap.params.values()))
