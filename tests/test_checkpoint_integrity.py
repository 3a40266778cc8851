"""Checkpoints are verified on restore: checksums and finite values, a refused step is set
aside and the previous kept step used, and with none good the restore names every file."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from damage import flip_values

from decoupled_diloco import integrity
from decoupled_diloco.checkpoint import Checkpointer, CorruptCheckpointError


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(3, 5, 7)).astype(np.float32),
        "b": rng.normal(size=(11,)).astype(ml_dtypes.bfloat16),
        "count": np.int32(seed),
        "mask": rng.random((4, 4)) > 0.5,
    }


def test_device_and_host_checksums_agree():
    tree = _tree(0)
    host, _ = integrity.digest(tree)
    device, _ = integrity.digest(jax.tree.map(jnp.asarray, tree))
    assert host == device


def test_any_single_changed_word_changes_the_checksum():
    x = np.random.default_rng(1).normal(size=(6, 9)).astype(np.float32)
    base = integrity.digest({"x": x})[0]["x"]
    for i in range(x.size):
        y = x.copy().reshape(-1)
        y.view(np.uint32)[i] ^= np.uint32(1 << (i % 32))  # one flipped bit, anywhere
        assert integrity.digest({"x": y.reshape(x.shape)})[0]["x"] != base, i
    # Two swapped elements (same multiset of words) are caught by the position weights.
    z = x.copy()
    z[0, 0], z[0, 1] = x[0, 1], x[0, 0]
    assert integrity.digest({"x": z})[0]["x"] != base


def test_non_finite_leaves_are_named():
    tree = _tree(0)
    tree["w"][1, 2, 3] = np.nan
    assert integrity.digest(tree)[1] == ["w"]
    assert integrity.digest(jax.tree.map(jnp.asarray, tree))[1] == ["w"]


def _save(directory, step, arrays, meta=None, seal=True):
    """A step written with the manager directly (optionally without checksums)."""
    ckpt = Checkpointer(str(directory), max_to_keep=3)
    if seal:
        assert ckpt.save(step, arrays, meta or {"step": step})
    else:
        import orbax.checkpoint as ocp

        ckpt.manager.save(
            step,
            args=ocp.args.Composite(
                arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta or {})
            ),
        )
        ckpt.manager.wait_until_finished()
    ckpt.close()


def test_a_corrupted_newest_step_falls_back_to_the_previous_kept_step(tmp_path):
    d = tmp_path / "learner_0"
    big = {"w": np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)}
    _save(d, 1, big)
    _save(d, 2, {"w": big["w"] + 1})
    flip_values(d / "2")
    ckpt = Checkpointer(str(d))
    arrays, meta = ckpt.restore({"w": np.zeros((256, 256), np.float32)})
    assert meta["step"] == 1
    np.testing.assert_array_equal(arrays["w"], big["w"])
    [(step, reason, moved)] = ckpt.refused
    assert step == 2 and reason and os.path.isdir(moved)
    assert ckpt.latest_step() == 1  # set aside: a later save of step 2 is a fresh one
    assert ckpt.save(2, {"w": big["w"] * 2}, {"step": 2})
    ckpt.close()


def test_a_refused_step_that_cannot_be_moved_aside_is_deleted(tmp_path, monkeypatch):
    """Left in place it stayed the latest step: the learner skipped saving that step again
    (`save_learner` saw it saved) and orbax's max_to_keep pruned the good step instead."""
    from decoupled_diloco import checkpoint

    def cannot_move(src, dst):
        raise OSError("object store error")

    d = tmp_path / "learner_0"
    big = {"w": np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)}
    _save(d, 1, big)
    _save(d, 2, {"w": big["w"] + 1})
    flip_values(d / "2")
    monkeypatch.setattr(checkpoint.paths, "move_tree", cannot_move)
    ckpt = Checkpointer(str(d))
    _, meta = ckpt.restore({"w": np.zeros((256, 256), np.float32)})
    assert meta["step"] == 1 and [(s, m) for s, _, m in ckpt.refused] == [(2, None)]
    assert ckpt.latest_step() == 1 and not (d / "2").exists()
    for step in (2, 3):
        assert ckpt.save(step, {"w": big["w"] * step}, {"step": step})
    assert ckpt.manager.all_steps() == [2, 3]
    ckpt.close()


def test_readable_but_wrong_values_are_caught_by_the_checksum(tmp_path):
    d = tmp_path / "syncer_0"
    good = {"theta": np.ones((4, 4), np.float32), "version": np.int64(3)}
    _save(d, 1, good)
    # Step 2's side-car promises `good`, its arrays hold something else (finite).
    tampered = {"theta": np.full((4, 4), 1e15, np.float32), "version": np.int64(3)}
    _save(d, 2, tampered, integrity.seal(good, {"step": 2}), seal=False)
    ckpt = Checkpointer(str(d))
    arrays, meta = ckpt.restore(jax.tree.map(np.zeros_like, good))
    assert meta["step"] == 1
    assert "checksum mismatch in theta" in ckpt.refused[0][1]


