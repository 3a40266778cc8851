"""What loading Θ says of the syncer checkpoints it passed over (loading.py `_syncer_theta`)."""

import logging
import shutil

import pytest

import decoupled_diloco
from decoupled_diloco import config as config_lib
from decoupled_diloco.fragment_checkpoint import MANIFEST
from decoupled_diloco.runtime import launch


@pytest.fixture(scope="module")
def decoupled_run(tmp_path_factory):
    """A one-learner Decoupled run keeping two syncer saves."""
    from conftest import _small_config

    cfg = _small_config(**{"train.steps": 8, "diloco.learners": 1, "diloco.sync_every": 2,
                           "diloco.fragments": 1, "diloco.overlap": 0,
                           # a save every merge or so: two kept, however fast the run
                           "diloco.syncer_checkpoint_seconds": 0.2,
                           "diloco.syncer_checkpoint_duty": 1.0})  # fmt: skip
    workdir = tmp_path_factory.mktemp("runs") / "dec"
    launch.run(config_lib.validate(cfg), str(workdir), verbose=False)
    saves = sorted(int(p.name) for p in (workdir / "checkpoints" / "syncer_0").iterdir())
    assert len(saves) >= 2, saves
    return workdir, saves


@pytest.mark.slow
def test_an_unreadable_older_save_is_not_named_as_a_newer_one_refused(
    decoupled_run, tmp_path, caplog
):
    """The newest save was used, yet the source read "[1 newer refused: <the older one>]"
    and a warning said "checkpoint refused, an older one is used"."""
    workdir, saves = decoupled_run
    copy = tmp_path / "dec"
    shutil.copytree(workdir, copy)
    (copy / "checkpoints" / "syncer_0" / str(saves[0]) / MANIFEST).write_text("garbage")
    with caplog.at_level(logging.WARNING):
        model = decoupled_diloco.load(str(copy))
    assert model.source.startswith(f"syncer checkpoints #{saves[-1]} ")
    assert "refused" not in model.source and "refused" not in caplog.text, model.source
    # The newest damaged instead: it was passed over, and the source says so.
    shutil.rmtree(copy)
    shutil.copytree(workdir, copy)
    (copy / "checkpoints" / "syncer_0" / str(saves[-1]) / MANIFEST).write_text("garbage")
    model = decoupled_diloco.load(str(copy))
    assert model.source.startswith(f"syncer checkpoints #{saves[-2]} ")
    assert "[1 newer refused: " in model.source and f"/{saves[-1]}/" in model.source
