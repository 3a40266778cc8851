"""A syncer's checkpoint contents: what a new life needs to continue where one left off.

Arrays (`state_dict`): Θ, outer momenta, versions and schedule slots per owned fragment.
JSON (`meta_dict`): the fragment plan (a resume must not change it), the learner registry,
every fragment's vector clock, the counters (a new life continues those of refusals), the
recent offers' sizes (offer_scale.py) and the event-log position. A streamed checkpoint
(fragment_checkpoint.py) takes each fragment's part (`fragment_part`) under its own lock
hold and the rest (`shared_meta`) once; `join_parts` puts them back together. `load` restores
both into a freshly built `Syncer` (pending offers and open rounds are not saved: offers
of a lost life are void, learners offer again).
"""

import numpy as np
from absl import logging

from decoupled_diloco.diloco import merge, refusals
from decoupled_diloco.diloco.fragments import FragmentPlan


def state_dict(syncer) -> dict:
    """The arrays of a checkpoint (host numpy). They are live (merges update them in place):
    copy them before `handle` or `tick` can run again, as the syncer loop does under its
    lock."""
    owned = syncer.owned
    return {
        "theta": {str(p): syncer.theta[p] for p in owned},
        "momentum": {str(p): syncer.outer[p].momentum for p in owned},
        "version": {str(p): np.int64(syncer.version[p]) for p in owned},
        "last_slot": {str(p): np.int64(syncer.last_slot[p]) for p in owned},
    }


def meta_dict(syncer) -> dict:
    """The JSON part of a checkpoint."""
    clocks = {str(p): _clock(syncer, p) for p in syncer.owned}
    slots = {str(p): _slots(syncer, p) for p in syncer.owned}
    return {**shared_meta(syncer), "merged_into": clocks, "merged_slot": slots}


def _clock(syncer, p: int) -> dict:
    return {str(m): list(v) for m, v in syncer.merged_into[p].items()}


def _slots(syncer, p: int) -> dict:
    return {str(m): int(s) for m, s in syncer.merged_slot[p].items()}


def fragment_part(syncer, p: int) -> tuple[dict, dict]:
    """Fragment p's own part of a checkpoint, copied: ({"theta", "momentum"} arrays,
    {"version", "last_slot", "merged_into", "merged_slot"}). Taken under the lock around
    handle/tick, it is one consistent cut of the fragment (its Θ, momentum, version and
    clock agree)."""
    arrays = {
        "theta": {k: v.copy() for k, v in syncer.theta[p].items()},
        "momentum": {k: v.copy() for k, v in syncer.outer[p].momentum.items()},
    }
    info = {"version": int(syncer.version[p]), "last_slot": int(syncer.last_slot[p]),
            "merged_into": _clock(syncer, p), "merged_slot": _slots(syncer, p)}  # fmt: skip
    return arrays, info


def join_parts(parts: dict[int, tuple[dict, dict]], meta: dict) -> tuple[dict, dict]:
    """(state_dict, meta_dict) from the parts `fragment_part` made and `shared_meta`."""
    state = {
        "theta": {str(p): a["theta"] for p, (a, _) in parts.items()},
        "momentum": {str(p): a["momentum"] for p, (a, _) in parts.items()},
        "version": {str(p): np.int64(i["version"]) for p, (_, i) in parts.items()},
        "last_slot": {str(p): np.int64(i["last_slot"]) for p, (_, i) in parts.items()},
    }
    clocks = {str(p): i["merged_into"] for p, (_, i) in parts.items()}
    slots = {str(p): i["merged_slot"] for p, (_, i) in parts.items()}
    return state, {**meta, "merged_into": clocks, "merged_slot": slots}


def _entry(i) -> list:
    """A registry entry, in the order `load` hands it back to `Syncer.register`."""
    return [i.incarnation, i.joined, i.step, i.tokens_per_step, i.finished, i.counted, i.joined_at]


def registry_meta(syncer) -> dict:
    """The learner registry's part of `shared_meta`."""
    return {str(m): _entry(i) for m, i in syncer.learners.items()}


