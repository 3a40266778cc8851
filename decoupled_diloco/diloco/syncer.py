"""The syncer: quorum, adaptive grace window, token-weighted RDA merge, outer Nesterov step.

Pure logic driven by its runtime: `handle(msg, now)` and `tick(now)` return the messages to
send, `next_deadline()` says when `tick` must run again. No threads, queues or sockets here,
so the same object runs in-process, in a Ray actor, or under a fake clock in tests.

Offers carry *outer gradients* v_m = Θ_p^(base) − θ_m,p, computed on the learner's side
against its host copy of the global fragment it last received (bit-identical to the
syncer's copy of that version unless replies are lossily compressed, in which case the
anchor is what the learner really started from). This anchors a stale learner's work on
the version it started from instead of the current one, without the syncer keeping old
versions of Θ in memory.

Rounds follow the fragment schedule ("scheduled", the default): fragment p is due on learner
step t = offset_p + r·H, so an offer made at step t belongs to schedule slot r. A round
closes when K offers of a slot not merged yet are in and the grace window has passed (or
when every live learner has an offer in); it merges every pending offer, including late
ones of older slots (a learner that is behind, restarted or slower). So out-of-step learners
ride along with the next round instead of each triggering an outer step of its own, and
the outer step keeps the rate of synchronous DiLoCo: one per fragment per H steps. So K
counts learners that reached a slot the last round did not cover: with 1 < K < M rounds go
at the pace of the K-th fastest learner (K = 1: the fastest; K = M: the slowest, or every
live learner), and the learners behind join the next round with their late offers.

Every life of a syncer has an `epoch` (a restored syncer gets a new one): it re-creates
version numbers its lost life had used for other parameters, so offers are matched to the
life they were anchored in; those of a lost life are dropped (the learner re-anchors on the
new life's snapshot and its next offer carries the same work).

An offer made before its learner applied a merge of its own earlier offer repeats work that
merge already holds; it is dropped ("superseded"), and the learner carries the newer work
into its next offer (see `Learner._apply_due`).
"""

import dataclasses
import math
import time as _time
from collections.abc import Callable

import numpy as np

from decoupled_diloco.diloco import compression, merge
from decoupled_diloco.diloco.fragments import FragmentPlan
from decoupled_diloco.diloco.messages import Heartbeat, Join, Leave, Merged, Offer, Snapshot
from decoupled_diloco.diloco.syncer_config import SyncerConfig

_INTEGER_FIELDS = (
    "learner", "incarnation", "fragment", "step", "c_steps", "c_tokens", "base_version",
    "work_steps", "epoch",
)  # fmt: skip
_MAX_TOKENS = 2**53  # c_tokens² must stay a finite float64
# Schedule slots an offer may be ahead of the last step its learner reported (join,
# heartbeats every ~0.5 s, offers): far more than a healthy learner gets ahead.
MAX_SLOT_LEAD = 64


@dataclasses.dataclass
class LearnerInfo:
    incarnation: int = 0
    last_seen: float = 0.0
    joined: bool = False
    step: int = 0


class _Ema:
    def __init__(self, decay: float):
        self.decay, self.value = decay, None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x

    def get(self) -> float:
        return 0.0 if self.value is None else self.value


