"""The one narrow interface between learners and the syncer.

Learner and syncer logic only call these methods; runtimes implement them (in-process
queues and threads in `runtime/local.py`, Ray actors and the object store in
`runtime/ray_runtime.py`). Nothing here may block a learner for longer than it asks to.
"""

import abc

from decoupled_diloco.diloco import messages


class LearnerLink(abc.ABC):
    """A learner's end: send without blocking, receive what has arrived."""

    @abc.abstractmethod
    def send(self, msg: messages.Join | messages.Leave | messages.Heartbeat | messages.Offer):
        """Non-blocking. For an Offer, the link moves the payload to host and encodes it."""

    @abc.abstractmethod
    def receive(self, timeout: float = 0.0) -> list:
        """Merged / Snapshot messages that arrived; waits up to `timeout` s for the first."""


class SyncerLink(abc.ABC):
    """The syncer's end."""

    @abc.abstractmethod
    def receive(self, timeout: float) -> list:
        """Join / Leave / Heartbeat / Offer messages; waits up to `timeout` s for the first."""

    @abc.abstractmethod
    def send(self, learner: int, msg: messages.Merged | messages.Snapshot) -> None:
        """Non-blocking delivery to one learner (dropped if that learner is gone)."""
