"""Memory and throughput knobs: model.remat, train.microbatches, model.attention_impl,
model.logits_chunk.

Each knob changes how a step is computed, never what: the tests compare against the plain
step (same loss, same updated parameters to float tolerance) and check that the knob really
is in the compiled program (a remat in the jaxpr, less temporary memory, a scan).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoupled_diloco import models, sharding
from decoupled_diloco.config import validate
from decoupled_diloco.models import decode
from decoupled_diloco.train.optimizer import (
    TrainConfig,
    make_inner_optimizer,
    state_learning_rate,
)
from decoupled_diloco.train.replica import Replica
from decoupled_diloco.train.step import init_train_state, make_train_step

# Adam's first update is g / (|g| + eps): with the default eps (1e-8) a gradient element near
# 0 turns float noise (~1e-9 here) into an update of up to lr; eps 1e-4 keeps the update a
# smooth function of the gradient, so equal gradients give equal parameters to 1e-6.
TRAIN = TrainConfig(warmup_steps=0, learning_rate=1e-2, eps=1e-4)


def batch_of(cfg, batch=8, seq=32, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, cfg.vocab_size, size=(batch, seq + 1), dtype=np.int32))


def one_step(cfg, batch, microbatches=1):
    optimizer = make_inner_optimizer(TRAIN)
    state = init_train_state(cfg, optimizer, jax.random.key(0))
    step = make_train_step(cfg, optimizer, state_learning_rate(TRAIN), None, microbatches)
    new, metrics = jax.jit(step)(state, batch)
    return new.params, jax.device_get(metrics)


def assert_same_step(a, b, keys=("loss", "total_loss", "grad_norm")):
    (params_a, metrics_a), (params_b, metrics_b) = a, b
    for k in keys:
        np.testing.assert_allclose(metrics_a[k], metrics_b[k], rtol=2e-5, err_msg=k)
    for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def plain_step():
    cfg = models.get_model_config("tiny")
    return one_step(cfg, batch_of(cfg))


# --- remat ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_gives_the_plain_step(plain_step, policy):
    cfg = models.get_model_config("tiny", remat=policy)
    assert_same_step(one_step(cfg, batch_of(cfg)), plain_step)


def _remat_policies(cfg) -> list:
    params = models.init_params(cfg, jax.random.key(0))
    batch = batch_of(cfg)
    grad = jax.grad(lambda p: models.forward(cfg, p, batch[:, :-1])[0].mean())
    eqns = jax.make_jaxpr(grad)(params).jaxpr.eqns
    # In the gradient's jaxpr each checkpointed block is a "remat2" (jax 0.10: the
    # backward pass's recomputation) carrying its policy.
    return [e.params["policy"] for e in eqns if e.primitive.name in ("checkpoint", "remat2")]


def test_remat_wraps_every_block_with_its_policy():
    assert _remat_policies(models.get_model_config("tiny")) == []
    full = _remat_policies(models.get_model_config("tiny", remat="full"))
    dots = _remat_policies(models.get_model_config("tiny", remat="dots"))
    assert full == [None, None]  # one per block (tiny has 2), saving nothing
    assert dots == [models.transformer.REMAT_POLICIES["dots"]] * 2


def _saved(cfg) -> list[str]:
    """What the gradient keeps from the forward pass (jax's saved-residuals listing)."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    params = models.init_params(cfg, jax.random.key(0))
    batch = batch_of(cfg, batch=2, seq=16)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda p: models.forward(cfg, p, batch[:, :-1])[0].mean(), params)
    return out.getvalue().splitlines()


@pytest.mark.parametrize("capacity_factor", [1.25, 0.0], ids=["capacity", "dropless"])
def test_remat_dots_keeps_the_experts_matmuls(capacity_factor):
    """The experts' matmuls are the bulk of an MoE block's FLOPs; "dots" keeps their outputs
    (gate, up, down of every MoE block) as it keeps the dense projections, "full" none. The
    no-batch-dims policy alone kept neither the capacity path's E-batched einsums nor the
    dropless grouped matmuls: "dots" recomputed nearly what "full" does."""
    kept = {}
    for remat in ("dots", "full"):
        cfg = models.get_model_config("tiny_moe", remat=remat, capacity_factor=capacity_factor)
        kept[remat] = [ln for ln in _saved(cfg) if "named 'expert_matmul'" in ln]
    assert len(kept["dots"]) == 3 * models.get_model_config("tiny_moe").num_layers
    assert kept["full"] == []


