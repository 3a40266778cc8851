"""orbax checkpoints of learners and the syncer.

Layout under `<workdir>/checkpoints/`: `learner_<m>/<step>/` holds a learner's TrainState,
its host-side DiLoCo bookkeeping (counters, base versions, anchors) and its data-iterator
position; `syncer/<n>/` holds Θ, outer momenta, versions, the fragment plan and the
syncer's counters. Restores go straight onto the target shardings.
"""

import os
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp

# orbax's save machinery is not safe when several managers in one process save from
# different threads at once (seen as missing tmp-dir metadata), so saves are synchronous
# and serialised in-process. Learners in separate processes (Ray) do not share this lock.
_SAVE_LOCK = threading.Lock()


class Checkpointer:
    """One orbax CheckpointManager: an array tree plus a JSON side-car per step."""

    def __init__(self, directory: str, max_to_keep: int = 2):
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
        del wait  # saves are synchronous (see _SAVE_LOCK)
        with _SAVE_LOCK:
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
        with _SAVE_LOCK:
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


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (keeping shardings of jax arrays) for restoring `tree`'s structure."""

    def one(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)
