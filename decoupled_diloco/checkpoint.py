"""orbax checkpoints of learners and the syncer.

Layout under `<workdir>/checkpoints/`: `learner_<m>/<step>/` holds a learner's TrainState
(parameters, AdamW state, step), its data-iterator position and incarnation; its DiLoCo
bookkeeping is not saved: a learner restarting against a syncer starts from the syncer's
snapshot (its parameters, counters at zero), keeping only its step, data position and, in a
resumed run, its AdamW state. `syncer_<s>/<n>/` holds shard s's Θ, outer
momenta, versions and schedule slots, plus the fragment plan, the learner registry, its
counters and its event-log position. Restores go straight onto the target shardings.
"""

import os
import threading
from typing import Any

import orbax.checkpoint as ocp

# Saves are synchronous: orbax's asynchronous saves from several threads of one process
# (learners of the local runtime) fail or deadlock (measured with orbax-checkpoint 0.12.8:
# "Directory not empty", timeouts waiting for step-directory signals), while synchronous
# saves of separate managers from separate threads are safe, so they need no shared lock
# and one learner's save never stalls another learner or the syncer. A manager is used by
# one thread at a time (its owner), guarded by its own lock.


class Checkpointer:
    """One orbax CheckpointManager: an array tree plus a JSON side-car per step."""

    def __init__(self, directory: str, max_to_keep: int = 2):
        self._lock = threading.Lock()
        # Remote paths (gs://..., for multi-node Ray runs) go to orbax as they are.
        self.manager = ocp.CheckpointManager(
            directory if "://" in directory else os.path.abspath(directory),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, arrays: Any, meta: dict, wait: bool = True) -> None:
        del wait  # saves are synchronous (see the note at the top of this module)
        with self._lock:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
            self.manager.wait_until_finished()

    def restore(self, abstract_arrays: Any, step: int | None = None) -> tuple[Any, dict]:
        """`abstract_arrays`: a tree of ShapeDtypeStruct (with .sharding) or numpy arrays."""
        step = self.latest_step() if step is None else step
        with self._lock:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    arrays=ocp.args.StandardRestore(abstract_arrays), meta=ocp.args.JsonRestore()
                ),
            )
        return restored["arrays"], restored["meta"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def save_learner(ckpt: Checkpointer, state, data_state: dict, step: int, incarnation: int) -> None:
    """A learner's TrainState with its step, data position and incarnation (a no-op while
    it is down, or when this step is saved already)."""
    if state is None or ckpt.latest_step() == step:
        return
    ckpt.save(step, state, {"step": step, "data": data_state, "incarnation": incarnation})


def restore_learner(ckpt: Checkpointer, abstract_state, params_too: bool):
    """(step, data position, next incarnation, TrainState or None) of the last checkpoint,
    or None without one. Without `params_too` only the position is read: a learner restarting
    against a syncer takes its parameters from Θ."""
    ckpt.manager.wait_until_finished()
    step = ckpt.latest_step()
    if step is None:
        return None
    if params_too:
        state, meta = ckpt.restore(abstract_state)
    else:
        state = None
        meta = ckpt.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    return int(meta["step"]), meta["data"], int(meta["incarnation"]) + 1, state
