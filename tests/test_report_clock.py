"""decoupled_diloco.report draws a resumed run on one clock: each attempt's records count
from that attempt's own start, so the report finds which attempt wrote each record and moves
it past every earlier attempt (synthetic workdirs, as runtime/workdir.py and records.py write
them)."""

import json

from decoupled_diloco import report


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _row(step, t, learner=0):
    return {"learner": learner, "step": step, "tokens": 100 * step, "loss": 2.0,
            "tokens_per_second": 50.0, "time": t}  # fmt: skip


def _merge(t):
    return {"event": "merge", "learners": [0], "staleness": [0], "quorum_wait": 0.0,
            "grace": 0.0, "time": t}  # fmt: skip


def _attempt(k, pid, seconds, finished):
    return {"attempt": k, "started": 1e9 + 100 * k, "pid": pid, "finished": finished,
            "own": {"wall_seconds": seconds}}  # fmt: skip


def test_a_killed_and_resumed_run_has_its_attempts_one_after_the_other(tmp_path):
    """Attempt 0 was killed 4.7 s after its last heartbeat (wall seconds 15.08, rows up to
    19.8 s); attempt 1's events restart at 0.65 s after attempt 0's 0.91 s (not below half
    of it) and its first row at 12 s. Every record of attempt 1 lies after attempt 0's."""
    _write(tmp_path / "attempts.jsonl", [_attempt(0, 100, 15.08, False),
                                        _attempt(1, 200, 40.0, True)])  # fmt: skip
    _write(tmp_path / "events.jsonl", [
        {"event": "join", "learner": 0, "time": 0.6},
        {"event": "learner_start", "learner": 0, "pid": 100, "time": 0.91},
        {"event": "join", "learner": 0, "time": 0.65},
        {"event": "learner_start", "learner": 0, "pid": 200, "time": 0.67},
    ])  # fmt: skip
    _write(tmp_path / "metrics.jsonl", [_row(10, 8.0), _row(20, 19.8), _row(30, 12.0),
                                        _row(40, 30.0)])  # fmt: skip
    _write(tmp_path / "merges.jsonl", [_merge(9.0), _merge(18.0), _merge(26.0), _merge(33.0)])
    metrics, merges, events = report.run_records(str(tmp_path))
    offset = 19.8  # attempt 0's latest record, longer than its recorded 15.08 s
    assert [r["time"] for r in events] == [0.6, 0.91, 0.65 + offset, 0.67 + offset]
    assert [r["time"] for r in metrics] == [8.0, 19.8, 12.0 + offset, 30.0 + offset]
    assert [r["time"] for r in merges] == [9.0, 18.0, 26.0 + offset, 33.0 + offset]


def test_each_syncer_shards_restore_opens_one_attempt_not_one_each():
    """A resumed run's shards each restore their checkpoint as they start (no pid, times
    above the killed attempt's latest): one new attempt, the first one's offset."""
    rows = [
        {"event": "join", "learner": 0, "time": 0.5},
        {"event": "learner_start", "learner": 0, "time": 0.9},
        {"event": "syncer_restore", "shard": 0, "after_failure": False, "time": 1.5},
        {"event": "syncer_restore", "shard": 1, "after_failure": False, "time": 1.6},
        {"event": "join", "learner": 0, "time": 1.7},
        {"event": "syncer_restore", "shard": 0, "after_failure": True, "time": 30.0},
    ]
    assert report.attempt_of(rows, [20.0, 60.0]) == [0, 0, 1, 1, 1, 1]
    times = [r["time"] for r in report.run_time(rows, [20.0, 60.0])]
    assert times == [0.5, 0.9, 21.5, 21.6, 21.7, 50.0]


def test_a_learners_rows_going_back_in_time_open_the_next_attempt():
    """One thread writes a learner's rows: a row earlier than the one before it is a new
    attempt's, however small the step back; rows of two learners may interleave out of order
    by a little within one attempt."""
    rows = [_row(1, 5.0, 0), _row(1, 4.9, 1), _row(2, 6.0, 0), _row(3, 5.5, 0), _row(4, 7.0, 0)]
    assert report.attempt_of(rows) == [0, 0, 0, 1, 1]
    assert [r["time"] for r in report.run_time(rows)] == [5.0, 4.9, 6.0, 11.5, 13.0]


def test_records_carry_their_attempt_and_the_report_reads_it(tmp_path):
    """A run's records carry the attempt that wrote them (RunLog), which the report takes as
    it is: here attempt 1's first records come at times attempt 0 also reached, with no pid
    and no syncer restore to tell them apart, where the markers alone would keep them in
    attempt 0."""
    from decoupled_diloco.runtime import accounting
    from decoupled_diloco.runtime.records import RunLog

    for k in (0, 1):
        log = RunLog(str(tmp_path), accounting.Ledger(1), attempt=k)
        log.row(_row(1 + 4 * k, 2.0 + k))
        log.record({**_merge(3.0), "c_steps": [4], "steps": [4 + 4 * k], "fragment": 0,
                    "version": 1 + k})  # fmt: skip
        log.event({"event": "join", "learner": 0, "time": 4.0})
        log.close()
    for name in ("metrics", "merges", "events"):
        rows = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert [r["attempt"] for r in rows] == [0, 1], name
        assert report.attempt_of(rows, [10.0, 10.0]) == [0, 1], name
    _write(tmp_path / "attempts.jsonl", [_attempt(0, 100, 10.0, False),
                                        _attempt(1, 200, 10.0, True)])  # fmt: skip
    metrics, merges, events = report.run_records(str(tmp_path))
    assert [r["time"] for r in merges] == [3.0, 13.0]
    assert [r["time"] for r in events] == [4.0, 14.0]


def test_the_tables_learner_rate_is_the_median_of_its_rows(tmp_path):
    """A learner's rows cover equal steps over unequal times (the first holds compilation,
    one after a crash its restart): their mean rate weighed the fast rows too much (7,616
    against 2,853 tokens over time)."""
    rates = [150.0, 9000.0, 10000.0, 11000.0, 700.0, 10000.0, 40000.0]
    _write(tmp_path / "metrics.jsonl", [{**_row(i + 1, float(i)), "tokens_per_second": r}
                                        for i, r in enumerate(rates)])  # fmt: skip
    (line,) = [x for x in report.table(str(tmp_path)).splitlines() if x.startswith("| 0 |")]
    assert "| 10,000 |" in line, line
