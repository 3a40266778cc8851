"""What learners and the syncer say to each other. Plain data: picklable, numpy only on the wire.

`Offer.payload` is the one exception on the learner side: the learner hands its transport a
dict of device arrays (already copied off the donated train state), and the transport turns
it into an `Encoded` host payload off the learner's critical path.
"""

import dataclasses
from typing import Any


@dataclasses.dataclass
class Join:
    """A learner (re)starts and asks for the current global parameters."""

    learner: int
    incarnation: int  # restart count; offers from an older incarnation are rejected
    time: float
    step: int = 0  # the learner's step (a resumed or restarted learner does not start at 0)


@dataclasses.dataclass
class Leave:
    """A learner finished its step budget (or is being removed) and stops offering."""

    learner: int
    incarnation: int
    time: float


@dataclasses.dataclass
class Heartbeat:
    learner: int
    incarnation: int
    step: int
    step_seconds: float  # the learner's recent inner-step time (for the grace window)
    time: float


@dataclasses.dataclass
class Offer:
    """Learner m's copy of fragment p after `step` inner steps."""

    learner: int
    incarnation: int
    fragment: int
    step: int
    c_steps: int  # inner steps since this learner last received fragment p
    c_tokens: int  # tokens in those steps
    base_version: int  # version of the global fragment these steps started from
    time: float  # when the learner made the offer
    work_steps: int = 0  # steps since this learner's previous offer of p (goodput accounting)
    payload: Any = None  # learner side: dict of device arrays; on the wire: compression.Encoded
    nbytes: int = 0  # wire bytes of the payload, set by the transport
    epoch: int = 0  # the syncer life `base_version` belongs to (see Snapshot.epoch)


@dataclasses.dataclass
class Merged:
    """The syncer's new global fragment p (version `version`)."""

    fragment: int
    version: int
    payload: Any  # compression.Encoded
    learners: tuple[int, ...]  # contributors of this merge
    time: float
    nbytes: int = 0
    steps: tuple[int, ...] = ()  # the step of each contributor's merged offer
    incarnations: tuple[int, ...] = ()  # and the contributor's incarnation
    epoch: int = 0  # the syncer life that made this version (see Snapshot.epoch)


@dataclasses.dataclass
class Snapshot:
    """All global fragments with their versions: a (re)joining learner's starting point."""

    versions: dict  # fragment -> version (the sending syncer shard's fragments only)
    params: dict  # flat name -> float32 numpy array
    time: float
    # A syncer restored from a checkpoint re-creates version numbers its lost life had
    # already used for other parameters; the epoch (new for every life) tells them apart,
    # so an offer anchored on a lost version is never merged against a re-created one.
    epoch: int = 0
