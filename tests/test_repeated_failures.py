"""runtime/ray/failures.py: a learner failing the same way again and again is stopped; one
whose failures differ, or that trains past the step of its last failure, is not. And each
process Ray restarts is a new life of its learner (runtime/ray/learner.py)."""

import json

import pytest

from decoupled_diloco.config import RayConfig
from decoupled_diloco.runtime import accounting
from decoupled_diloco.runtime.ray import failures
from decoupled_diloco.runtime.records import RunLog

IMPORT = "ModuleNotFoundError: No module named 'sentencepiece'"


def test_signature_ignores_numbers_addresses_and_spacing():
    a = failures.signature("OSError: read 4096 bytes from shard 17 at 0x7f3a2c  failed\n")
    b = failures.signature("OSError: read 812 bytes from shard 3 at 0x55d0 failed")
    assert a == b == "OSError: read # bytes from shard # at @ failed"
    assert failures.signature("OSError: x") != failures.signature("ValueError: x")
    assert failures.signature("ValueError: shard a") != failures.signature("ValueError: shard b")
    assert len(failures.signature("E: " + "x" * 5000)) == failures.SIGNATURE_CHARS


def test_the_same_error_n_times_in_a_row_stops_a_learner():
    rule = failures.RepeatedFailures(3)
    assert not rule.failed(1, IMPORT, 0)
    rule.progressed(1, 0)  # a restarted process that never trained: still the same streak
    assert not rule.failed(1, IMPORT, 0)
    assert not rule.failed(0, IMPORT, 0)  # per learner
    assert rule.failed(1, IMPORT, 0)
    assert rule.streaks[1].count == 3 and rule.streaks[0].count == 1


def test_a_different_error_or_progress_breaks_the_streak():
    rule = failures.RepeatedFailures(2)
    assert not rule.failed(0, "OSError: timeout after 30 s", 500)
    assert not rule.failed(0, "ValueError: bad batch", 400)  # another error: a new streak
    assert not rule.failed(0, "OSError: timeout after 31 s", 420)
    rule.progressed(0, 420)  # not past the last failure: the streak goes on
    rule.progressed(0, 421)  # trained past it: an error that strikes now and then is not fatal
    assert not rule.failed(0, "OSError: timeout after 29 s", 9000)
    # A deterministic failure at a fixed step comes back before the learner gets past it.
    rule.progressed(0, 8800)  # restored from its last checkpoint
    assert rule.failed(0, "OSError: timeout after 29 s", 9000)


def test_zero_never_stops():
    rule = failures.RepeatedFailures(0)
    assert not any(rule.failed(0, IMPORT, 0) for _ in range(100))


def test_config_key_is_validated():
    assert RayConfig().max_same_failures == 3
    with pytest.raises(ValueError, match="ray.max_same_failures"):
        RayConfig(max_same_failures=-1).validate()


def test_a_stopped_learner_is_reported_once_and_counted_out(tmp_path, capsys):
    log = RunLog(str(tmp_path), accounting.Ledger(3))
    fates = failures.LearnerFates(3, 2, -1, log)
    assert not fates.error(2, IMPORT, 0)
    assert fates.error(2, IMPORT, 0)
    fates.remove(2, 0, 12.5, stopped=True)
    fates.remove(2, 0, 13.0, stopped=False, error="ActorDiedError: gone")  # Ray's, later
    assert fates.out == {2} and not fates.error(2, IMPORT, 0)  # out: never stopped twice
    log.close()
    lines = (tmp_path / "events.jsonl").read_text(encoding="utf-8").splitlines()
    events = [json.loads(x) for x in lines]
    assert events == [
        {
            "event": "learner_stopped",
            "learner": 2,
            "step": 0,
            "error": IMPORT,
            "time": 12.5,
            "failures": 2,
        }
    ]
    err = capsys.readouterr().err
    assert "learner 2 failed 2 times in a row with the same error" in err
    assert "ray.max_same_failures=2" in err and "goes on with 2 learners" in err
    assert log.ledger.failures == 1


def test_every_process_of_a_learner_gets_a_fresh_incarnation_on_any_node(tmp_path):
    # Nothing node-local: a learner Ray restarts on another node (its own died) must not
    # reuse the incarnation of the process it replaces, nor of any earlier one.
    from decoupled_diloco.runtime.lives import next_life

    ckpt = str(tmp_path / "checkpoints")
    lives = [next_life(ckpt, 1, 0, floor=0) for _ in range(3)]
    assert lives == [0, 1, 2]
    assert next_life(ckpt, 1, 0, floor=7) == 7  # its checkpoint's incarnation is ahead
    assert next_life(ckpt, 1, 0, floor=0) == 8
    assert next_life(ckpt, 0, 0, floor=0) == 0  # per learner (and per host of its slice)
    assert next_life(ckpt, 1, 1, floor=0) == 0
