"""Learner meshes, the logical-axis rules, and sharded train steps that match one device."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from decoupled_diloco import models
from decoupled_diloco.sharding import (
    MESH_AXES,
    MeshConfig,
    batch_axis_size,
    batch_sharding,
    logical_to_spec,
    make_mesh,
    mesh_shape,
    param_shardings,
    replicated,
    whole_on_axes,
)
from decoupled_diloco.train.optimizer import (
    TrainConfig,
    make_inner_optimizer,
    state_learning_rate,
)
from decoupled_diloco.train.step import TrainState, make_train_step

TRAIN_CFG = TrainConfig(steps=10, warmup_steps=1, learning_rate=3e-3)
BATCH, SEQ = 8, 32
NUM_STEPS = 3


def flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


# --- meshes ------------------------------------------------------------------------------


def test_meshes_over_disjoint_device_subsets():
    devices = jax.devices()
    assert len(devices) == 8
    first = make_mesh(devices[:4], MeshConfig(data=-1))
    second = make_mesh(devices[4:], MeshConfig(data=2, fsdp=2))
    assert first.axis_names == second.axis_names == MESH_AXES
    assert list(first.devices.flat) == devices[:4]  # the given order is kept
    assert set(first.devices.flat).isdisjoint(second.devices.flat)
    assert dict(second.shape) == {"data": 2, "fsdp": 2, "tensor": 1, "expert": 1}
    # Arrays placed on a learner's mesh live on that learner's devices only.
    x = jax.device_put(np.arange(8.0), NamedSharding(second, P(("data", "fsdp"))))
    assert x.sharding.device_set == set(devices[4:])


@pytest.mark.parametrize(
    "cfg, num_devices, expected",
    [
        (MeshConfig(), 8, (8, 1, 1, 1)),
        (MeshConfig(data=-1, fsdp=2, tensor=2), 8, (2, 2, 2, 1)),
        (MeshConfig(data=2, fsdp=-1), 8, (2, 4, 1, 1)),
        (MeshConfig(data=1, expert=-1), 4, (1, 1, 1, 4)),
        (MeshConfig(data=2, tensor=2), 4, (2, 1, 2, 1)),
    ],
)
def test_mesh_shape_resolves_free_axis(cfg, num_devices, expected):
    assert mesh_shape(cfg, num_devices) == expected


@pytest.mark.parametrize(
    "cfg, num_devices, key",
    [
        (MeshConfig(data=-1, fsdp=-1), 8, "mesh.data"),  # two free axes
        # mesh.data is -1 by default: a user who set fsdp=-1 alone is told how to mean it
        (MeshConfig(fsdp=-1), 8, "set mesh.data=1 for mesh.fsdp to take them all"),
        (MeshConfig(data=-1, tensor=3), 8, "mesh.data"),  # 8 not divisible by 3
        (MeshConfig(data=2, tensor=2), 8, "mesh.tensor"),  # 4 devices named, 8 given
        (MeshConfig(fsdp=0), 8, "mesh.fsdp"),
        (MeshConfig(expert=-2), 8, "mesh.expert"),
        (MeshConfig(tensor=1.5), 8, "mesh.tensor"),
    ],
)
def test_mesh_shape_rejects_bad_shapes(cfg, num_devices, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        mesh_shape(cfg, num_devices)


# --- logical axis rules --------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh_222():
    return make_mesh(jax.devices(), MeshConfig(data=2, fsdp=2, tensor=2))


def test_logical_to_spec_follows_rules(mesh_222):
    assert logical_to_spec(("vocab", "embed"), (256, 64), mesh_222) == P("tensor", "fsdp")
    assert logical_to_spec(("embed", "heads", "head_dim"), (64, 4, 16), mesh_222) == P(
        "fsdp", "tensor", None
    )
    # Batch goes over every batch axis of size > 1 (expert is 1 here).
    assert logical_to_spec(("batch", None), (8, 33), mesh_222) == P(("data", "fsdp"), None)
    assert logical_to_spec((None, None), (8, 8), mesh_222) == P(None, None)
    # A mesh axis shards at most one dim of an array.
    assert logical_to_spec(("mlp", "vocab"), (256, 256), mesh_222) == P("tensor", None)
    expert_mesh = make_mesh(jax.devices()[:4], MeshConfig(data=1, tensor=2, expert=2))
    assert logical_to_spec(("expert", "embed", "mlp"), (4, 64, 128), expert_mesh) == P(
        "expert", None, "tensor"
    )


def test_logical_to_spec_replicates_non_divisible_dims(mesh_222):
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 3, 16), mesh_222) == P(
        "fsdp", None, None
    )
    assert logical_to_spec(("embed",), (63,), mesh_222) == P(None)
    assert logical_to_spec(("batch", None), (6, 33), mesh_222) == P(None, None)  # 6 % 4
    with pytest.raises(ValueError, match="do not match shape"):
        logical_to_spec(("embed",), (64, 4), mesh_222)


# Hand-written from LOGICAL_RULES for the tiny preset on data=2, fsdp=2, tensor=2.
TINY_SPECS = {
    "embedder/embedding": P("tensor", "fsdp"),
    "attn/q": P("fsdp", "tensor", None),
    "attn/k": P("fsdp", "tensor", None),  # 2 kv heads split 2 ways
    "attn/v": P("fsdp", "tensor", None),
    "attn/out": P("tensor", None, "fsdp"),
    "ffw/gate": P("fsdp", "tensor"),
    "ffw/up": P("fsdp", "tensor"),
    "ffw/down": P("tensor", "fsdp"),
    "scale": P("fsdp"),  # every norm scale
}


def test_param_shardings_place_tiny_model(mesh_222):
    cfg = models.get_model_config("tiny")
    params = models.init_params(cfg, jax.random.key(0))
    shardings = param_shardings(params, models.param_logical_axes(cfg), mesh_222)
    placed = jax.device_put(params, shardings)
    flat_params, flat_placed, flat_shardings = flat(params), flat(placed), flat(shardings)
    assert flat_shardings.keys() == flat_params.keys()
    for name, s in flat_shardings.items():
        assert isinstance(s, NamedSharding) and s.mesh == mesh_222, name
        expected = [v for k, v in TINY_SPECS.items() if name.endswith(k)]
        assert len(expected) == 1, name
        assert s.spec == expected[0], name
        x = flat_placed[name]
        assert x.sharding == s
        shard_shape = list(x.shape)
        for dim, axis in enumerate(s.spec):
            if axis is not None:
                shard_shape[dim] //= mesh_222.shape[axis]
        assert all(sh.data.shape == tuple(shard_shape) for sh in x.addressable_shards), name
        np.testing.assert_array_equal(np.asarray(x), np.asarray(flat_params[name]))


# --- sharded train steps ---------------------------------------------------------------------


def opt_state_shardings(opt_state, param_sh, params, mesh):
    """Adam moments (param-shaped subtrees of the optax state) follow their params."""
    params_def = jax.tree.structure(params)

    def is_param_tree(x):
        return isinstance(x, dict) and jax.tree.structure(x) == params_def

    return jax.tree.map(
        lambda x: param_sh if is_param_tree(x) else replicated(mesh),
        opt_state,
        is_leaf=is_param_tree,
    )


def make_batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, size=(BATCH, SEQ + 1), dtype=np.int32)


@functools.cache
def host_state(preset, **overrides):
    """Fresh params and AdamW state of `preset` as host numpy trees (shared across meshes)."""
    cfg = models.get_model_config(preset, **overrides)
    params = models.init_params(cfg, jax.random.key(1))
    opt_state = make_inner_optimizer(TRAIN_CFG).init(params)
    return cfg, jax.device_get(TrainState(jnp.zeros((), jnp.int32), params, opt_state))


def sharded_step(cfg, mesh, state):
    """(jitted step with explicit in/out shardings, state placed on mesh, batch sharding)."""
    optimizer = make_inner_optimizer(TRAIN_CFG)
    param_sh = param_shardings(state.params, models.param_logical_axes(cfg), mesh)
    state_sh = TrainState(
        replicated(mesh),
        param_sh,
        opt_state_shardings(state.opt_state, param_sh, state.params, mesh),
    )
    step = jax.jit(
        make_train_step(cfg, optimizer, state_learning_rate(TRAIN_CFG), mesh),
        in_shardings=(state_sh, batch_sharding(mesh)),
        out_shardings=(state_sh, replicated(mesh)),
    )
    return step, jax.device_put(state, state_sh), batch_sharding(mesh)


def run_steps(step, state, batch):
    losses = []
    for _ in range(NUM_STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["total_loss"]))
    return np.array(losses), state


@functools.cache
def single_device_losses(preset, **overrides):
    cfg, state = host_state(preset, **overrides)
    device = jax.devices()[0]
    optimizer = make_inner_optimizer(TRAIN_CFG)
    step = jax.jit(make_train_step(cfg, optimizer, state_learning_rate(TRAIN_CFG)))
    batch = jax.device_put(make_batch(cfg), device)
    losses, final = run_steps(step, jax.device_put(state, device), batch)
    return losses, jax.device_get(final.params)


@pytest.mark.parametrize(
    "preset, overrides, devices, mesh_cfg",
    [
        ("tiny", {}, slice(4, 8), MeshConfig(data=-1)),  # pure data parallel, not device 0
        ("tiny", {}, slice(0, 4), MeshConfig(data=-1, fsdp=2, tensor=2)),
        ("tiny_moe", {}, slice(0, 4), MeshConfig(data=-1, expert=2)),
        pytest.param(
            "tiny_moe",
            {"capacity_factor": 0.0},
            slice(0, 4),
            MeshConfig(data=-1, expert=2),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["data4", "fsdp2_tensor2", "moe_expert2", "moe_dropless_expert2"],
)
def test_sharded_train_step_matches_single_device(preset, overrides, devices, mesh_cfg):
    cfg, state = host_state(preset, **overrides)
    mesh = make_mesh(jax.devices()[devices], mesh_cfg)
    step, placed, batch_sh = sharded_step(cfg, mesh, state)
    batch = jax.device_put(make_batch(cfg), batch_sh)
    assert batch.sharding.spec == P(("data", "fsdp", "expert"), None)
    assert len(batch.addressable_shards[0].data) == BATCH // batch_axis_size(mesh)

    losses, final = run_steps(step, placed, batch)
    expected_losses, expected_params = single_device_losses(preset, **overrides)
    np.testing.assert_allclose(losses, expected_losses, atol=1e-4)
    assert losses[-1] < losses[0]  # the updates really happened
    got = flat(jax.device_get(final.params))
    # Adam moves a coordinate by about lr · m/√v: where a gradient is near zero, a sum taken
    # in another order (sharded matmuls) changes that ratio, so a rare coordinate differs
    # by a fraction of lr (jax 0.10.2: 1 of 4096 by 1.2e-4 = 0.04 lr); the mean stays tiny.
    for name, want in flat(expected_params).items():
        np.testing.assert_allclose(got[name], want, atol=0.1 * TRAIN_CFG.learning_rate,
                                   err_msg=name)  # fmt: skip
        assert np.mean(np.abs(got[name] - want)) < 1e-6, name


def test_train_step_does_no_implicit_host_transfer():
    cfg, state = host_state("tiny")
    mesh = make_mesh(jax.devices()[:4], MeshConfig(data=-1, fsdp=2, tensor=2))
    step, placed, batch_sh = sharded_step(cfg, mesh, state)
    batch = jax.device_put(make_batch(cfg), batch_sh)
    with jax.transfer_guard("disallow"):
        placed, metrics = step(placed, batch)  # first call compiles, still no transfers
        placed, metrics = step(placed, batch)  # outputs feed straight back in
        jax.block_until_ready(metrics)
    assert int(jax.device_get(placed.step)) == 2
    assert np.isfinite(float(metrics["loss"]))


def _collectives(hlo: str) -> dict[str, list[str]]:
    """{"all-gather": [result shape, ...], ...} of a compiled (per-device) HLO module."""
    found: dict[str, list[str]] = {}
    for m in re.finditer(r"= (.+?) (all-gather|all-to-all|all-reduce|reduce-scatter)\(", hlo):
        found.setdefault(m.group(2), []).append(m.group(1))
    return found


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=1, expert=4), MeshConfig(data=2, expert=2)])
def test_expert_parallel_step_partitions_expert_compute(mesh_cfg):
    """Each device holds and computes only its experts: tokens travel (all-to-all), weights
    do not. The regression this guards against: XLA all-gathered every expert's weights onto
    every device and each device ran all experts on its tokens."""
    cfg, state = host_state("tiny_moe")
    mesh = make_mesh(jax.devices()[:4], mesh_cfg)
    step, placed, batch_sh = sharded_step(cfg, mesh, state)
    batch = jax.device_put(make_batch(cfg), batch_sh)
    hlo = step.lower(placed, batch).compile().as_text()
    E, D, F = cfg.num_experts, cfg.d_model, cfg.expert_hidden
    local = E // mesh.shape["expert"]
    full_expert_shapes = (f"f32[{E},{D},{F}]", f"f32[{E},{F},{D}]")
    collectives = _collectives(hlo)
    gathered = [s for s in collectives.get("all-gather", []) if s.startswith(full_expert_shapes)]
    assert not gathered, f"expert weights all-gathered to full size: {gathered}"
    assert not any(shape in hlo for shape in full_expert_shapes)  # never materialised at all
    assert f"f32[{local},{D},{F}]" in hlo  # the per-device expert shard feeds the matmuls
    # Forward dispatch and combine, and their transposes, in each MoE layer.
    assert len(collectives.get("all-to-all", [])) >= 4 * cfg.num_moe_layers


@pytest.mark.parametrize(
    "mesh_cfg", [MeshConfig(data=1, fsdp=4), MeshConfig(data=1, fsdp=2, tensor=2)], ids=str
)
def test_dense_step_splits_activations_over_the_batch(mesh_cfg):
    """Under FSDP every device computes only its own rows: no activation of the global batch
    (residual stream, ffw hidden, logits) exists on a device, so memory and FLOPs per device
    stay put as devices are added at a fixed batch per device. The regression this guards
    against: the FSDP-sharded embedding left the residual stream split over d_model, and
    XLA then ran the logits and ffw of the whole global batch on every device."""
    cfg, state = host_state("tiny")
    mesh = make_mesh(jax.devices()[:4], mesh_cfg)
    step, placed, batch_sh = sharded_step(cfg, mesh, state)
    batch = jax.device_put(make_batch(cfg), batch_sh)
    hlo = step.lower(placed, batch).compile().as_text()
    rows = BATCH // batch_axis_size(mesh)
    V, D, F = cfg.vocab_size, cfg.d_model, cfg.ffw_hidden
    global_shapes = [f"[{BATCH},{SEQ},{n}]" for n in (V, D, F)]
    params = {f"[{a},{b}]" for a, b in ((V, D), (D, F), (F, D))}  # e.g. [256,64]: B*T = V
    flattened = [f"[{BATCH * SEQ},{n}]" for n in (V, D, F)]  # the same with rows flattened
    global_shapes += [s for s in flattened if s not in params]
    assert not [s for s in global_shapes if s in hlo], "activations of the global batch"
    tensor = mesh.shape["tensor"]
    assert f"f32[{rows},{SEQ},{V // tensor}]" in hlo  # each device's own rows of the logits


def test_an_axis_that_does_not_divide_what_it_splits_is_named(small_config, caplog):
    """A mesh axis dividing none of a parameter's dimensions leaves it whole on each of the
    axis' devices (the fallback tiny CPU models need): an expert axis not dividing the
    experts is refused (every expert copied onto every device: 256 GiB per device for the
    MoE TPU preset on 32), an fsdp or tensor axis that leaves more than a tenth of what it
    would split whole is warned of at start-up and by --check_config."""
    import logging

    from decoupled_diloco import config as config_lib
    from decoupled_diloco.preflight import warn_of_whole_parameters

    moe = {"model.preset": "tiny_moe"}
    with pytest.raises(ValueError, match=r"mesh.expert \(8\) must divide model.num_experts \(4\)"):
        config_lib.validate(small_config(**moe, **{"mesh.data": 1, "mesh.expert": 8}))
    assert config_lib.validate(small_config(**moe, **{"mesh.data": 2, "mesh.expert": 4}))

    with caplog.at_level(logging.WARNING):
        split = warn_of_whole_parameters(
            config_lib.validate(small_config(**{"mesh.data": 2, "mesh.tensor": 4}))
        )
        whole = warn_of_whole_parameters(
            config_lib.validate(small_config(**{"mesh.data": 1, "mesh.tensor": 8}))
        )
    assert split == []  # tiny's 4 heads, 4 kv heads, ffw 256 and vocab 256 split 4 ways
    assert len(whole) == 1 and whole[0].startswith(
        "mesh.tensor=8 does not divide the dimensions it would split of 18% of those "
        "parameters (block_0/attn/k, block_0/attn/out, block_0/attn/q, block_0/attn/v, ..."
    )
    assert whole[0] in caplog.text
    # gemma_2b's one kv head on 8 tensor devices: 5% whole, the MQA norm, not warned of.
    cfg = models.get_model_config("gemma_2b")
    params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
    report = whole_on_axes(params, models.param_logical_axes(cfg), (1, 1, 8, 1))
    assert 0.03 < report["tensor"][0] < 0.1
    assert all(name.endswith(("/attn/k", "/attn/v")) for name in report["tensor"][1])


def test_devices_no_learner_uses_are_warned_of(small_config):
    """3 learners on 8 devices take groups of 2: 2 devices idle, which a devices_per_learner
    of 3 was refused for and this was not; 4 learners x 2 use them all."""
    from decoupled_diloco import config as config_lib
    from decoupled_diloco.preflight import warn_of_idle_devices

    three = config_lib.validate(small_config(**{"diloco.learners": 3, "diloco.sync_every": 4}))
    assert warn_of_idle_devices(three) == [
        "2 of the 8 devices stay idle: 3 learners x devices_per_learner=2 use 6 (set "
        "devices_per_learner, or diloco.learners, to use them all)"
    ]
    four = config_lib.validate(small_config(**{"diloco.learners": 4, "diloco.sync_every": 4}))
    assert warn_of_idle_devices(four) == []
    shared = small_config(**{"diloco.learners": 3, "diloco.sync_every": 4})
    shared.devices_per_learner = 4  # 2 groups, learners round-robin over them: none idle
    assert warn_of_idle_devices(config_lib.validate(shared)) == []
