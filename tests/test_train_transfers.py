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


def test_merges_of_every_kind_pass_the_transfer_guard():
    """A merge's weight (1 − α for an add, α for a mix, 1 − α for a landing's set-aside)
    reaches its jitted op as a device scalar placed explicitly: a Python float argument is
    an implicit host transfer, so under the guard every merge failed (the default
    `diloco.apply` "rebase" adds with weight 1 − α = 1). Whole leaves and a row slice."""
    cfg = models.get_model_config("tiny")
    mesh = sharding.make_mesh(jax.devices()[:2], sharding.MeshConfig(data=1, fsdp=2))
    replica = Replica(cfg, TrainConfig(batch_size=8), mesh)
    theta = models.flatten_params(jax.device_get(models.init_params(cfg, jax.random.key(0))))
    leaf, rows = "final_norm/scale", "embedder/embedding[0:128]"
    x = {leaf: np.full_like(theta[leaf], 0.5), rows: np.full((128, 64), 0.5, np.float32)}
    replica.init_from_host(theta)
    with jax.transfer_guard("disallow"):
        replica.apply("add", replica.place(x))  # θ + x
        replica.apply("mix", replica.place(x), alpha=0.5)  # (θ + x + x) / 2
        replica.land(replica.place(x), replica.place(x), alpha=0.5)
        params = replica.host_params()
        held = transfer.to_host(replica.held)
    want_leaf = (theta[leaf] + 0.5 + 0.5) / 2
    np.testing.assert_allclose(params[leaf], 0.5 * want_leaf + 0.25, rtol=1e-6)
    want_rows = (theta["embedder/embedding"][:128] + 0.5 + 0.5) / 2
    np.testing.assert_allclose(params["embedder/embedding"][:128], 0.5 * want_rows + 0.25,
                               rtol=1e-6, atol=1e-7)  # fmt: skip
    np.testing.assert_array_equal(params["embedder/embedding"][128:],
                                  theta["embedder/embedding"][128:])  # fmt: skip
    # R = (1 − α)·(θ + x − Θ_new) with x = Θ_new: (1 − α)·θ
    np.testing.assert_allclose(held[leaf], 0.5 * want_leaf, rtol=1e-6)
    np.testing.assert_allclose(held[rows], 0.5 * want_rows, rtol=1e-6, atol=1e-7)
