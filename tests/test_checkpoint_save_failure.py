"""A save that cannot be written (a full disk, a file-size limit, a read-only folder) fails
with one error naming the folder, the step, the OS's reason and what to do; the step is not
kept, its half-written folder is gone, and the step before stays the latest."""

import os
import resource
import signal

import jax.numpy as jnp
import numpy as np
import pytest

from decoupled_diloco import cli
from decoupled_diloco.checkpoint import Checkpointer, CheckpointSaveError


def _w(seed: int):
    return {"w": jnp.asarray(np.random.default_rng(seed).normal(size=1 << 16), jnp.float32)}


def test_a_save_the_file_system_refuses_fails_by_name_and_keeps_the_step_before(tmp_path):
    d = tmp_path / "learner_0"
    ckpt = Checkpointer(d, max_to_keep=1)
    assert ckpt.save(1, _w(1), {"step": 1})  # also compiles the checksum, before the limit
    # A real failed write: files may grow to 64 KiB, one array needs 256 KiB (EFBIG).
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, old_limit[1]))
    try:
        with pytest.raises(CheckpointSaveError) as e:
            ckpt.save(2, _w(2), {"step": 2})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    message = str(e.value)
    assert message.startswith(f"{d}: saving step 2 failed") and "File too large" in message
    assert "latest saved step is still 1" in message and "disk is full" in message
    # max_to_keep=1 did not prune step 1 for a step that never committed.
    assert ckpt.manager.all_steps() == [1] and os.listdir(d) == ["1"]
    restored, meta = ckpt.restore({"w": np.zeros(1 << 16, np.float32)})
    assert meta["step"] == 1 and restored["w"].tobytes() == np.asarray(_w(1)["w"]).tobytes()
    assert ckpt.save(2, _w(2), {"step": 2})  # with room again the same step saves
    assert ckpt.manager.all_steps() == [2]
    ckpt.close()


def test_a_full_disk_is_not_reported_as_device_memory_running_out(tmp_path, monkeypatch):
    """TensorStore says ENOSPC as `RESOURCE_EXHAUSTED: Failed writing ...` (the text below
    is what orbax raised on a full tmpfs); the entry points took that for XLA running out
    of device memory and told the user to lower the batch size."""
    d = tmp_path / "learner_0"
    ckpt = Checkpointer(d)
    assert ckpt.save(1, _w(1), {"step": 1})

    def disk_full(step, args, force):
        (d / f"{step}.orbax-checkpoint-tmp" / "arrays.orbax-checkpoint-tmp").mkdir(parents=True)
        raise ValueError(
            f'RESOURCE_EXHAUSTED: Failed writing: "{d}/{step}.orbax-checkpoint-tmp/arrays.'
            'orbax-checkpoint-tmp/d/236b7bfa00257a1a7482d29fffd2197f": Failed to write 235 '
            "bytes to file 6: No space left on device [os_error_code='28']"
        )

    monkeypatch.setattr(ckpt.manager, "save", disk_full)
    with pytest.raises(CheckpointSaveError, match="No space left on device") as e:
        ckpt.save(2, _w(2), {"step": 2})
    assert cli.out_of_memory(e.value) is None
    assert f"{d}: saving step 2 failed" in str(e.value)
    assert os.listdir(d) == ["1"]  # the half-written step's disk is given back
