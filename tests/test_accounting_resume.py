"""A resumed data-parallel attempt's goodput: the steps it took past its checkpoint that a
crash's restore threw away are not useful, however many steps the run ends with."""

import math

import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.runtime import accounting
from decoupled_diloco.runtime.local import LocalRuntime


def test_a_resumed_data_parallel_attempt_counts_only_the_steps_that_survive():
    ledger = accounting.Ledger(1)  # data-parallel: no syncer
    t = 0.0
    # Resumed at step 20: steps 21..35, a crash back to the checkpoint of step 30, 31..40.
    for _ in range(15 + 10):
        t += 1.0
        ledger.step(0, 1.0, t)
        ledger.advance(t)
    ledger.finish(0, t)
    out = ledger.summary(t, False, [40], start_steps=[20])
    # 25 step-seconds allocated, the 20 of steps 21..40 useful (not min(40, 25) = 25).
    assert abs(out["goodput"] - 20 / 25) < 1e-9, out["goodput"]
    # Without a start, a run from step 0: all 40 steps are its own.
    assert ledger.summary(t, False, [25])["goodput"] == 1.0


@pytest.mark.slow
def test_a_resumed_run_passes_where_its_attempt_began(small_config, tmp_path):
    cfg = small_config(**{"train.steps": 40, "train.checkpoint_every": 10})
    cfg.faults.unit = "steps"
    cfg.faults.crashes = [[0, 39]]  # back to step 30's checkpoint: steps 31..39 lost
    cfg.faults.restart_delay_s = 0.0
    cfg = config_lib.validate(cfg)
    LocalRuntime(cfg, str(tmp_path), verbose=False, halt_after=20).run()
    rt = LocalRuntime(cfg, str(tmp_path), verbose=False)
    summary = rt.run()
    ledger = rt.log.ledger
    assert rt.start_steps == [20] and ledger.steps == [19 + 10]
    allocated = ledger.finished[0] - ledger.started[0] - ledger.idle_seconds[0]
    useful = 20 * ledger.step_seconds[0] / ledger.steps[0]  # steps 21..40
    assert math.isclose(summary["goodput"], useful / allocated, rel_tol=1e-9), summary["goodput"]
