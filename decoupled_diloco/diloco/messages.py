"""What learners and the syncer say to each other: plain data, numpy only, picklable.

Payloads are `compression.Encoded` host arrays by the time a message reaches a transport;
transports carry messages and never compute on them.

Versions and vector clocks. Every merge of fragment p makes a new version of Θ_p. With it
the syncer sends `merged`, the fragment's vector clock: for each learner the (incarnation,
step) of its latest offer that any version so far holds. Clocks only grow, so one version
tells a learner everything about its own offers, whichever versions it missed or received
out of order: an offer made at step s is in Θ_p exactly when the clock's step for its
learner and incarnation is >= s.
"""

import dataclasses
from typing import Any

import numpy as np

Clock = dict  # learner -> (incarnation, step of its latest merged offer)


@dataclasses.dataclass
class Join:
    """A learner (re)starts and asks for the current global parameters."""

    learner: int
    incarnation: int  # restart count; offers from an older incarnation are rejected
    time: float
    step: int = 0  # the learner's step (a resumed or restarted learner does not start at 0)
    tokens_per_step: int = 0  # the learner's batch in tokens (its weight in merges)


@dataclasses.dataclass
class Leave:
    """A learner stops training: it finished its step budget, or leaves the membership.

    Its offers in flight, and the final offers it may still send for the work they did not
    hold, stay valid. A finished learner whose work reached Θ (an offer of its life was
    accepted) stays in the roster that merge weights are normalised by (its work was done
    alongside the others'); one that leaves early does not.
    """

    learner: int
    incarnation: int
    time: float
    finished: bool = False


@dataclasses.dataclass
class Heartbeat:
    learner: int
    incarnation: int
    step: int
    step_seconds: float  # the learner's recent inner-step time (for the grace window)
    time: float


@dataclasses.dataclass
class Offer:
    """Learner m's outer gradient for fragment p: all its work on p that no version holds.

    v = Θ_p^(base) − θ_m,p with Θ_p^(base) the version the learner last applied. A learner
    has at most one offer per fragment in flight, so two offers never hold the same step.
    """

    learner: int
    incarnation: int
    fragment: int
    step: int  # the learner's step when it made the offer
    c_steps: int  # inner steps in v (its work on p not held by any version it knows of)
    c_tokens: int  # tokens in those steps
    base_version: int  # version of Θ_p the outer gradient is anchored on
    time: float  # when the learner made the offer
    payload: Any = None  # compression.Encoded
    nbytes: int = 0  # wire bytes of the payload
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
    merged: Clock = dataclasses.field(default_factory=dict)  # the fragment's vector clock


@dataclasses.dataclass
class Dropped:
    """The syncer will never merge this offer (rejected, stale, or its learner timed out).

    Its work is still the learner's: the learner offers it again with its next offer.
    """

    learner: int
    incarnation: int
    fragment: int
    step: int
    reason: str
    time: float
    epoch: int = 0  # the offer's (a drop of an offer to a lost syncer life names that life)


@dataclasses.dataclass
class Snapshot:
    """Global fragments with their versions: a (re)joining learner's starting point, and
    a restored syncer's announcement of its new life to the learners it knows."""

    versions: dict  # fragment -> version (the sending syncer shard's fragments only)
    params: dict  # flat name -> float32 numpy array
    time: float
    # A syncer restored from a checkpoint re-creates version numbers its lost life had
    # already used for other parameters; the epoch (new for every life) tells them apart,
    # so an offer anchored on a lost version is never merged against a re-created one.
    epoch: int = 0
    merged: dict = dataclasses.field(default_factory=dict)  # fragment -> vector clock


def plain(msg):
    """`msg` with its numpy scalars (which the syncer's checks accept) as Python ones: they
    end up in merge records, the registry and checkpoints, which JSON writes (an np.int32
    counter failed a merge's record after Θ had moved)."""
    kinds = ((np.bool_, bool), (np.integer, int), (np.floating, float))
    changes = {}
    for f in dataclasses.fields(msg):
        v = getattr(msg, f.name)
        python = next((py for numpy_kind, py in kinds if isinstance(v, numpy_kind)), None)
        if python is not None:
            changes[f.name] = python(v)
    return dataclasses.replace(msg, **changes) if changes else msg
