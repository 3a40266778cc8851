"""Hosting a learner, for every runtime: its checkpoints, metrics rows and injected slowness.

The local runtime (threads) and the Ray runtime (one process per learner) drive `Learner`
objects the same way; what they share lives here so both write the same checkpoints and the
same metrics.jsonl rows.
"""

import time

from decoupled_diloco import faults
from decoupled_diloco.checkpoint import Checkpointer
from decoupled_diloco.diloco.learner import Learner

_MOE_KEYS = ("moe_aux_loss", "load_balance_loss", "router_z_loss", "dropped_fraction")


def save_learner(learner: Learner, ckpt: Checkpointer, wait: bool = False) -> None:
    """TrainState plus step, data position and incarnation (no-op while the learner is down)."""
    if learner.state is None or ckpt.latest_step() == learner.step:
        return  # down, or this step is saved already (the periodic save at the last step)
    meta = {
        "step": learner.step,
        "data": learner.data.get_state(),
        "incarnation": learner.incarnation,
    }
    ckpt.save(learner.step, learner.state, meta, wait=wait)


def restore_learner(learner: Learner, ckpt: Checkpointer, initial_data_state: dict):
    """The learner's last checkpoint: returns its TrainState (or None without one) and sets
    step, data position and a higher incarnation; `learner.state` is left None."""
    ckpt.manager.wait_until_finished()
    if ckpt.latest_step() is None:
        learner.step = 0
        learner.data.set_state(initial_data_state)
        return None
    state, meta = ckpt.restore(learner.abstract_state())
    _set_position(learner, meta)
    return state


def restore_position(learner: Learner, ckpt: Checkpointer) -> bool:
    """Step, data position and incarnation of the last checkpoint, not its parameters: a
    learner restarting against a syncer takes Θ from it. False without a checkpoint."""
    step = ckpt.latest_step()
    if step is None:
        return False
    meta = ckpt.manager.restore(step, args=_meta_only()).meta
    _set_position(learner, meta)
    return True


def _meta_only():
    import orbax.checkpoint as ocp

    return ocp.args.Composite(meta=ocp.args.JsonRestore())


def _set_position(learner: Learner, meta: dict) -> None:
    learner.step = int(meta["step"])
    learner.incarnation = max(learner.incarnation, int(meta["incarnation"]) + 1)
    learner.data.set_state(meta["data"])


def step_record(m: int, learner: Learner, metrics: dict, tokens_per_second: float, now: float):
    """One metrics.jsonl row of learner m after its step `learner.step`."""
    import numpy as np

    rec = {
        "learner": m,
        "step": learner.step,
        "tokens": learner.step * learner.tokens_per_batch,
        "loss": metrics["loss"],
        "learning_rate": metrics["learning_rate"],
        "grad_norm": metrics["grad_norm"],
        "tokens_per_second": tokens_per_second,
        "time": now,
    }
    for k in _MOE_KEYS:
        if k in metrics:
            rec[k] = metrics[k]
    if "expert_load" in metrics:
        # float64 first: rounding float32 leaves 0.26249998807907104-style noise in the JSON.
        rec["expert_load"] = np.asarray(metrics["expert_load"], np.float64).round(4).tolist()
    return rec


class RateMeter:
    """Tokens per second of each learner since its previous log line."""

    def __init__(self):
        self._last: dict[int, tuple[float, int]] = {}

    def __call__(self, m: int, learner: Learner, now: float) -> float:
        last = self._last.get(m)
        self._last[m] = (now, learner.step)
        if last is None or now <= last[0] or learner.step <= last[1]:
            return learner.tokens_per_batch / max(learner.step_seconds, 1e-9)
        return (learner.step - last[1]) * learner.tokens_per_batch / (now - last[0])


def straggle(schedule: faults.FaultSchedule, m: int, learner: Learner, compute: float, now: float):
    """Sleeps to emulate a slower chip or a straggler episode after a step of `compute` s.

    The first step of an incarnation is compilation, which a slower chip would not stretch
    by the same factor, so it is not stretched.
    """
    factor = schedule.step_time_factor(m, learner.step, now)
    if factor > 1.0 and learner.timed_intervals > 0:
        time.sleep((factor - 1.0) * compute)