def test_remat_dots_moe_gives_the_plain_step():
    plain = one_step(
        models.get_model_config("tiny_moe"), batch_of(models.get_model_config("tiny_moe"))
    )
    cfg = models.get_model_config("tiny_moe", remat="dots")
    assert_same_step(one_step(cfg, batch_of(cfg)), plain)


def _compiled_dots(cfg) -> int:
    params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
    batch = jax.ShapeDtypeStruct((4, 33), jnp.int32)
    grad = jax.jit(jax.grad(lambda p, b: models.forward(cfg, p, b[:, :-1])[0].mean()))
    return len(re.findall(r"= \S+ dot\(", grad.lower(params, batch).compile().as_text()))


def test_remat_recomputation_survives_compilation():
    """XLA must not CSE the recomputed forward away. (XLA:CPU's memory_analysis shows no
    saving: its scheduler is not memory-aware and runs the recomputation early; the memory
    effect is measured on an accelerator, scripts/bench_accelerator.py.)"""
    plain = _compiled_dots(models.get_model_config("tiny"))
    full = _compiled_dots(models.get_model_config("tiny", remat="full"))
    dots = _compiled_dots(models.get_model_config("tiny", remat="dots"))
    # full recomputes every forward matmul of both blocks; dots only attention's two.
    assert plain < dots < full, (plain, dots, full)


# --- microbatches ---------------------------------------------------------------------------


@pytest.mark.parametrize("microbatches", [2, 4])
def test_microbatches_give_the_plain_step(plain_step, microbatches):
    cfg = models.get_model_config("tiny")
    assert_same_step(one_step(cfg, batch_of(cfg), microbatches), plain_step)


def test_microbatches_with_remat_give_the_plain_step(plain_step):
    cfg = models.get_model_config("tiny", remat="full")
    assert_same_step(one_step(cfg, batch_of(cfg), 2), plain_step)


def test_microbatches_run_as_a_scan():
    cfg = models.get_model_config("tiny")
    optimizer = make_inner_optimizer(TRAIN)
    state = jax.eval_shape(lambda: init_train_state(cfg, optimizer, jax.random.key(0)))
    for n, scans in ((1, 0), (2, 1)):
        step = make_train_step(cfg, optimizer, state_learning_rate(TRAIN), None, n)
        jaxpr = jax.make_jaxpr(step)(state, batch_of(cfg))
        found = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        assert len(found) == scans
        if scans:
            assert found[0].params["length"] == n


