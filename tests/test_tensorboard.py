"""TensorBoard event files beside metrics.jsonl: written without TensorFlow, read back by
TensorBoard's own reader, and holding exactly the JSONL's numbers."""

import glob
import json
import math
import os
import pathlib

import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco import tensorboard_events as tbe
from decoupled_diloco.runtime import accounting
from decoupled_diloco.runtime.local import LocalRuntime
from decoupled_diloco.runtime.records import RunLog


def test_crc32c_and_records_follow_the_tfrecord_format(tmp_path):
    assert tbe.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    f = tbe.EventFile(tmp_path)
    f.scalars(7, {"loss": 1.5, "tokens": 4096.0})
    f.scalars(-1, {"x": math.inf})
    f.close()
    (path,) = glob.glob(str(tmp_path / "events.out.tfevents.*"))
    assert tbe.read_scalars(path) == [(7, "loss", 1.5), (7, "tokens", 4096.0), (-1, "x", math.inf)]
    raw = bytearray(pathlib.Path(path).read_bytes())
    raw[-5] ^= 1  # one flipped bit in the last record's payload
    pathlib.Path(path).write_bytes(raw)
    with pytest.raises(ValueError, match="bad data CRC"):
        tbe.read_scalars(path)


def test_tensorboard_itself_reads_the_files(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator as accumulator

    w = tbe.RunWriter(tmp_path)
    for step in (1, 2, 3):
        w.row({"learner": 0, "step": step, "loss": 1.0 / step, "ok": True, "note": "x"})
    w.row({"learner": "global", "step": 3, "eval_loss": 0.25})
    w.close()
    runs = sorted(os.listdir(tmp_path / "tensorboard"))
    assert runs == ["global", "learner_0"]
    acc = accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "learner_0")).Reload()
    assert acc.Tags()["scalars"] == ["loss"]  # numbers only: not the bool, not the text
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (1, 1.0), (2, 0.5), (3, np.float32(1 / 3))
    ]  # fmt: skip
    acc = accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "global")).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval_loss")] == [(3, 0.25)]


def test_a_value_past_float32_is_its_signed_inf_and_the_file_goes_on(tmp_path):
    """TensorBoard's scalars are float32: a row's float64 field past that range (1e300)
    raised OverflowError in the thread writing the row, and the row was lost with it."""
    from tensorboard.backend.event_processing import event_accumulator as accumulator

    w = tbe.RunWriter(tmp_path)
    w.row({"learner": 0, "step": 1, "ppl": 1e300, "low": -1e300, "top": 3.4028234663852886e38})
    w.row({"learner": 0, "step": 2, "ppl": 5.0, "low": -1.0, "top": 1.0})
    w.close()
    acc = accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "learner_0")).Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in ("ppl", "low", "top")}
    assert got == {
        "ppl": [(1, math.inf), (2, 5.0)],
        "low": [(1, -math.inf), (2, -1.0)],
        "top": [(1, np.float32(3.4028234663852886e38)), (2, 1.0)],  # the largest float32 stays
    }


def test_the_steps_a_resume_redoes_are_drawn_once(tmp_path):
    """A resumed run (a new process, new files) logs again the steps past its checkpoints,
    and a restarted Ray learner process those past its restore: TensorBoard drew both
    points of each such step. Its first row, and a step back, now come after a SessionLog
    START, at which TensorBoard drops the older points."""
    from tensorboard.backend.event_processing import event_accumulator as accumulator

    w = tbe.RunWriter(tmp_path)
    for step in [*range(1, 11), 8, 9]:  # a restart within the process: back to 8
        w.row({"learner": 0, "step": step, "loss": float(step)})
    w.close()
    for _ in range(12):  # more files of this process than one digit counts (name order)
        tbe.EventFile(tmp_path / "elsewhere").close()
    w = tbe.RunWriter(tmp_path)  # the resume, from step 6
    for step in range(6, 13):
        w.row({"learner": 0, "step": step, "loss": 100.0 + step})
    w.close()
    acc = accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "learner_0")).Reload()
    drawn = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert drawn == [(s, float(s)) for s in range(1, 6)] + [(s, 100.0 + s) for s in range(6, 13)]


def _events(workdir, run: str) -> dict[tuple[int, str], float]:
    out = {}
    for path in sorted(glob.glob(os.path.join(workdir, "tensorboard", run, "events.out.*"))):
        out.update({(step, tag): value for step, tag, value in tbe.read_scalars(path)})
    return out


@pytest.mark.slow
def test_a_run_writes_per_learner_and_global_scalars_equal_to_its_jsonl(small_config, tmp_path):
    cfg = small_config(
        **{
            "diloco.learners": 2,
            "diloco.sync_every": 4,
            "diloco.fragments": 2,
            "train.steps": 8,
            "train.eval_every": 4,
        }
    )
    LocalRuntime(config_lib.validate(cfg), str(tmp_path), verbose=False).run()
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    for m in (0, 1):
        events = _events(tmp_path, f"learner_{m}")
        losses = {r["step"]: r["loss"] for r in rows if r["learner"] == m}
        assert sorted(losses) == list(range(1, 9))
        for step, loss in losses.items():
            assert events[(step, "loss")] == np.float32(loss)
    evals = {r["step"]: r["eval_loss"] for r in rows if r["learner"] == "global"}
    events = _events(tmp_path, "global")
    # The final evaluation always exists; mid-run ones depend on the host's pace.
    assert len(evals) >= 1 and {k: v for k, v in events.items() if k[1] == "eval_loss"} == {
        (step, "eval_loss"): np.float32(loss) for step, loss in evals.items()
    }


def test_tensorboard_can_be_switched_off(small_config, tmp_path):
    log = RunLog(str(tmp_path), accounting.Ledger(1), tensorboard=False)
    log.row({"learner": 0, "step": 1, "loss": 2.0})
    log.close()
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()
    assert config_lib.validate(small_config()).train.tensorboard  # on by default
    with pytest.raises((TypeError, ValueError), match="tensorboard"):  # a bool or nothing
        config_lib.validate(small_config(**{"train.tensorboard": 1}))
