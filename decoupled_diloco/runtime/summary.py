"""summary.json of a run, the same keys for every runtime."""

from decoupled_diloco.config import RunConfig


def run_summary(
    run: RunConfig,
    final_eval_loss: float,
    steps: int,
    tokens: int,
    wall_seconds: float,
    accounting: dict,
    syncer_stats: list[dict],
) -> dict:
    """`accounting`: `Ledger.summary(...)`; `syncer_stats`: each live syncer shard's stats."""
    summary = {
        "name": run.name,
        "final_eval_loss": final_eval_loss,
        "steps": steps,
        "tokens": tokens,
        "wall_seconds": wall_seconds,
        "learners": run.num_learners,
    }
    summary.update(accounting)
    if run.uses_syncer:
        communicated = sum(s["bytes_in"] + s["bytes_out"] for s in syncer_stats)
        summary["bytes_communicated"] = int(communicated)
        summary["bytes_per_token"] = summary["bytes_communicated"] / max(tokens, 1)
    else:
        summary["bytes_communicated"] = 0
        summary["bytes_per_token"] = 0.0
    return summary