def shared_meta(syncer) -> dict:
    """The JSON part of a checkpoint that belongs to no one fragment."""
    return {
        "plan": syncer.plan.to_json(),
        "learners": registry_meta(syncer),
        "stats": dict(syncer.stats),
        "offer_scale": syncer.scale.to_json(),
        # Records (merges.jsonl / events.jsonl lines) this shard had emitted: those after
        # it belong to merges a restore rolls back.
        "log_position": syncer.log_position,
    }


def load(syncer, state: dict, meta: dict, now: float) -> None:
    """Restores a checkpoint into `syncer`; every registered learner counts as seen at
    `now`. ValueError if the checkpoint was written with another fragment plan, lacks a
    fragment this syncer owns, or holds arrays of other shapes than its model's (a forced
    resume past a changed config). Learners beyond `syncer.num_learners` (a forced resume
    with fewer) are dropped: they would stay in the merge roster for good."""
    saved = meta.get("plan")
    if saved is not None and FragmentPlan.from_json(saved) != syncer.plan:
        raise ValueError(
            "the syncer checkpoint was written with another fragment plan (diloco.fragments, "
            "fragment_strategy, sync_every or the model changed since): resume with the "
            "run's original settings or start a new workdir"
        )
    _check_arrays(syncer, state)
    # Own copies (writable, C-contiguous): merges update Θ and the momenta in place.
    own = lambda tree: {k: np.array(v, np.float32, order="C") for k, v in tree.items()}
    for p in syncer.owned:
        syncer.theta[p] = own(state["theta"][str(p)])
        syncer.outer[p] = merge.OuterState(own(state["momentum"][str(p)]))
        syncer.version[p] = int(state["version"][str(p)])
        syncer.last_slot[p] = int(state.get("last_slot", {}).get(str(p), -1))
        clocks = meta.get("merged_into", {}).get(str(p), {})
        syncer.merged_into[p] = {int(m): tuple(int(x) for x in v) for m, v in clocks.items()}
        # (a checkpoint from before merged_slot was kept: the slot of the merged step)
        slots = meta.get("merged_slot", {}).get(str(p), {})
        syncer.merged_slot[p] = {
            m: int(slots.get(str(m), syncer.plan.slot(p, step)))
            for m, (_, step, _) in syncer.merged_into[p].items()
        }
        syncer.pending[p] = {}
        syncer.round_open[p] = syncer.quorum_at[p] = None
    for m, (inc, joined, step, *rest) in meta.get("learners", {}).items():
        if int(m) >= syncer.num_learners:
            logging.warning("the syncer checkpoint registers learner %s, but the run has %d "
                            "learners: it is dropped", m, syncer.num_learners)  # fmt: skip
            continue
        syncer.register(int(m), int(inc), bool(joined), now, int(step), *rest)
    syncer.log_position = int(meta.get("log_position", 0))
    syncer.scale.load_json(meta.get("offer_scale", {}))
    syncer.stats.update(
        {k: int(n) for k, n in meta.get("stats", {}).items() if refusals.is_count(k)}
    )


def _check_arrays(syncer, state: dict) -> None:
    """Every owned fragment is in the checkpoint, its Θ and momenta with the model's leaves
    and shapes (the plan names the leaves only: a model of another width matches it)."""
    for p in syncer.owned:
        for part in ("theta", "momentum"):
            saved = state.get(part, {}).get(str(p))
            if saved is None:
                raise ValueError(
                    f"the syncer checkpoint has no {part} of fragment {p}, which this syncer "
                    "owns (diloco.syncer_shards changed since?): resume with the run's "
                    "original settings or start a new workdir"
                )
            want = {k: np.shape(v) for k, v in syncer.theta[p].items()}
            got = {k: np.shape(v) for k, v in saved.items()}
            if got != want:
                diff = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
                k = diff[0]
                raise ValueError(
                    f"the syncer checkpoint's {part} of fragment {p} does not fit the model: "
                    f"{k} is {got.get(k, 'missing')} there, {want.get(k, 'absent')} in the "
                    f"model ({len(diff)} leaves differ; the model changed since?)"
                )