def test_microbatches_keep_moe_routing_and_average_its_statistics():
    """Routing is per row, so the LM loss and token-mean statistics are the full batch's;
    the balance loss is each microbatch's own, averaged (step.py docstring)."""
    cfg = models.get_model_config("tiny_moe")
    batch = batch_of(cfg)
    (_, plain), (_, micro) = one_step(cfg, batch), one_step(cfg, batch, 2)
    for k in ("loss", "router_z_loss", "dropped_fraction", "expert_load"):
        np.testing.assert_allclose(micro[k], plain[k], rtol=2e-5, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(micro["load_balance_loss"], plain["load_balance_loss"], rtol=0.05)


CHUNKS = dict(logits_chunk=8)
MICROBATCH_MESHES = {
    "data8": ("tiny", {}, dict(data=8)),  # each replica sums its rows' gradients (shard_map)
    # the chunked output layer inside a replica's shard_map, with and without its own
    "data8_chunks": ("tiny", CHUNKS, dict(data=8)),
    "data8_once": ("tiny", dict(CHUNKS, logits_gather="once"), dict(data=8)),
    # XLA's accumulation: other axes split, or an MoE
    "data2xfsdp4": ("tiny", {}, dict(data=2, fsdp=4)),
    "data2xtensor4": ("tiny", {}, dict(data=2, tensor=4)),
    "data2xfsdp2xtensor2": ("tiny", {}, dict(data=2, fsdp=2, tensor=2)),
    "fsdp8_once": ("tiny", dict(CHUNKS, logits_gather="once"), dict(data=1, fsdp=8)),
    "moe_data8": ("tiny_moe", {}, dict(data=8)),
}
# 8-12 s each on 2 cores: the default suite keeps one mesh of each path (shard_map: data8*;
# XLA's accumulation: data2xfsdp2xtensor2) and CI's slow pass runs the rest.
_SLOW_MESHES = {"data2xfsdp4", "data2xtensor4", "fsdp8_once", "moe_data8",
                "moe_data2xfsdp2xexpert2"}  # fmt: skip


def _meshes(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_MESHES else n for n in names]


@pytest.mark.parametrize("name", _meshes(MICROBATCH_MESHES))
def test_sharded_replica_with_microbatches_matches_plain(name):
    """Microbatches of 8 rows, one per device, on 8-device meshes, against one batch."""
    preset, knobs, axes = MICROBATCH_MESHES[name]
    mesh = sharding.make_mesh(jax.devices()[:8], sharding.MeshConfig(**axes))
    one = _replica_step(models.get_model_config(preset), mesh)
    two = _replica_step(models.get_model_config(preset, **knobs), mesh, microbatches=2)
    if preset == "tiny":
        _assert_same_replica_step(one, two)
    else:  # the balance loss is each microbatch's own (see the MoE test above)
        np.testing.assert_allclose(two[1]["loss"], one[1]["loss"], rtol=2e-5)


def test_microbatches_reduce_the_gradient_over_replicas_once():
    """Data parallel over 8 devices, 4 microbatches must send about what 1 does (the
    replicas' gradients meet once); XLA's own accumulation (an MoE model keeps it) sends
    one gradient reduction per microbatch."""
    mesh = sharding.make_mesh(jax.devices()[:8], sharding.MeshConfig(data=8))

    def traffic(preset, microbatches):
        cfg = models.get_model_config(preset)
        return _step_traffic(cfg, mesh, batch=32, microbatches=microbatches)

    assert traffic("tiny", 4) < 1.1 * traffic("tiny", 1)
    assert traffic("tiny_moe", 4) > 2 * traffic("tiny_moe", 1)


def _replica_step(cfg, mesh, microbatches: int = 1):
    """(host params, metrics) after one step of a Replica of `cfg` on `mesh`, 16 rows."""
    train = TrainConfig(warmup_steps=0, batch_size=16, microbatches=microbatches, eps=TRAIN.eps)
    replica = Replica(cfg, train, mesh)
    replica.init_from_rng(jax.random.key(0))
    metrics = jax.device_get(replica.step(np.asarray(batch_of(cfg, batch=16))))
    return replica.host_params(), metrics


def _assert_same_replica_step(a, b):
    (params_a, metrics_a), (params_b, metrics_b) = a, b
    np.testing.assert_allclose(metrics_b["loss"], metrics_a["loss"], rtol=2e-5)
    for k in params_a:
        np.testing.assert_allclose(params_b[k], params_a[k], rtol=1e-5, atol=1e-6, err_msg=k)


# --- logits chunk ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [8, 12, 32, 64])  # 12: a last chunk of 8 padded positions
def test_logits_chunk_gives_the_plain_step(plain_step, chunk):
    cfg = models.get_model_config("tiny", logits_chunk=chunk)
    assert_same_step(one_step(cfg, batch_of(cfg)), plain_step)


def test_logits_chunk_with_microbatches_and_remat_gives_the_plain_step(plain_step):
    cfg = models.get_model_config("tiny", logits_chunk=8, remat="full")
    assert_same_step(one_step(cfg, batch_of(cfg), 2), plain_step)


def _loss_temp_bytes(cfg, batch=8, seq=128) -> int:
    """XLA's planned temporary bytes of the loss's gradient for a batch of `batch` x `seq`."""
    from decoupled_diloco.train.step import loss_fn

    params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    grad = jax.jit(jax.grad(lambda p, b: loss_fn(cfg, p, b)[0]))
    return grad.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def test_logits_chunk_keeps_one_chunk_of_logits():
    """With a vocabulary where the logits dominate (8 x 128 positions x 16384 x 4 bytes =
    64 MiB per float32 buffer, several alive in the backward pass), chunks of 8 positions
    (4 MiB each) must take the step's temporaries down to near what the rest of the model
    needs, and they grow with the chunk."""
    big = dict(vocab_size=16384)
    plain = _loss_temp_bytes(models.get_model_config("tiny", **big))
    chunked = _loss_temp_bytes(models.get_model_config("tiny", logits_chunk=8, **big))
    wider = _loss_temp_bytes(models.get_model_config("tiny", logits_chunk=32, **big))
    logits = 8 * 128 * 16384 * 4
    assert plain > 3 * logits, plain
    assert chunked < logits, chunked
    assert chunked < wider < plain, (chunked, wider, plain)


def test_sharded_replica_with_logits_chunk_matches_plain():
    """Rows over 4 devices and the vocabulary over 2 (tensor parallel): each chunk's logits
    stay sharded like the whole sequence's."""
    mesh = sharding.make_mesh(jax.devices()[:8], sharding.MeshConfig(tensor=2))
    steps = (_replica_step(models.get_model_config("tiny", logits_chunk=c), mesh) for c in (0, 8))
    _assert_same_replica_step(*steps)


# The output layer gathered once (model.logits_gather = "once"), on meshes whose batch axes
# split the rows: FSDP with and without a tensor axis, data parallel, and the MoE's expert axis.
GATHER_MESHES = {
    "fsdp4xtensor2": ("tiny", dict(data=1, fsdp=4, tensor=2)),
    "data2xfsdp4": ("tiny", dict(data=2, fsdp=4)),
    "data8": ("tiny", dict(data=8)),
    "moe_data2xfsdp2xexpert2": ("tiny_moe", dict(data=2, fsdp=2, expert=2)),
}


@pytest.mark.parametrize("name", _meshes(GATHER_MESHES))
def test_logits_gathered_once_give_the_plain_step(name):
    preset, axes = GATHER_MESHES[name]
    mesh = sharding.make_mesh(jax.devices()[:8], sharding.MeshConfig(**axes))
    plain = _replica_step(models.get_model_config(preset), mesh)
    once = models.get_model_config(preset, logits_chunk=8, logits_gather="once")
    _assert_same_replica_step(plain, _replica_step(once, mesh))


def _step_traffic(cfg, mesh, batch: int = 16, microbatches: int = 1) -> float:
    """Bytes one device sends in the collectives of a compiled train step (batch x 32)."""
    from decoupled_diloco import collectives

    train = TrainConfig(warmup_steps=0, batch_size=batch, microbatches=microbatches)
    replica = Replica(cfg, train, mesh)
    tokens = jax.ShapeDtypeStruct((batch, 33), jnp.int32, sharding=replica.batch_sharding)
    compiled = replica._train_step.lower(replica.abstract_state(), tokens).compile()
    return collectives.traffic(compiled.as_text()).total_bytes


@pytest.mark.parametrize(
    "axes",
    [pytest.param(dict(data=1, fsdp=8), id="fsdp8", marks=pytest.mark.slow),
     pytest.param(dict(data=8), id="data8")],
)  # fmt: skip
def test_logits_gathered_once_move_the_embedding_once(axes):
    """With a vocabulary whose embedding dominates the step's traffic, 4 chunks of 8
    positions must send what one chunk of 32 does when gathered once; left to XLA ("per
    chunk") they send much more (what the knob is for)."""
    mesh = sharding.make_mesh(jax.devices()[:8], sharding.MeshConfig(**axes))

    def traffic(chunk, gather):
        cfg = models.get_model_config("tiny", vocab_size=2048, logits_chunk=chunk,
                                      logits_gather=gather)  # fmt: skip
        return _step_traffic(cfg, mesh)

    whole = traffic(32, "once")
    assert traffic(8, "once") < 1.05 * whole
    assert traffic(8, "per_chunk") > 1.5 * whole


# --- attention implementation ---------------------------------------------------------------

# No softcap (the fused path has none); a window shorter than the sequence, so local and
# global layers really differ; GQA (2 kv heads for 4 query heads).
NO_CAP = dict(attn_logit_softcap=0.0, sliding_window=8, attention_pattern=("local", "global"))


def test_dot_product_attention_matches_reference_forward_and_grads():
    ref = models.get_model_config("tiny", **NO_CAP)
    fused = models.get_model_config("tiny", attention_impl="dot_product_attention", **NO_CAP)
    assert ref.num_kv_heads < ref.num_heads
    params = models.init_params(ref, jax.random.key(1))
    tokens = batch_of(ref, batch=4, seq=32)[:, :-1]

    @functools.partial(jax.jit, static_argnums=0)
    def logits_and_grads(cfg, p):
        logits = models.forward(cfg, p, tokens)[0]
        return logits, jax.grad(lambda q: models.forward(cfg, q, tokens)[0].std())(p)

    (logits_ref, g_ref), (logits_fused, g_fused) = (
        logits_and_grads(c, params) for c in (ref, fused)
    )
    assert logits_ref.shape == (4, 32, 256)
    np.testing.assert_allclose(logits_fused, logits_ref, rtol=1e-5, atol=1e-5)
    for x, y in zip(jax.tree.leaves(g_fused), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_dot_product_attention_matches_reference_when_decoding():
    ref = models.get_model_config("tiny", **NO_CAP)
    fused = models.get_model_config("tiny", attention_impl="dot_product_attention", **NO_CAP)
    params = models.init_params(ref, jax.random.key(2))
    prompts = np.asarray(batch_of(ref, batch=2, seq=20)).tolist()
    out = [
        decode.generate(cfg, params, prompts, max_new_tokens=6, temperature=0.0)
        for cfg in (ref, fused)
    ]
    np.testing.assert_array_equal(out[0], out[1])


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(remat="some"), "model.remat"),
        (dict(attention_impl="flash"), "model.attention_impl"),
        (dict(attention_impl="dot_product_attention"), "model.attn_logit_softcap = 0"),
        (dict(logits_chunk=-1), "model.logits_chunk"),
        (dict(logits_chunk=2.5), "model.logits_chunk"),
        (dict(logits_chunk=8, logits_gather="twice"), "model.logits_gather"),
        (dict(logits_gather="once"), "model.logits_chunk > 0"),
    ],
)
def test_bad_model_knobs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        models.get_model_config("tiny", **overrides)


