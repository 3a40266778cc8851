"""What the syncer does not act on: every refusal is logged and counted, never raised.

Three events (events.jsonl), each with the offending message's fields, a `kind` and the
`reason` (offer_checks.py, message_checks.py, registry.py, offer_scale.py name the kinds):
- "reject": a bad offer (malformed, implausible, off-scale). Never merged.
- "drop_offer": an offer that will not be merged through no fault of its own (made in a
  lost syncer life, or its learner timed out; or merged already, delivered again).
- "drop_message": a Join, Heartbeat or Leave not acted on (malformed, implausible, of
  another life), or a message of a type the syncer does not know.
The learner of a refused offer is told with `Dropped` (its work stays its own and goes into
its next offer), except of a duplicate: its work is in Θ, and a version tells it so. The
syncer's stats count them per event and per "event:kind" (a flat dict of ints, so a shallow
copy is a snapshot); runtime/summary.py sums them over shards into summary.json.
"""

from decoupled_diloco.diloco.messages import Dropped
from decoupled_diloco.diloco.offer_checks import Reason

EVENTS = ("reject", "drop_offer", "drop_message")
_COUNTERS = {"reject": "rejected_offers", "drop_offer": "dropped_offers",
             "drop_message": "dropped_messages"}  # fmt: skip
_OFFER_FIELDS = ("learner", "fragment", "step", "incarnation")


def new_stats() -> dict:
    """The counters, inside the syncer's stats dict ("event:kind" keys are added as seen)."""
    return {c: 0 for c in _COUNTERS.values()}


def is_count(key: str) -> bool:
    """Whether a stats key is one of the refusal counters."""
    return key in _COUNTERS.values() or key.split(":")[0] in EVENTS


def by_kind(stats: dict, event: str) -> dict[str, int]:
    """{kind: count} of one event in a syncer's stats."""
    prefix = event + ":"
    return {k[len(prefix) :]: n for k, n in stats.items() if k.startswith(prefix)}


def _loggable(v):
    """A field value as JSON can hold it (a malformed message may carry anything)."""
    if v is None or isinstance(v, bool | int | float | str):
        return v
    try:
        return int(v) if hasattr(v, "__index__") else repr(v)[:200]
    except Exception:  # a value whose repr fails is still a refusal, never a crash
        return f"<{type(v).__name__}>"


class Refusals:
    """Logs (`record`), counts (into `stats`) and queues the Dropped notices of refusals."""

    def __init__(self, stats: dict, record, num_learners: int):
        self.stats, self.record, self.num_learners = stats, record, num_learners
        self._notices: list[tuple[int, object]] = []

    def reject(self, offer, reason: Reason, now: float) -> None:
        """A bad offer: never merged; its learner is told."""
        self._refuse("reject", offer, reason, now)

    def drop_offer(self, offer, reason: Reason, now: float, notify: bool = True) -> None:
        """Not a bad offer, but one that will not be merged (its learner keeps the work and
        is told, unless `notify` is False: a duplicate, whose work is merged)."""
        self._refuse("drop_offer", offer, reason, now, notify)

    def drop_message(self, msg, reason: Reason, now: float) -> None:
        """A control message (or something else) the syncer does not act on."""
        self._count("drop_message", reason)
        rec = {"message": type(msg).__name__, "learner": _loggable(getattr(msg, "learner", None))}
        rec["incarnation"] = _loggable(getattr(msg, "incarnation", None))
        self.record({"event": "drop_message", **rec, "kind": reason.kind,
                     "reason": reason.text, "time": now})  # fmt: skip

    def queue(self, m: int, msg) -> None:
        """Another message for learner m, sent after the notices queued before it."""
        self._notices.append((m, msg))

    def sent(self) -> list[tuple[int, object]]:
        """The notices queued since the last call."""
        out, self._notices = self._notices, []
        return out

    def _count(self, event: str, reason: Reason) -> None:
        key = f"{event}:{reason.kind}"
        self.stats[_COUNTERS[event]] += 1
        self.stats[key] = self.stats.get(key, 0) + 1

    def _refuse(self, event: str, offer, reason: Reason, now: float, notify: bool = True) -> None:
        self._count(event, reason)
        rec = {k: _loggable(getattr(offer, k, None)) for k in _OFFER_FIELDS}
        self.record({"event": event, **rec, "kind": reason.kind, "reason": reason.text,
                     "time": now})  # fmt: skip
        if not notify:
            return
        try:  # a malformed envelope names nobody to tell
            m, inc, p, step, epoch = (int(getattr(offer, k)) for k in (
                "learner", "incarnation", "fragment", "step", "epoch"))  # fmt: skip
        except (TypeError, ValueError, AttributeError):
            return
        if 0 <= m < self.num_learners:
            self._notices.append((m, Dropped(m, inc, p, step, reason.text, now, epoch)))