def test_nan_values_are_refused_even_without_checksums(tmp_path):
    d = tmp_path / "old_format"
    _save(d, 1, {"w": np.zeros(3, np.float32)}, {"step": 1}, seal=False)
    _save(d, 2, {"w": np.array([0.0, np.nan, 1e38], np.float32)}, {"step": 2}, seal=False)
    ckpt = Checkpointer(str(d))
    _, meta = ckpt.restore({"w": np.zeros(3, np.float32)})
    assert meta["step"] == 1 and "non-finite" in ckpt.refused[0][1]


def test_a_non_finite_state_is_not_saved(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "c"))
    assert not ckpt.save(1, {"w": jnp.array([1.0, jnp.inf])}, {"step": 1})
    assert ckpt.latest_step() is None


def test_an_edited_side_car_is_refused(tmp_path):
    d = tmp_path / "learner_1"
    _save(d, 1, {"w": np.zeros(3, np.float32)}, {"step": 1, "data": {"position": 10}})
    _save(d, 2, {"w": np.zeros(3, np.float32)}, {"step": 2, "data": {"position": 20}})
    meta_file = next(
        os.path.join(r, f) for r, _, fs in os.walk(d / "2" / "meta") for f in fs if "meta" in r
    )
    with open(meta_file, encoding="utf-8") as f:
        meta = json.load(f)
    meta["data"]["position"] = 999
    with open(meta_file, "w", encoding="utf-8") as f:
        json.dump(meta, f)
    ckpt = Checkpointer(str(d))
    assert ckpt.restore_meta()["data"]["position"] == 10
    assert "metadata" in ckpt.refused[0][1]


def test_no_good_step_stops_with_every_file_named(tmp_path):
    d = tmp_path / "learner_0"
    w = np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)
    _save(d, 1, {"w": w})
    _save(d, 2, {"w": w})
    flip_values(d / "1")
    flip_values(d / "2")
    ckpt = Checkpointer(str(d))
    for _ in range(2):  # both stay where they are: a retry fails alike, never starts afresh
        with pytest.raises(CorruptCheckpointError) as e:
            ckpt.restore({"w": np.zeros_like(w)})
        assert f"{d}/2:" in str(e.value) and f"{d}/1:" in str(e.value)
        assert str(e.value).endswith("then run the same command again")  # what to do
        assert ckpt.latest_step() == 2 and not ckpt.refused


def test_a_failed_reads_leftovers_are_dropped_and_nothing_else(monkeypatch, caplog):
    """What a failed orbax read leaves behind (a closed loop's callbacks, abandoned tasks)
    does not reach stderr; other unraisable errors and asyncio errors still do."""
    import logging
    import sys
    import types

    from decoupled_diloco import checkpoint

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))
    monkeypatch.setattr(checkpoint, "_QUIET", False)
    checkpoint.quiet_failed_read_leftovers()
    for e in (RuntimeError("Event loop is closed"), RuntimeError("something else")):
        sys.unraisablehook(types.SimpleNamespace(exc_value=e, object=None))
    assert seen == ["something else"]
    # A read coroutine orbax abandoned, closed when collected (tens after a restore into
    # another model's shapes); one of another file still goes through.
    namespace: dict = {}
    for file in ("/x/orbax/checkpoint/_src/serialization/serialization.py", "/x/mine.py"):
        exec(compile("async def read():\n    pass\n", file, "exec"), namespace)
        coro = namespace["read"]()
        sys.unraisablehook(types.SimpleNamespace(exc_value=RuntimeError(file), object=coro))
        coro.close()
    assert seen == ["something else", "/x/mine.py"]
    task = "Task exception was never retrieved\nfuture: <Task finished coro=<{}() defined at {}>>"
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        log = logging.getLogger("asyncio")
        log.error(task.format("async_deserialize", "/x/orbax/checkpoint/serialization.py:394"))
        log.error(task.format("mine", "/x/mine.py:3"))
    assert [r.getMessage().split("coro=<")[1][:4] for r in caplog.records] == ["mine"]
    # A future gathering orbax's reads names no coroutine: its exception's traceback does.
    orbax_file = "/x/orbax/checkpoint/_src/serialization/serialization.py"
    code = compile("raise Exception('Encountered error while reading array index')",
                   orbax_file, "exec")  # fmt: skip
    for where in (code, compile("raise Exception('mine')", "/x/mine.py", "exec")):
        try:
            exec(where)
        except Exception as e:  # noqa: BLE001
            error = e
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            log.error("_GatheringFuture exception was never retrieved\nfuture: <...>",
                      exc_info=(type(error), error, error.__traceback__))  # fmt: skip
    gathering = [r for r in caplog.records if r.getMessage().startswith("_Gathering")]
    assert [str(r.exc_info[1]) for r in gathering] == ["mine"]
    # A TensorStore read's own future: its exception has no traceback, only TensorStore's
    # words (a status code, then the driver that failed); a ValueError of another kind stays.
    store = ValueError('OUT_OF_RANGE: Error opening "cast" driver: Error opening "zarr" driver')
    for error in (store, ValueError("OUT_OF_RANGE: mine")):
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            log.error("Future exception was never retrieved\nfuture: <Future finished>",
                      exc_info=(type(error), error, None))  # fmt: skip
    futures = [r for r in caplog.records if r.getMessage().startswith("Future exception")]
    assert [str(r.exc_info[1]) for r in futures] == ["OUT_OF_RANGE: mine"]
