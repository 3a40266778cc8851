"""An exported model whose files are damaged is refused by name, as a run's checkpoints are."""

import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import decoupled_diloco
from decoupled_diloco import config as config_lib
from decoupled_diloco import loading, models
from decoupled_diloco.checkpoint import CorruptCheckpointError
from decoupled_diloco.data.tokenizer import ByteTokenizer
from decoupled_diloco.export import export


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An export of a freshly initialised tiny model (what it holds does not matter here)."""
    from conftest import _small_config

    run = config_lib.validate(_small_config())
    params = models.flatten_params(models.init_params(run.model, jax.random.key(0)))
    model = loading.Model(run, ByteTokenizer(), jax.tree.map(np.asarray, params), "test", 2)
    out = tmp_path_factory.mktemp("export") / "model"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "load", lambda path, step=None: model)
        export("unused", str(out))
    return out


def _damage_metadata(export_dir) -> None:
    """Bad bytes in the middle of the parameters' orbax metadata (a JSON file)."""
    (path,) = (export_dir / "params" / "0" / "arrays").glob("_METADATA")
    with open(path, "r+b") as f:
        f.seek(f.seek(0, 2) // 2)
        f.write(b"\xff" * 64)


def test_an_export_with_damaged_metadata_is_refused_naming_it(exported, tmp_path):
    """Orbax's read failed with "'utf-8' codec can't decode byte 0xff in position 2106",
    naming neither the export nor the damage; every model tool printed only that."""
    assert decoupled_diloco.load(str(exported)).step == 2  # (intact, it loads)
    damaged = tmp_path / "model"
    shutil.copytree(exported, damaged)
    _damage_metadata(damaged)
    why = rf"{damaged}/params/0 cannot be read \(UnicodeDecodeError: .*\): the export is damaged"
    with pytest.raises(CorruptCheckpointError, match=why):
        decoupled_diloco.load(str(damaged))
    out = subprocess.run(
        [sys.executable, "-m", "decoupled_diloco.evaluate", f"--workdir={damaged}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "the export is damaged; export the run again" in out.stderr


def test_an_export_without_its_saved_parameters_is_refused_naming_it(exported, tmp_path):
    damaged = tmp_path / "model"
    shutil.copytree(exported, damaged)
    shutil.rmtree(damaged / "params" / "0")
    with pytest.raises(CorruptCheckpointError, match=r"params holds no saved parameters"):
        decoupled_diloco.load(str(damaged))
