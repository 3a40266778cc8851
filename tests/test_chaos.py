"""Chaos runs of the local runtime: learner crash, scavenging, syncer crash, Decoupled vs DP.

Faults are scheduled in training steps (`faults.unit = "steps"`) and runs end at a step
budget, so a loaded machine runs the same scenario, only slower: a crash hits the same
step, the scavenged learner's window spans the same steps, the syncer dies at the same
point of training. Only the restart delays are wall seconds. A module fixture first runs
the configuration until every learner has taken a step, which fills the persistent
compilation cache. Learners sleep 2/3 of each step (a speed factor) to leave the CPU to
others. ~90 s in all on a quiet machine. Same-seed determinism of the fault timeline is
covered in test_faults.py.
"""

import json
import os
import threading
import time

import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.runtime.local import LocalRuntime
from decoupled_diloco.train.optimizer import TrainConfig

# Minutes of CPU in all: the default suite skips them, CI runs them (-m "slow or ray").
pytestmark = pytest.mark.slow

STEPS = 80  # every run's step budget
CRASH_STEP, RESTART_DELAY = 20, 3.0  # learner 0 crashes after its step 20, is back 3 s later
JOIN_STEP, LEAVE_STEP = 10, 50  # learner 2's membership window, in the run's lead step
P = 4  # fragments; with H = P one is due every step, so merges come every step
SYNCER_CRASH_STEP, SYNCER_DELAY = 40, 4.0  # after its checkpoints (every half second)


def tiny_config(learners: int = 2, **faults):
    c = config_lib.default_config()
    c.name = "chaos_test"
    c.model.preset = "tiny"
    c.data.seq_len = 64
    c.data.max_corpus_bytes = 300_000
    c.train.batch_size = 8
    c.train.steps = STEPS
    c.train.warmup_steps = 5
    c.train.eval_every = 0
    c.train.eval_batches = 2
    c.train.log_every = 1
    c.train.checkpoint_every = 0
    c.devices_per_learner = 4  # two device groups; a third learner shares the first
    c.diloco.learners = learners
    if learners > 1:
        c.diloco.sync_every = P  # H
        c.diloco.fragments = P
        c.diloco.overlap = 1  # tau
        c.diloco.quorum = 1  # K
    c.faults.speed_factors = [3.0] * learners  # sleep 2/3 of every step
    c.faults.unit = "steps"
    for k, v in faults.items():
        c.faults[k] = v
    return c


