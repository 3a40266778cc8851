"""summary.json of a run, the same keys for every runtime."""

from decoupled_diloco.config import RunConfig
from decoupled_diloco.diloco import refusals


def run_summary(
    run: RunConfig,
    final_eval_loss: float,
    steps: int,
    tokens: int,
    wall_seconds: float,
    accounting: dict,
    syncer_stats: list[dict],
    lock_wait: dict | None = None,
    merge_records: int | None = None,
) -> dict:
    """`accounting`: `Ledger.summary(...)`; `syncer_stats`: each live syncer shard's stats;
    `lock_wait`: `gil.LockProbe.summary()` of the process that ran every learner and syncer
    (the local runtime's; None under Ray, whose actors are processes of their own);
    `merge_records`: the records in merges.jsonl, every attempt's. With them a resumed run's
    `merges` are the merges Θ holds over all its attempts (not the last attempt's), and
    `rolled_back_merges` those merges.jsonl records but Θ lost (a syncer restore, a kill
    after the syncer's last checkpoint)."""
    summary = {
        "name": run.name,
        "final_eval_loss": final_eval_loss,
        "steps": steps,
        "tokens": tokens,
        "wall_seconds": wall_seconds,
        "learners": run.num_learners,
    }
    summary.update(accounting)
    summary.update(refusal_counts(syncer_stats))
    waits = lock_wait or {}
    summary["lock_wait_ms"] = waits.get("mean_ms")  # None: not measured
    summary["lock_wait_p99_ms"] = waits.get("p99_ms")
    held = [s.get("held_merges") for s in syncer_stats]
    if run.uses_syncer and held and None not in held:
        summary["merges"] = sum(held)
        if merge_records is not None:
            summary["rolled_back_merges"] = max(merge_records - sum(held), 0)
    if run.uses_syncer:
        communicated = sum(s["bytes_in"] + s["bytes_out"] for s in syncer_stats)
        summary["bytes_communicated"] = int(communicated)
        summary["bytes_per_token"] = summary["bytes_communicated"] / max(tokens, 1)
    else:
        summary["bytes_communicated"] = 0
        summary["bytes_per_token"] = 0.0
    return summary


def refusal_counts(syncer_stats: list[dict]) -> dict:
    """What the syncer shards refused, by kind (diloco/refusals.py), summed over shards: a
    control message goes to every shard and is counted by each that drops it. Counts are
    the syncer's, kept in its checkpoints (a restored shard continues them), while
    `rejected_offers` / `dropped_offers` count events.jsonl's records (every attempt's)."""
    names = {"reject": "rejections_by_reason", "drop_offer": "offer_drops_by_reason",
             "drop_message": "message_drops_by_reason"}  # fmt: skip
    out = {"dropped_messages": sum(s.get("dropped_messages", 0) for s in syncer_stats)}
    for event, key in names.items():
        counts: dict[str, int] = {}
        for s in syncer_stats:
            for kind, n in refusals.by_kind(s, event).items():
                counts[kind] = counts.get(kind, 0) + n
        out[key] = dict(sorted(counts.items()))
    return out
