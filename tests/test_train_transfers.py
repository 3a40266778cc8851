"""transfer.py's host <-> device moves: exact round trips, dtypes kept, and explicit enough
to pass `jax.transfer_guard("disallow")` (the module's promise: tests can run a learner's
steps under that guard, and its parameters come and go only through here)."""

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from decoupled_diloco import models, sharding, transfer
from decoupled_diloco.train.optimizer import TrainConfig
from decoupled_diloco.train.replica import Replica


def test_host_arrays_round_trip_exactly_under_the_transfer_guard():
    mesh = sharding.make_mesh(jax.devices()[:8], sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    rng = np.random.default_rng(0)
    arrays = {  # (host array, how it is split)
        "bf16": (rng.normal(size=(8, 6)).astype(ml_dtypes.bfloat16), P("fsdp", "tensor")),
        "transposed": (rng.normal(size=(6, 8)).astype(np.float32).T, P(("data", "fsdp"))),
        "reversed": (rng.normal(size=(8, 4)).astype(np.float32)[::-1], P(None, "tensor")),
        "int32": (rng.integers(0, 100, size=8).astype(np.int32), P("data")),
        "scalar": (np.float32(3.5), P()),
    }
    shardings = {k: NamedSharding(mesh, spec) for k, (_, spec) in arrays.items()}
    with jax.transfer_guard("disallow"):
        placed = transfer.to_device({k: x for k, (x, _) in arrays.items()}, shardings)
        for readonly in (False, True):
            back = transfer.to_host(placed, readonly=readonly)
            for k, (x, _) in arrays.items():
                assert placed[k].sharding == shardings[k] and placed[k].dtype == x.dtype, k
                assert back[k].dtype == x.dtype and back[k].shape == np.shape(x), k
                np.testing.assert_array_equal(back[k], x, err_msg=k)


def test_a_learner_takes_parameters_and_merges_from_the_host_under_the_transfer_guard():
    """Θ from the syncer (`init_from_host`, `set_params`) and a merged fragment (`place`,
    then `apply` with the default α = 0 overwrite) reach a learner's FSDP-sharded parameters
    by transfer.to_device; it used `jax.make_array_from_callback`, an implicit transfer to
    the guard, so a learner run under it failed at its start."""
    cfg = models.get_model_config("tiny")
    mesh = sharding.make_mesh(jax.devices()[:4], sharding.MeshConfig(data=1, fsdp=4))
    replica = Replica(cfg, TrainConfig(batch_size=8), mesh)
    theta = models.flatten_params(jax.device_get(models.init_params(cfg, jax.random.key(0))))
    name = "embedder/embedding"
    merged = {name: np.full_like(theta[name], 0.5)}
    with jax.transfer_guard("disallow"):
        replica.init_from_host(theta, step=3)
        replica.set_params(theta)
        replica.apply("mix", replica.place(merged))
        params = replica.host_params()
    assert int(jax.device_get(replica.state.step)) == 3
    for k, want in theta.items():
        np.testing.assert_array_equal(params[k], merged.get(k, want), err_msg=k)
    leaf = models.flatten_params(replica.state.params)[name]
    assert leaf.sharding == replica.flat_shardings[name]