@pytest.mark.parametrize(
    "microbatches, batch_size, message",
    [
        (0, 8, "train.microbatches must be an integer >= 1"),
        (3, 8, r"divisible by train.microbatches \(3\)"),
        (4, 8, r"batch-parallel devices \(8"),  # 2 rows per microbatch on 8 devices
    ],
)
def test_bad_microbatches_are_refused(small_config, microbatches, batch_size, message):
    c = small_config(**{"train.microbatches": microbatches, "train.batch_size": batch_size})
    with pytest.raises(ValueError, match=message):
        validate(c)


def test_knobs_flow_from_the_run_config(small_config):
    c = small_config(**{"train.microbatches": 1, "train.batch_size": 16})
    c.train.microbatches = 2
    c.model.remat = "dots"
    run = validate(c)
    assert run.train.microbatches == 2 and run.model.remat == "dots"


# --- initial state --------------------------------------------------------------------------


def test_initial_state_is_built_on_its_shardings():
    """No leaf passes through the host or one device: each device computes only its shard
    (FSDP over 4 devices), and the values are those of an unsharded init from the same key
    (the syncer's host-side Θ_0, runtime/ray/syncer.py), by the partitionable threefry."""
    cfg = models.get_model_config("tiny")
    mesh = sharding.make_mesh(jax.devices()[:4], sharding.MeshConfig(data=1, fsdp=4))
    replica = Replica(cfg, TrainConfig(batch_size=8), mesh)
    key = jax.device_put(jax.random.key(3), sharding.replicated(mesh))  # 2 words, explicit
    with jax.transfer_guard("disallow"):
        replica.init_from_rng(key)
    params = models.flatten_params(replica.state.params)
    embedding = params["embedder/embedding"]
    assert embedding.sharding == replica.flat_shardings["embedder/embedding"]
    assert {s.data.shape for s in embedding.addressable_shards} == {(256, 16)}  # D 64 / 4
    for leaf, sh in zip(
        jax.tree.leaves(replica.state.opt_state),
        jax.tree.leaves(replica.opt_shardings),
        strict=True,
    ):
        assert leaf.sharding == sh
    expected = models.flatten_params(jax.jit(lambda k: models.init_params(cfg, k))(key))
    for name, value in replica.host_params().items():
        np.testing.assert_array_equal(value, np.asarray(expected[name]), err_msg=name)
