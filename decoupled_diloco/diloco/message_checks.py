"""Why the syncer must not act on a Join, Heartbeat or Leave: malformed or implausible fields.

A learner's control messages change the registry (its life, its reported step, its batch),
which every later offer is checked against, so they are validated like offers: each field
of the right type (an integer is an int, never a bool or float; times are finite reals),
learners in range, incarnations and steps >= 0, steps no further than the run's step count
(`RunBounds`), a batch no larger than the configured one. What the registry decides from
them (old lives, new lives) is in `registry.py`. A message that fails is logged
(`drop_message` event) and counted by kind ("malformed", "unknown_learner", "implausible",
"unknown_type"; the registry adds "old_incarnation", "new_incarnation"), never raised.
"""

from decoupled_diloco.diloco.messages import Heartbeat, Join, Leave
from decoupled_diloco.diloco.offer_checks import Reason, RunBounds, has_kind

# Fields each message must have, and their kinds.
FIELDS = {
    Join: (("learner", "int"), ("incarnation", "int"), ("time", "real"), ("step", "int"),
           ("tokens_per_step", "int")),
    Heartbeat: (("learner", "int"), ("incarnation", "int"), ("step", "int"),
                ("step_seconds", "real"), ("time", "real")),
    Leave: (("learner", "int"), ("incarnation", "int"), ("time", "real"), ("finished", "bool")),
}  # fmt: skip


def check_message(msg, num_learners: int, bounds: RunBounds) -> Reason | None:
    """Types and ranges of a Join, Heartbeat or Leave (anything else: "unknown_type")."""
    fields = FIELDS.get(type(msg))
    if fields is None:
        return Reason("unknown_type", f"the syncer cannot handle {type(msg).__name__}")
    for name, kind in fields:
        v = getattr(msg, name, None)
        if not has_kind(v, kind):
            return Reason("malformed", f"{name} must be {'a' if kind != 'int' else 'an'} "
                          f"{kind}, got {v!r}")  # fmt: skip
    if not 0 <= msg.learner < num_learners:
        return Reason("unknown_learner", f"unknown learner {msg.learner}")
    if msg.incarnation < 0:
        return Reason("malformed", f"negative incarnation {msg.incarnation}")
    step = getattr(msg, "step", 0)
    if not 0 <= step <= bounds.step_ceiling:
        return Reason("implausible", f"step {step} is outside [0, {bounds.step_ceiling}] "
                      "(train.steps)")  # fmt: skip
    tokens = getattr(msg, "tokens_per_step", 0)
    if not 0 <= tokens <= bounds.tokens_ceiling:
        return Reason("implausible", f"tokens_per_step {tokens} is outside [0, "
                      f"{bounds.tokens_ceiling}] (train.batch_size x data.seq_len)")  # fmt: skip
    if getattr(msg, "step_seconds", 0.0) < 0:
        return Reason("malformed", f"negative step_seconds {msg.step_seconds}")
    return None