class Syncer:
    """Owns the global fragments `fragments` (all of them unless the syncer is sharded)."""

    def __init__(
        self,
        cfg: SyncerConfig,
        plan: FragmentPlan,
        params: dict[str, np.ndarray],
        num_learners: int,
        fragments: list[int] | None = None,
        record: Callable[[dict], None] | None = None,
        epoch: int = 0,
    ):
        self.cfg, self.plan, self.num_learners = cfg, plan, num_learners
        self.epoch = epoch  # this life of the syncer (a restored syncer gets a new one)
        self.owned = list(range(plan.num_fragments)) if fragments is None else list(fragments)
        self._emit = record or (lambda r: None)
        self.log_position = 0  # records emitted (merges and events), across restores
        parts = plan.split({k: np.asarray(v, np.float32) for k, v in params.items()})
        self.theta = {p: {k: v.copy() for k, v in parts[p].items()} for p in self.owned}
        self.outer = {
            p: merge.OuterState({k: np.zeros_like(v) for k, v in self.theta[p].items()})
            for p in self.owned
        }
        self.version = {p: 0 for p in self.owned}
        self.last_slot = {p: -1 for p in self.owned}  # highest schedule slot merged
        # fragment -> learner -> (incarnation, version that merged its offer)
        self.merged_into: dict[int, dict[int, tuple[int, int]]] = {p: {} for p in self.owned}
        # fragment -> learner -> (offer, decoded outer gradient, its per-leaf ‖v‖²)
        self.pending: dict[int, dict[int, tuple[Offer, dict, dict]]] = {p: {} for p in self.owned}
        self.round_open: dict[int, float | None] = {p: None for p in self.owned}
        self.quorum_at: dict[int, float | None] = {p: None for p in self.owned}
        self.learners: dict[int, LearnerInfo] = {}
        self.xi_step, self.xi_quorum, self.xi_merge = (_Ema(cfg.ema_decay) for _ in range(3))
        self.stats = dict(merges=0, rejected_offers=0, bytes_in=0, bytes_out=0, offers=0)
        self.merged_learners = 0
        self.useful_steps: dict[int, float] = {}  # learner -> merged steps × fragment share
        self._sizes = {p: sum(v.size for v in self.theta[p].values()) for p in self.owned}
        self._total = sum(int(np.size(v)) for v in params.values())

    def record(self, rec: dict) -> None:
        """Emits one merge / event record (the runtime writes it to merges or events.jsonl)."""
        self.log_position += 1
        self._emit(rec)

    # --- liveness --------------------------------------------------------------------
    def live(self, now: float) -> list[int]:
        return sorted(
            m
            for m, info in self.learners.items()
            if info.joined and now - info.last_seen <= self.cfg.heartbeat_timeout
        )

    def register(self, m: int, incarnation: int, joined: bool, now: float, step: int = 0) -> None:
        """Restores a registry entry (after the syncer itself was restored)."""
        self.learners[m] = LearnerInfo(
            incarnation=incarnation, last_seen=now, joined=joined, step=step
        )

    def _touch(self, m: int, incarnation: int, now: float) -> LearnerInfo:
        info = self.learners.setdefault(m, LearnerInfo())
        info.last_seen = max(info.last_seen, now)
        return info

    # --- messages --------------------------------------------------------------------
    def handle(self, msg, now: float) -> list[tuple[int, object]]:
        """Processes one incoming message; returns (learner, message) pairs to send."""
        if isinstance(msg, Join):
            if not 0 <= msg.learner < self.num_learners:
                self._reject(None, f"join from unknown learner {msg.learner}", now, msg.learner)
                return []
            known = self.learners.get(msg.learner)
            if known is not None and msg.incarnation < known.incarnation:
                # A delayed Join of an earlier life must not roll the registry back.
                self._reject(None, f"join from old incarnation {msg.incarnation}", now, msg.learner)
                return []
            info = self._touch(msg.learner, msg.incarnation, now)
            info.incarnation, info.joined = msg.incarnation, True
            info.step = max(info.step, int(msg.step))
            for p in self.owned:  # offers of an earlier life are void
                self.pending[p].pop(msg.learner, None)
                self.merged_into[p].pop(msg.learner, None)
            self.record(
                {
                    "event": "join",
                    "learner": msg.learner,
                    "incarnation": msg.incarnation,
                    "time": now,
                }
            )
            return [(msg.learner, self.snapshot(now))]
        if isinstance(msg, Leave):
            info = self.learners.get(msg.learner)
            if info is not None and info.incarnation == msg.incarnation:
                info.joined = False
                self.record({"event": "leave", "learner": msg.learner, "time": now})
            return self.tick(now)
        if isinstance(msg, Heartbeat):
            info = self.learners.get(msg.learner)
            stale_registry = info is None or msg.incarnation > info.incarnation
            if stale_registry and 0 <= msg.learner < self.num_learners:
                # A live learner in a life this syncer never saw: its registry comes from a
                # checkpoint older than the learner's (re)join, so treat it as that join.
                return self.handle(Join(msg.learner, msg.incarnation, msg.time, msg.step), now)
            if info is not None and info.incarnation == msg.incarnation:
                self._touch(msg.learner, msg.incarnation, now)
                info.step = max(info.step, int(msg.step))
                if msg.step_seconds > 0:
                    self.xi_step.update(msg.step_seconds)
            return []
        if isinstance(msg, Offer):
            self._accept(msg, now)
            return self.tick(now)
        raise TypeError(f"syncer cannot handle {type(msg).__name__}")

    def _reject(self, offer: Offer | None, reason: str, now: float, learner: int = -1) -> None:
        self.stats["rejected_offers"] += offer is not None
        self.record(
            {
                "event": "reject",
                "learner": offer.learner if offer else learner,
                "fragment": offer.fragment if offer else None,
                "reason": reason,
                "time": now,
            }
        )

    def _accept(self, offer: Offer, now: float) -> None:
        self.stats["offers"] += 1
        self.stats["bytes_in"] += offer.nbytes
        reason = self._check_sender(offer)
        if reason:
            self._reject(offer, reason, now)
            return
        p = offer.fragment
        if offer.epoch != self.epoch:
            # Made before this syncer life's snapshot reached the learner: its base version
            # belongs to a lost life. Not a bad offer; the learner re-anchored on the
            # snapshot and its next offer carries the same work.
            self.record(
                {
                    "event": "drop_offer",
                    "learner": offer.learner,
                    "fragment": p,
                    "reason": f"epoch {offer.epoch}: made before the syncer restore",
                    "step": offer.step,
                    "time": now,
                }
            )
            return
        reason, decoded = self._check_content(offer)
        if reason:
            self._reject(offer, reason, now)
            return
        info = self._touch(offer.learner, offer.incarnation, now)
        info.step = max(info.step, offer.step)
        done = self.merged_into[p].get(offer.learner) if self.cfg.drop_superseded else None
        if done is not None and done[0] == offer.incarnation and offer.base_version < done[1]:
            self.record(
                {
                    "event": "drop_offer",
                    "learner": offer.learner,
                    "fragment": p,
                    "reason": f"superseded: an earlier offer was merged into version {done[1]}",
                    "step": offer.step,
                    "base_version": offer.base_version,
                    "time": now,
                }
            )
            return
        fresh = self.cfg.rounds == "eager" or self.slot(offer) > self.last_slot[p]
        if self.round_open[p] is None and fresh:  # a late offer does not open a round
            self.round_open[p] = now
        old = self.pending[p].get(offer.learner)
        if old is not None and old[0].incarnation == offer.incarnation:
            # The newer offer's parameters contain the older one's work.
            offer.work_steps += old[0].work_steps
        self.pending[p][offer.learner] = (offer, *decoded)  # newer replaces older

    def _check_sender(self, offer: Offer) -> str:
        """Why an offer's envelope is bad (its learner, life and fragment); "" if good."""
        for field in _INTEGER_FIELDS:
            v = getattr(offer, field, None)
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                return f"{field} must be an integer, got {v!r}"
        info = self.learners.get(offer.learner)
        if not 0 <= offer.learner < self.num_learners or info is None or not info.joined:
            return f"unknown learner {offer.learner}"
        if offer.incarnation != info.incarnation:
            return f"incarnation {offer.incarnation} != current {info.incarnation}"
        if offer.fragment not in self.version:
            return f"fragment {offer.fragment} is not owned by this syncer"
        return ""

    def _check_content(self, offer: Offer) -> tuple[str, tuple[dict, dict] | None]:
        """Returns (reason, (decoded outer gradient, its per-leaf ‖v‖²)); reason "" if good.

        Versions, counters, step and payload of an offer whose sender checks passed.
        """
        info = self.learners[offer.learner]
        version = self.version[offer.fragment]
        if offer.base_version > version:
            return f"base version {offer.base_version} is from the future (now {version})", None
        if version - offer.base_version > self.cfg.max_staleness:
            return f"stale: base {offer.base_version}, now {version}", None
        if not 0 <= offer.c_steps <= offer.step or not 0 <= offer.c_tokens <= _MAX_TOKENS:
            return (
                f"counters out of range: c_steps={offer.c_steps} (step {offer.step}), "
                f"c_tokens={offer.c_tokens}"
            ), None
        if offer.work_steps < 0:
            return f"negative work_steps {offer.work_steps}", None
        # A step far beyond what the learner last reported would push the fragment's
        # schedule slot ahead and starve later rounds of fresh offers.
        if offer.step > info.step + self.plan.sync_every * MAX_SLOT_LEAD:
            return f"step {offer.step} is from the future (learner reported {info.step})", None
        try:
            arrays = compression.decode(offer.payload)
        except Exception as e:  # a malformed payload is a rejection, never a crash
            return f"undecodable payload: {e!r}", None
        expected = self.theta[offer.fragment]
        if set(arrays) != set(expected):
            return f"leaf names {sorted(arrays)[:3]}... do not match fragment", None
        for k, v in arrays.items():
            if v.shape != expected[k].shape:
                return f"{k}: shape {v.shape} != {expected[k].shape}", None
            if v.dtype != np.float32:
                return f"{k}: dtype {v.dtype} != float32", None
        # ‖v‖² per leaf is the finiteness check (NaN/inf propagate into it; so does a float32
        # overflow of values > ~1e19, which RDA could not merge either) and, kept with the
        # offer, spares the merge one of RDA's read passes over the offers.
        sq_norms = merge.offer_sq_norms(arrays)
        for k, q in sq_norms.items():
            if not math.isfinite(q):
                return f"{k}: non-finite values", None
        return "", (arrays, sq_norms)

    # --- rounds ----------------------------------------------------------------------
    def grace_window(self) -> float:
        """γ·(τ·ξ_step − ξ_quorum − ξ_merge), clamped to [0, max_grace] seconds."""
        budget = self.cfg.overlap * self.xi_step.get() - self.xi_quorum.get() - self.xi_merge.get()
        return float(min(max(self.cfg.grace_gamma * budget, 0.0), self.cfg.max_grace))

    def _drop_dead(self, now: float) -> None:
        # Offers of a learner that left cleanly stay valid; those of a silent one are dropped.
        dead = {
            m
            for m, info in self.learners.items()
            if info.joined and now - info.last_seen > self.cfg.heartbeat_timeout
        }
        for p in self.owned:
            for m in [m for m in self.pending[p] if m in dead]:
                self.pending[p].pop(m)
                self.record(
                    {
                        "event": "drop_offer",
                        "learner": m,
                        "fragment": p,
                        "reason": "learner not live",
                        "time": now,
                    }
                )

    def slot(self, offer: Offer) -> int:
        """The schedule slot r of an offer: made at step offset_p + r·H (or after it)."""
        return (offer.step - self.plan.offsets[offer.fragment]) // self.plan.sync_every

    def fresh_offers(self, p: int) -> int:
        """Offers counting towards the quorum of fragment p's next round."""
        if self.cfg.rounds == "eager":
            return len(self.pending[p])
        return sum(self.slot(o) > self.last_slot[p] for o, _, _ in self.pending[p].values())

    def tick(self, now: float) -> list[tuple[int, object]]:
        """Closes every round whose quorum and grace window are satisfied."""
        self._drop_dead(now)
        live = set(self.live(now))
        out = []
        for p in self.owned:
            pending = self.pending[p]
            everyone = bool(pending) and live <= set(pending)
            if self.fresh_offers(p) >= self.cfg.quorum:
                if self.quorum_at[p] is None:
                    self.quorum_at[p] = now
                    self.xi_quorum.update(now - self.round_open[p])
                if everyone or now >= self.quorum_at[p] + self.grace_window():
                    out += self._merge(p, now)
            elif everyone:  # below quorum, but nobody else is going to offer
                out += self._merge(p, now)
        return out

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
        return out

    def _merge(self, p: int, now: float) -> list[tuple[int, object]]:
        t0 = _time.perf_counter()
        offers = sorted(self.pending[p].values(), key=lambda oa: oa[0].learner)
        self.pending[p] = {}
        version = self.version[p]
        kept, sq_norms = [], []
        for o, a, q in offers:
            if version - o.base_version <= self.cfg.max_staleness:
                kept.append((o, a))
                sq_norms.append(q)
            else:
                self._reject(o, f"stale at merge: base {o.base_version}, now {version}", now)
        w = merge.token_weights(
            [o.c_tokens for o, _ in kept], [o.c_steps for o, _ in kept], self.cfg.weights
        )
        quorum_wait = (self.quorum_at[p] or now) - (self.round_open[p] or now)
        grace_used = now - (self.quorum_at[p] or now)
        self.round_open[p] = self.quorum_at[p] = None
        if not kept or float(w.sum()) <= 0:
            return []
        rule = self.cfg.embedding_merge if p == self.plan.embedding_fragment else self.cfg.merge
        vs = [a for _, a in kept]
        # Against Θ before this step: the router the offers' outer gradients started from.
        router_divergence = merge.router_divergence(vs, w, self.theta[p])
        # In place: Θ and the momenta are the syncer's alone (snapshot() and the reply's
        # encode copy them; state_dict()'s callers copy under the lock around handle/tick).
        self.theta[p], self.outer[p], delta_norm = merge.merge_outer_step(
            self.theta[p],
            vs,
            w,
            rule,
            self.outer[p],
            self.cfg.outer_lr,
            self.cfg.outer_momentum,
            self.cfg.nesterov,
            inplace=True,
            sq_norms=sq_norms,
            return_delta_norm=True,
        )
        self.version[p] = version + 1
        payload = compression.encode(self.theta[p], self.cfg.compression)
        learners = tuple(o.learner for o, _ in kept)
        reply = Merged(
            p,
            version + 1,
            payload,
            learners,
            now,
            payload.nbytes(),
            steps=tuple(o.step for o, _ in kept),
            incarnations=tuple(o.incarnation for o, _ in kept),
            epoch=self.epoch,
        )
        for o, _ in kept:
            self.merged_into[p][o.learner] = (o.incarnation, version + 1)
        self.last_slot[p] = max(self.last_slot[p], max(self.slot(o) for o, _ in kept))
        live = self.live(now)
        merge_seconds = _time.perf_counter() - t0
        self.xi_merge.update(merge_seconds)
        self.stats["merges"] += 1
        self.stats["bytes_out"] += reply.nbytes * len(live)
        self.merged_learners += len(kept)
        share = self._sizes[p] / self._total
        for o, _ in kept:
            self.useful_steps[o.learner] = (
                self.useful_steps.get(o.learner, 0.0) + o.work_steps * share
            )
        self.record(
            {
                "event": "merge",
                "fragment": p,
                "version": version + 1,
                "epoch": self.epoch,
                "learners": list(learners),
                "weights": [float(x) for x in w / w.sum()],
                "base_versions": [o.base_version for o, _ in kept],
                "staleness": [version - o.base_version for o, _ in kept],
                "steps": [o.step for o, _ in kept],  # learner step of each merged offer
                "incarnations": [o.incarnation for o, _ in kept],
                "c_steps": [o.c_steps for o, _ in kept],
                "work_steps": [o.work_steps for o, _ in kept],
                "quorum_wait": quorum_wait,
                "grace": grace_used,
                "grace_window": self.grace_window(),
                "merge_seconds": merge_seconds,
                "bytes_in": int(sum(o.nbytes for o, _ in kept)),
                "bytes_out": reply.nbytes * len(live),
                "share": share,
                "delta_norm": delta_norm,  # ‖Δ‖, the merged outer gradient's L2 norm
                # Learners' router spread relative to ‖Θ_router‖, mean over the fragment's
                # router leaves (definition: merge.router_divergence); only for MoE
                # fragments merged from >= 2 weighted offers.
                **({} if router_divergence is None else {"router_divergence": router_divergence}),
                "time": now,
            }
        )
        return [(m, reply) for m in live]

    def snapshot(self, now: float) -> Snapshot:
        params = {k: v.copy() for p in self.owned for k, v in self.theta[p].items()}
        return Snapshot(dict(self.version), params, now, epoch=self.epoch)

    def global_params(self) -> dict[str, np.ndarray]:
        """The live Θ arrays (merges update them in place): copy to keep a version."""
        return {k: v for p in self.owned for k, v in self.theta[p].items()}

    # --- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume: Θ, outer momenta, versions (host numpy + ints).

        The arrays are live (merges update them in place): copy them before `handle` or
        `tick` can run again, as the runtime does under its syncer lock.
        """
        return {
            "theta": {str(p): self.theta[p] for p in self.owned},
            "momentum": {str(p): self.outer[p].momentum for p in self.owned},
            "version": {str(p): np.int64(self.version[p]) for p in self.owned},
            "last_slot": {str(p): np.int64(self.last_slot[p]) for p in self.owned},
        }

    def load_state_dict(self, state: dict) -> None:
        # Own copies (writable, C-contiguous): merges update Θ and the momenta in place.
        own = lambda tree: {k: np.array(v, np.float32, order="C") for k, v in tree.items()}
        for p in self.owned:
            self.theta[p] = own(state["theta"][str(p)])
            self.outer[p] = merge.OuterState(own(state["momentum"][str(p)]))
            self.version[p] = int(state["version"][str(p)])
            self.last_slot[p] = int(state.get("last_slot", {}).get(str(p), -1))
            self.merged_into[p] = {}
            self.pending[p] = {}
            self.round_open[p] = self.quorum_at[p] = None
