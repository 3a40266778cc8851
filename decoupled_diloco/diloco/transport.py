"""The one narrow interface between learners and the syncer: messages in, messages out.

Transports carry `messages.py` messages, whose payloads are host arrays already; they never
compute on them. Runtimes implement both ends: in-process queues and threads
(`runtime/links.py`), Ray actor calls and the object store (`runtime/ray/links.py`).
Nothing here may block a learner for longer than it asks to.
"""

import abc

from decoupled_diloco.diloco import messages


class LearnerLink(abc.ABC):
    """A learner's end."""

    @abc.abstractmethod
    def send(self, msg: messages.Join | messages.Leave | messages.Heartbeat | messages.Offer):
        """Hands a message over for delivery, in order; never blocks on the network."""

    @abc.abstractmethod
    def receive(self, timeout: float = 0.0) -> list:
        """Merged / Dropped / Snapshot messages that arrived; waits up to `timeout` s for
        the first."""

    @abc.abstractmethod
    def flush(self, timeout: float = 600.0) -> bool:
        """Blocks until everything sent so far is delivered (False: gave up at `timeout`)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """The learner's process died: what is not on the wire yet is lost, and what
        arrived for it is discarded."""

    @abc.abstractmethod
    def close(self) -> None:
        """The learner is done with the link: what was handed over is still delivered,
        then the link's threads end (idempotent; nothing is sent after)."""

    def agree(self, decision: bool) -> bool:
        """The learner's decision at a wall-clock check (a wait ran out, a deadline passed):
        this host's own here; the hosts of a multi-host learner take host 0's, since each
        branch issues collectives (receives, offers) every host must issue alike."""
        return decision


class SyncerLink(abc.ABC):
    """The syncer's end."""

    @abc.abstractmethod
    def receive(self, timeout: float) -> list:
        """Join / Leave / Heartbeat / Offer messages; waits up to `timeout` s for the first."""

    @abc.abstractmethod
    def send(self, learner: int, msg: messages.Merged | messages.Dropped | messages.Snapshot):
        """Non-blocking delivery to one learner (dropped if that learner is gone)."""