def run(c, workdir, until=None) -> dict:
    """Runs to the step budget, or until `until(runtime)` holds (then stops the learners
    as at a step budget)."""
    rt = LocalRuntime(config_lib.validate(c), str(workdir), verbose=False)

    def stopper():
        while rt.t0 == 0.0:  # the clock starts once everything is built
            time.sleep(0.05)
        while not rt.stop.wait(0.05):
            if until(rt):
                rt.stop.set()

    if until is not None:
        threading.Thread(target=stopper, daemon=True).start()
    summary = rt.run()

    def rows(name):
        with open(os.path.join(workdir, name), encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    return dict(
        summary=summary,
        events=rows("events.jsonl"),
        merges=rows("merges.jsonl"),
        metrics=rows("metrics.jsonl"),
    )


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """Compiles every learner mesh's train step and the evaluator (persistent cache)."""
    run(
        tiny_config(),
        tmp_path_factory.mktemp("warmup"),
        until=lambda rt: all(lp.step >= 1 for lp in rt.loops),
    )


@pytest.fixture(scope="module")
def learner_crash(warm, tmp_path_factory):
    # Learner 0 crashes; learner 2 is scavenged capacity, a member only while the run goes
    # from step 10 to step 50 (it shares learner 0's devices, so learner 1 is the fastest).
    c = tiny_config(
        learners=3,
        crashes=[[0, CRASH_STEP]],
        restart_delay_s=RESTART_DELAY,
        membership=[[2, JOIN_STEP, LEAVE_STEP]],
    )
    return run(c, tmp_path_factory.mktemp("decoupled_crash"))


@pytest.fixture(scope="module")
def dp_crash(warm, tmp_path_factory):
    # One learner, no syncer; it restarts from its last checkpoint, so the steps since
    # that checkpoint are lost as well as the restart delay.
    c = tiny_config(learners=1, crashes=[[0, CRASH_STEP]], restart_delay_s=RESTART_DELAY)
    c.train.checkpoint_every = 15
    c.train.steps = 60
    return run(c, tmp_path_factory.mktemp("dp_crash"))


def only(events, kind, **match):
    return [e for e in events if e["event"] == kind and all(e[k] == v for k, v in match.items())]


def lead_step_by(out: dict, t: float) -> int:
    """The highest step the learners' rows had reported by time t (rows come
    train.metrics_lag steps late)."""
    return max((r["step"] for r in out["metrics"] if r["learner"] != "global" and r["time"] <= t),
               default=0)  # fmt: skip


def test_killed_learner_rejoins_and_merges_continue_while_it_is_down(learner_crash):
    events, merges = learner_crash["events"], learner_crash["merges"]
    (down,) = only(events, "learner_down", learner=0)
    (back,) = only(events, "rejoin", learner=0)
    assert down["step"] == CRASH_STEP  # the step the schedule gave, on any host
    assert back["time"] >= down["time"] + RESTART_DELAY
    assert back["step"] == down["step"]  # it resumes its data stream where it stopped

    # K = 1: the others keep the global model moving while learner 0 is down (every step
    # of theirs offers a fragment, so merges come at their pace, however slow it is)...
    during = [r for r in merges if down["time"] + 0.5 < r["time"] < back["time"]]
    rows_1 = [r for r in learner_crash["metrics"] if r["learner"] == 1]
    n = sum(down["time"] + 0.5 < r["time"] < back["time"] for r in rows_1)
    assert n >= 3, f"learner 1 took {n} steps in learner 0's {RESTART_DELAY} s outage"
    assert len(during) >= min(3, n - 1)
    # (an offer it made before the crash may still ride along with a later round)
    assert all(
        s <= down["step"]
        for r in during
        for m, s in zip(r["learners"], r["steps"], strict=True)
        if m == 0
    )
    assert sum(0 not in r["learners"] for r in during) >= 2
    # ...and the restarted learner contributes to merges again.
    assert any(0 in r["learners"] for r in merges if r["time"] > back["time"])

    # It restarted from the global parameters, not from scratch: its first loss after the
    # rejoin is closer to the trained model's than to a freshly initialised one's.
    rows = learner_crash["metrics"]
    initial = [r["loss"] for r in rows if r["learner"] == 0][0]
    after = [r["loss"] for r in rows if r["learner"] == 0 and r["time"] > back["time"]]
    peer = [r["loss"] for r in rows if r["learner"] == 1 and r["time"] <= back["time"]][-1]
    assert after and after[0] < (initial + peer) / 2

    s = learner_crash["summary"]
    assert s["failures"] == 1 and s["restarts"] == 1
    assert s["rejected_offers"] == 0
    assert np.isfinite(s["final_eval_loss"])


def test_decoupled_goodput_beats_data_parallel_under_the_same_crash(learner_crash, dp_crash):
    dec, dp = learner_crash["summary"], dp_crash["summary"]
    assert dp["failures"] == 1 and dp["restarts"] == 1
    (dp_down,) = only(dp_crash["events"], "learner_down", learner=0)
    (dp_back,) = only(dp_crash["events"], "rejoin", learner=0)
    # DP resumes from its last checkpoint: the steps since then are redone.
    assert dp_down["step"] == CRASH_STEP and dp_back["step"] == 15

    # Downtime in the run's own time scale: Decoupled does not stop while another learner
    # trains (a loaded host's slow steps are not downtime), DP is down for its whole
    # restart and then some (restore, first step).
    (back,) = only(learner_crash["events"], "rejoin", learner=0)
    rows = learner_crash["metrics"]
    last_1 = max(r["time"] for r in rows if r["learner"] == 1)
    if last_1 > back["time"]:  # learner 1 trained through learner 0's outage
        # Nothing stopped for the outage (3 s). A stall of learner 1 longer than the
        # tolerance (2H median steps, ~0.5 s here) while learner 0 is down does count
        # (accounting rule b cannot tell it from an outage): a loaded 2-core host has
        # shown one of 0.47 s, so allow less than half the outage, never all of it.
        assert dec["global_downtime_seconds"] < RESTART_DELAY / 2
        assert dec["uptime"] > dp["uptime"]
    else:  # (a fast host) it finished meanwhile: nobody trained until learner 0 was back.
        # That gap is downtime only if longer than the tolerance in median step times, which
        # a loaded host's slow steps stretch (runtime/accounting.py, rule b): 0 is allowed.
        after = min(r["time"] for r in learner_crash["merges"] if r["time"] > back["time"])
        assert 0.0 <= dec["global_downtime_seconds"] <= after - last_1 + 1.0
    assert dp["global_downtime_seconds"] >= RESTART_DELAY
    assert dp["uptime"] < 1.0
    assert dec["goodput"] > dp["goodput"]


@pytest.mark.parametrize("local_syncer", ["thread", "process"])
def test_syncer_restores_from_checkpoint_and_learners_never_block(warm, tmp_path, local_syncer):
    c = tiny_config(syncer_crashes=[SYNCER_CRASH_STEP], syncer_restart_delay_s=SYNCER_DELAY)
    c.local_syncer = local_syncer  # the outage is emulated inside the syncer's process too
    c.train.eval_every = 5  # Θ is evaluated while the syncer is down too: deferred, no crash
    c.diloco.syncer_checkpoint_seconds = 0.5  # checkpoints well before the crash step
    c.diloco.syncer_checkpoint_duty = 1.0  # every period, however long saves take when loaded
    out = run(c, tmp_path)
    events, merges = out["events"], out["merges"]
    (crash,) = only(events, "syncer_crash")
    restores = [e for e in only(events, "syncer_restore") if e["time"] > crash["time"]]
    assert len(restores) == 1
    restore = restores[0]
    # It died when the lead learner had completed step 40 (rows are reported
    # train.metrics_lag steps late); its loop noticed at its next turn, not before.
    lag = c.train.metrics_lag
    assert SYNCER_CRASH_STEP - lag <= lead_step_by(out, crash["down_since"]) <= SYNCER_CRASH_STEP
    assert crash["down_since"] <= crash["time"] < crash["down_since"] + 1.0
    # (its thread notices the outage at its next turn, up to a second late when loaded)
    assert restore["time"] >= crash["time"] + SYNCER_DELAY - 1.0
    restored = {int(p): v for p, v in restore["versions"].items()}

    # The checkpoint held real progress, no later than what had been merged before the crash.
    before = [r for r in merges if r["time"] < crash["time"]]
    assert sum(restored.values()) > 0
    for p, v in restored.items():
        assert v <= max((r["version"] for r in before if r["fragment"] == p), default=0)
    # Nothing merges while the syncer is down; afterwards every fragment continues from
    # exactly the version it had checkpointed.
    assert not [r for r in merges if crash["time"] < r["time"] < restore["time"]]
    for p, v in restored.items():
        later = [r["version"] for r in merges if r["fragment"] == p and r["time"] > restore["time"]]
        assert later and later[0] == v + 1 and later == sorted(later)

    # Learners were never blocked: they stepped on at their usual pace during the downtime.
    steps_during = []
    for m in range(2):
        rows = [r for r in out["metrics"] if r["learner"] == m]
        t = np.array([r["time"] for r in rows])
        down = (t > crash["time"]) & (t < restore["time"])
        expected = len(t) / (t[-1] - t[0]) * (restore["time"] - crash["time"])
        assert down.sum() >= max(2, 0.3 * expected), f"learner {m} stalled without the syncer"
        steps_during.append(int(down.sum()))

    # The restored syncer is a new life: its versions re-use numbers of the lost one, so its
    # merges carry a new epoch, and offers anchored on the lost life are dropped, not
    # merged and not counted as bad offers.
    assert restore["epoch"] not in {r["epoch"] for r in before}
    assert all(r["epoch"] == restore["epoch"] for r in merges if r["time"] > restore["time"])
    # Its log position counts the records the syncer had emitted by its checkpoint.
    syncer_events = [
        e
        for e in events
        if e["event"] in ("join", "leave", "reject", "drop_offer", "drop_message")
        and e["time"] < crash["time"]
    ]
    assert len(only(events, "join")) < restore["log_position"] <= len(before) + len(syncer_events)
    # The lost life's merges after its checkpoint no longer count: Θ lost them.
    rolled = [r for r in before if r["version"] > restored[r["fragment"]]]
    assert out["summary"]["rolled_back_merges"] == len(rolled)
    assert out["summary"]["merges"] == len(merges) - len(rolled)
    # Evaluations of Θ went on around the outage (none while Θ was partly gone).
    evals = [r["time"] for r in out["metrics"] if r["learner"] == "global"]
    assert any(t < crash["time"] for t in evals) and any(t > restore["time"] for t in evals)

    # The outage is the run's downtime: at least its length, at most the gap between the
    # merges around it (nothing else of this fault-free-otherwise run counts, loaded or not).
    s = out["summary"]
    gap = min(r["time"] for r in merges if r["time"] > restore["time"]) - max(
        r["time"] for r in before
    )
    # Time after the learners' last step is not downtime (the tail of a run): on a fast host
    # the learners finish their budget while the syncer is still down.
    last_step = max(r["time"] for r in out["metrics"] if r["learner"] in (0, 1))
    seen = min(SYNCER_DELAY, last_step - crash["time"]) - 0.5  # rows come a few steps late
    if all(n > 2 * P for n in steps_during):  # longer than the tolerance: seen
        assert seen <= s["global_downtime_seconds"] <= gap + 1e-9
    else:  # a host so slow that the outage lasted less than two sync periods of steps
        assert s["global_downtime_seconds"] == 0.0
    assert s["failures"] == 1 and s["restarts"] == 1
    assert s["rejected_offers"] == 0
    assert os.path.isdir(os.path.join(tmp_path, "checkpoints", "syncer_0"))
    assert np.isfinite(s["final_eval_loss"])


def test_scavenged_learner_joins_late_leaves_cleanly_and_the_run_ends(learner_crash):
    # Learner 2 starts from the global model when its membership begins, makes its final
    # offers when preempted, and never comes back (its step budget unfinished).
    events, merges, rows = (
        learner_crash["events"],
        learner_crash["merges"],
        learner_crash["metrics"],
    )
    (joined,) = only(events, "member_join", learner=2)
    (left,) = only(events, "learner_leave", learner=2)
    assert joined["time"] < left["time"]
    # Its window follows the run's lead step (rows are reported train.metrics_lag late), and
    # the syncer got its Join soon after the window opened.
    (registered,) = only(events, "join", learner=2)
    lag, opened = TrainConfig().metrics_lag, joined["window_opened"]
    assert JOIN_STEP - lag <= lead_step_by(learner_crash, opened) <= JOIN_STEP
    assert opened <= registered["time"] < opened + 1.0
    # It stops stepping at once: `learner_leave` (when it stopped; its final offers and Leave
    # take a while longer) comes after the window closed, and at most one of its own steps
    # after those it had dispatched when the lead's row of step 50 came (rows come `lag`
    # steps late; counted in its own steps, because the first steps of a joining learner
    # may take seconds on a loaded host, while the lead moves on).
    assert lead_step_by(learner_crash, left["time"]) >= LEAVE_STEP - lag
    closed = min(r["time"] for r in rows if r["learner"] != 2 and r["step"] >= LEAVE_STEP)
    reported = [r["step"] for r in rows if r["learner"] == 2 and r["time"] <= closed]
    assert left["step"] <= max(reported, default=0) + lag + 1
    # Its own step count is not the lead's: on a loaded host the scheduler may run it faster
    # than the lead for a while. What matters is that it left with its budget unfinished.
    assert 0 < left["step"] < STEPS
    assert not only(events, "learner_down", learner=2) and not only(events, "rejoin", learner=2)
    contributed = [r["time"] for r in merges if 2 in r["learners"]]
    assert contributed and min(contributed) > joined["time"]
    # After it stopped: the offers it had in flight, then its final ones (one per fragment each).
    assert len([t for t in contributed if t > left["time"]]) <= 2 * P
    # The others kept training and merging after it left, to the end of the run.
    assert any(max(r["steps"]) > LEAVE_STEP + 5 for r in merges if r["time"] > left["time"])
    last = {m: max((r["time"], r["step"]) for r in rows if r["learner"] == m) for m in range(3)}
    assert last[0][1] == last[1][1] == STEPS
    assert last[2][1] == left["step"]


def test_a_crash_with_no_restart_delay_hits_its_own_step(warm, tmp_path):
    """restart_delay_s = 0 leaves an empty outage; the crash still happens after the step
    the schedule names (it used to land one step later, when the next poll saw it)."""
    c = tiny_config(learners=1, crashes=[[0, 5]], restart_delay_s=0.0)
    c.train.steps, c.train.checkpoint_every = 12, 3
    out = run(c, tmp_path)
    (down,) = only(out["events"], "learner_down", learner=0)
    (back,) = only(out["events"], "rejoin", learner=0)
    assert down["step"] == 5 and back["step"] == 3  # from its checkpoint of step 3
    assert out["summary"]["steps"] == 12


def test_data_parallel_stopped_while_down_ends_with_what_survives(warm, tmp_path):
    """A step budget or wall-clock cap that stops a data-parallel job during its outage:
    the model is its last checkpoint's, and with none the initial one (it used to fail on
    a state that no longer existed)."""
    c = tiny_config(learners=1, crashes=[[0, 4]], restart_delay_s=300.0)
    c.train.steps = 40
    out = run(c, tmp_path, until=lambda rt: rt.loops[0].incarnation > 0)  # once it is down
    summary = out["summary"]
    assert summary["steps"] == 0 and summary["tokens"] == 0  # no checkpoint: nothing survives
    assert np.isfinite(summary["final_eval_loss"]) and summary["failures"] == 1


@pytest.mark.slow
def test_a_crash_and_a_syncer_restore_count_each_lost_step_once(warm, tmp_path):
    """Learner 0 crashes at step 10 and the syncer dies before its first checkpoint, so
    the restore rolls back every merge, among them merges of learner 0's work it had not
    applied yet (τ = 3). Each step a learner trained is held by Θ, rolled back
    (`syncer_lost_steps`) or lost to the crash, exactly once: the crash counted the steps
    of those merges again (24 steps trained, 28 accounted for)."""
    c = tiny_config(learners=2, crashes=[[0, 10]], syncer_crashes=[12], restart_delay_s=2.0,
                    syncer_restart_delay_s=0.5)  # fmt: skip
    c.train.steps = 24
    c.diloco.sync_every, c.diloco.fragments, c.diloco.overlap = 4, 1, 3
    c.diloco.syncer_checkpoint_seconds = 1000.0  # none before the crash
    c.faults.speed_factors = [1.0, 2.5]
    out = run(c, tmp_path)
    (restore,) = [e for e in only(out["events"], "syncer_restore") if e.get("after_failure")]
    assert {int(p): v for p, v in restore["versions"].items()} == {0: 0}
    lost = {0: 0, 1: 0}
    for e in out["events"]:
        if e["event"] in ("rejoin", "resume_cut", "member_join"):
            lost[e["learner"]] += e.get("lost_steps", 0)
    rolled_back = {0: 0, 1: 0}
    for m in (0, 1):
        held = 0
        for r in out["merges"]:
            steps = sum(c for mm, c in zip(r["learners"], r["c_steps"], strict=True) if mm == m)
            if r["time"] < restore["time"]:
                rolled_back[m] += steps
            else:
                held += steps
        assert held + rolled_back[m] + lost[m] == 24, (m, held, rolled_back[m], lost[m])
    assert rolled_back[0] > 0 and lost[0] > 0
    summary = out["summary"]
    assert summary["syncer_lost_steps"] == sum(rolled_back.values())
    assert summary["crash_lost_steps"] == lost[0] + lost[1]


def test_crashes_with_no_merge_between_them_count_each_lost_step_once(warm, tmp_path):
    """Each `rejoin` reports the steps its crash lost: those of the life that crashed. A
    second crash before any of the learner's work was merged reported the first life's
    steps again (lost_steps 2, then 5, for 5 steps missing from Θ)."""
    c = tiny_config(learners=2, crashes=[[1, 2], [1, 5]], restart_delay_s=0.3)
    c.train.steps = 20
    c.diloco.sync_every, c.diloco.fragments, c.diloco.overlap = 8, 1, 0
    c.faults.speed_factors = [1.0, 1.0]
    out = run(c, tmp_path)
    backs = only(out["events"], "rejoin", learner=1)
    assert [b["lost_steps"] for b in backs] == [2, 3]  # steps 0-2, then 2-5
    for m in (0, 1):
        merged = sum(
            c
            for r in out["merges"]
            for mm, c in zip(r["learners"], r["c_steps"], strict=True)
            if mm == m
        )
        assert 20 - merged == sum(b["lost_steps"] for b in only(out["events"], "rejoin", learner=m))
    assert out["summary"]["crash_lost_steps"] == 5
