"""Hosting a syncer shard, for every runtime: its service turn, checkpoint save and restore.

A `Syncer` is pure logic; a runtime owns the loop around it (a thread in the local runtime,
an actor's thread under Ray). Both serve it through `serve_turn` and checkpoint it in the
same orbax layout: Θ, outer momenta and versions as arrays; the fragment plan, the learner
registry and the counters as JSON.
"""

import secrets
import threading
from collections.abc import Callable

import jax
import numpy as np

from decoupled_diloco import models
from decoupled_diloco.checkpoint import Checkpointer
from decoupled_diloco.diloco.fragments import FragmentPlan, flatten_params, make_fragment_plan
from decoupled_diloco.diloco.syncer import Syncer, SyncerConfig
from decoupled_diloco.diloco.transport import SyncerLink


def fragment_plan(run) -> FragmentPlan:
    """The run's fragment plan (`run`: a RunConfig); deterministic, so every process agrees."""
    abstract = jax.eval_shape(lambda: models.init_params(run.model, jax.random.key(0)))
    shapes = {k: tuple(v.shape) for k, v in flatten_params(abstract).items()}
    s = run.syncer
    return make_fragment_plan(shapes, s.num_fragments, s.fragment_strategy, run.learner.sync_every)


def owned_fragments(num_fragments: int, shards: int, shard: int) -> list[int]:
    """Fragments of syncer shard `shard`: p with p mod S == shard."""
    return [p for p in range(num_fragments) if p % shards == shard]


def new_syncer(
    cfg: SyncerConfig,
    plan: FragmentPlan,
    params: dict[str, np.ndarray],
    num_learners: int,
    shard: int,
    record: Callable[[dict], None],
) -> Syncer:
    owned = owned_fragments(plan.num_fragments, cfg.shards, shard)
    return Syncer(cfg, plan, params, num_learners, owned, record=record)


def serve_turn(
    syncer: Syncer,
    link: SyncerLink,
    clock: Callable[[], float],
    lock: threading.Lock,
    max_block: float = 0.02,
) -> None:
    """Receives what arrived (blocking until the next grace deadline, at most `max_block` s),
    handles it, closes due rounds and sends the replies."""
    deadline = syncer.next_deadline()
    timeout = max_block if deadline is None else min(max(deadline - clock(), 0.0), max_block)
    msgs = link.receive(timeout)
    with lock:
        out = []
        for msg in msgs:
            out += syncer.handle(msg, clock())
        out += syncer.tick(clock())
    for m, msg in out:
        link.send(m, msg)


def _saved_key(syncer: Syncer) -> tuple:
    """What a checkpoint must hold; a save is skipped while it has not changed."""
    registry = tuple(sorted((m, i.incarnation, i.joined) for m, i in syncer.learners.items()))
    return tuple(sorted(syncer.version.items())), registry


def save_syncer(
    syncer: Syncer,
    ckpt: Checkpointer,
    plan: FragmentPlan,
    lock: threading.Lock,
    wait: bool = False,
) -> None:
    """Saves Θ, momenta, versions, the registry and the event-log position, unless neither
    the versions nor the registry changed since the last save.

    The arrays are copied under `lock` (merges update them in place), then written outside it.
    """
    with lock:
        key = _saved_key(syncer)
        if key == getattr(ckpt, "syncer_key", None):
            return
        state = jax.tree.map(np.copy, syncer.state_dict())
        meta = {
            "plan": plan.to_json(),
            "learners": {
                str(m): [i.incarnation, i.joined, i.step] for m, i in syncer.learners.items()
            },
            "stats": dict(syncer.stats),
            # Records (merges.jsonl / events.jsonl lines) this shard had emitted: those
            # after it belong to merges a restore rolls back.
            "log_position": syncer.log_position,
        }
    ckpt.save((ckpt.latest_step() or 0) + 1, state, meta, wait=wait)
    ckpt.syncer_key = key


def new_epoch() -> int:
    """A fresh syncer life's epoch: unique with overwhelming probability, never 0."""
    return 1 + secrets.randbelow(2**62)


def restore_syncer(syncer: Syncer, ckpt: Checkpointer, now: float) -> bool:
    """Starts a new life of a freshly built `syncer`: a new epoch, then the latest
    checkpoint (Θ, momenta, versions, the learner registry with every entry seen at `now`,
    and the event-log position). False when there is no checkpoint."""
    syncer.epoch = new_epoch()
    if ckpt.latest_step() is None:
        return False
    state, meta = ckpt.restore(jax.tree.map(np.asarray, syncer.state_dict()))
    syncer.load_state_dict(state)
    for m, (inc, joined, *step) in meta["learners"].items():
        syncer.register(int(m), inc, joined, now, *step)
    syncer.log_position = int(meta.get("log_position", 0))
    ckpt.syncer_key = _saved_key(syncer)
    return True
