"""Pure train and eval steps of one learner (jitted by the caller with its shardings)."""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from decoupled_diloco import models
from decoupled_diloco.sharding import LOGICAL_RULES, constrain, constraint_mesh, logical_to_spec


class TrainState(NamedTuple):
    """A learner's device state. `params` is the plain nested dict of `models.init_params`."""

    step: jax.Array  # int32 scalar: inner steps taken
    params: Any
    opt_state: Any


def token_nll(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Each position's next-token negative log-likelihood in nats (float32)."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]


def cross_entropy(
    logits_BTV: jax.Array, targets_BT: jax.Array, row_weights_B: jax.Array | None = None
) -> jax.Array:
    """Mean next-token cross-entropy in nats; with `row_weights_B`, each row's tokens count
    with its weight (a row of weight 0 not at all)."""
    nll_BT = token_nll(logits_BTV, targets_BT)
    if row_weights_B is None:
        return nll_BT.mean()
    w_B = row_weights_B.astype(jnp.float32)
    return jnp.sum(nll_BT * w_B[:, None]) / (nll_BT.shape[1] * jnp.sum(w_B))


def chunked_cross_entropy(model_cfg: models.ModelConfig, embedding_VD: jax.Array,
                          x_BTD: jax.Array, targets_BT: jax.Array,
                          row_weights_B: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """`cross_entropy` of the output layer's logits (`models.output_logits` of x_BTD),
    computed `model_cfg.logits_chunk` positions at a time: a scan over chunks of positions
    (every row of the batch in each, so a batch-sharded x stays where it is), each chunk's
    logits recomputed in the backward pass (`jax.checkpoint`), so at most one chunk's
    float32 logits exist at a time. Positions past the sequence's end in its last chunk are
    padding with weight 0; `row_weights_B` as in `cross_entropy`. How the embedding reaches
    the chunks on a mesh: `model_cfg.logits_gather` (`_chunks_on_mesh`)."""
    B, T, D = x_BTD.shape
    C = min(model_cfg.logits_chunk, T)
    pad = -T % C
    weights_BT = jnp.ones((B, T), jnp.float32)
    if row_weights_B is not None:
        weights_BT = weights_BT * row_weights_B.astype(jnp.float32)[:, None]
    if pad:
        x_BTD = jnp.pad(x_BTD, ((0, 0), (0, pad), (0, 0)))
        targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
        weights_BT = jnp.pad(weights_BT, ((0, 0), (0, pad)))
    K = (T + pad) // C
    x_KBCD = constrain(x_BTD.reshape(B, K, C, D).swapaxes(0, 1), (None, "batch", None, None))
    targets_KBC = targets_BT.reshape(B, K, C).swapaxes(0, 1)
    weights_KBC = weights_BT.reshape(B, K, C).swapaxes(0, 1)
    chunks = (x_KBCD, targets_KBC, weights_KBC)
    on_mesh = _chunks_on_mesh(model_cfg, embedding_VD, chunks)
    total = on_mesh() if on_mesh else _sum_chunks(model_cfg, embedding_VD, chunks)
    if row_weights_B is None:
        return total / (B * T)
    return total / (T * jnp.sum(row_weights_B.astype(jnp.float32)))


def _vary(tree, axes: tuple[str, ...]):
    """`tree` marked as differing between devices over the manual `axes` (a shard_map's
    values start invariant; the transpose of this mark is the sum over `axes`)."""
    pcast = getattr(jax.lax, "pcast", None)  # (jax 0.10; `pvary` in earlier versions)
    return pcast(tree, axes, to="varying") if pcast else jax.lax.pvary(tree, axes)


def _varying_axes(x: jax.Array) -> tuple[str, ...]:
    """The manual mesh axes over which `x` differs between devices (inside a shard_map)."""
    t = jax.typeof(x)
    manual = getattr(t, "manual_axis_type", None)  # (jax 0.10; `vma` in other versions)
    return tuple(sorted(manual.varying if manual is not None else getattr(t, "vma", ())))


def _carry_like(tree, x: jax.Array):
    """`tree` (a scan's initial carry) marked varying over the manual axes `x` varies over
    (inside a shard_map; a carry must vary over the axes its updates vary over)."""
    varying = _varying_axes(x)
    return _vary(tree, varying) if varying else tree


def _sum_chunks(model_cfg, embedding_VD, chunks) -> jax.Array:
    """The summed weighted NLL of `chunks` (x_KBCD, targets_KBC, weights_KBC), one chunk
    of positions at a time."""

    @jax.checkpoint
    def chunk_nll(x_BCD, targets_BC, weights_BC):
        nll_BC = token_nll(models.output_logits(model_cfg, embedding_VD, x_BCD), targets_BC)
        return jnp.sum(nll_BC * weights_BC)

    def add_chunk(total, chunk):
        return total + chunk_nll(*chunk), None

    total = _carry_like(jnp.zeros((), jnp.float32), chunks[0])
    return jax.lax.scan(add_chunk, total, chunks)[0]


def _chunks_on_mesh(model_cfg, embedding_VD, chunks):
    """With `model.logits_gather = "once"` inside a train step's mesh whose batch axes split
    the rows: a function running `_sum_chunks` on each device over its own rows
    (`jax.shard_map`, manual over the batch axes; a tensor axis stays XLA's), else None.

    Left to XLA ("per_chunk"), every chunk moves the embedding: under FSDP it is all-gathered
    for each chunk's logits (and again in the backward pass) and its gradient reduce-scattered
    per chunk; under data parallelism XLA:CPU (and XLA:TPU, unless it hoists the reduction out
    of the loop) all-reduces the gradient per chunk. Here each device all-gathers the
    embedding once, in float32 as stored, sums its own rows' gradient over all chunks in one
    float32 buffer, and the gradient is reduced once as the step leaves the loss. XLA:TPU,
    gemma_2b's 2B TPU config on v5litepod-32 at batch 64 (8 chunks): 23.0 -> 16.0 GiB of
    collectives per chip and step, for 0.93 GiB more temporaries (scripts/tpu/README.md)."""
    mesh = jax.sharding.get_abstract_mesh()
    if model_cfg.logits_gather != "once" or mesh.empty:
        return None
    if jax.sharding.AxisType.Manual in mesh.axis_types:
        # Inside another shard_map (microbatches summed per data replica): a nested manual
        # fsdp axis fails Shardy's verification (jaxlib 0.10.2), so XLA's way there.
        return None
    rows = chunks[0].shape[1]
    axes = tuple(a for a in LOGICAL_RULES["batch"] if mesh.shape.get(a, 1) > 1)
    if not axes or rows % math.prod(mesh.shape[a] for a in axes):
        return None
    # The embedding's split over the manual axes (embed over fsdp), gathered inside; its
    # vocabulary dim may be split over the tensor axis, which stays automatic.
    spec = logical_to_spec(("vocab", "embed"), embedding_VD.shape, mesh)
    gathered = []  # (dim, mesh axes) to all-gather
    for dim, entry in enumerate(spec):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        manual = tuple(a for a in names if a in axes)
        if manual and len(manual) < len(names):
            return None  # a dim split over manual and automatic axes at once: XLA's way
        if manual:
            gathered.append((dim, manual))
    split = {a for _, manual in gathered for a in manual}
    replicated_over = tuple(a for a in axes if a not in split)

    def per_device(embedding_VD, *chunks):
        # Varying from the start: the gradient's sum over devices then happens once, here,
        # in float32 (left implicit, JAX would sum where the embedding first meets a row,
        # inside the loop, after the cast to the compute dtype).
        if replicated_over:
            embedding_VD = _vary(embedding_VD, replicated_over)
        for dim, manual in gathered:  # (its gradient: one reduce-scatter)
            embedding_VD = jax.lax.all_gather(embedding_VD, manual, axis=dim, tiled=True)
        return jax.lax.psum(_sum_chunks(model_cfg, embedding_VD, chunks), axes)

    embedding_spec = [None] * embedding_VD.ndim
    for dim, manual in gathered:
        embedding_spec[dim] = manual[0] if len(manual) == 1 else manual
    row_spec = P(None, axes)
    run = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(*embedding_spec), row_spec, row_spec, row_spec),
        out_specs=P(),
        axis_names=frozenset(axes),
    )
    return lambda: run(embedding_VD, *chunks)


def loss_fn(model_cfg: models.ModelConfig, params, batch_BT1: jax.Array,
            row_weights_B: jax.Array | None = None):  # fmt: skip
    """Returns (training loss incl. MoE auxiliary losses, (cross-entropy, aux dict)); with
    `model.logits_chunk` the output layer and cross-entropy run chunk by chunk
    (`chunked_cross_entropy`). `row_weights_B` weighs the rows' cross-entropy (evaluation:
    rows that repeat a window count 0)."""
    inputs_BT, targets_BT = batch_BT1[:, :-1], batch_BT1[:, 1:]
    if model_cfg.logits_chunk:
        x_BTD, aux = models.forward_features(model_cfg, params, inputs_BT)
        embedding = params["embedder"]["embedding"]
        ce = chunked_cross_entropy(model_cfg, embedding, x_BTD, targets_BT, row_weights_B)
    else:
        logits_BTV, aux = models.forward(model_cfg, params, inputs_BT)
        ce = cross_entropy(logits_BTV, targets_BT, row_weights_B)
    total = ce + aux.get("moe_aux_loss", 0.0)
    return total, (ce, aux)


def microbatched_value_and_grad(model_cfg, params, batch_BT1: jax.Array, microbatches: int):
    """`loss_fn`'s ((total, (ce, aux)), grads) for the batch as the mean over `microbatches`
    equal microbatches, run one after another (`lax.scan`), so activations are held for one
    microbatch at a time.

    Cross-entropy is a mean over equally many tokens per microbatch, so the mean over
    microbatches is the full batch's loss and its gradient the full batch's gradient. MoE
    routing, capacity and dropping are per batch row (moe.py), hence unchanged too, and so
    are router_z_loss, expert_load and dropped_fraction (token means); load_balance_loss
    (E * sum_e f_e * P_e, a product of batch means) becomes the mean of each microbatch's
    own balance loss, as with gradient accumulation elsewhere (it then also balances within
    each microbatch), so with MoE `total_loss` differs slightly from one big batch, and so
    does the gradient of every parameter the balance loss reaches through the router's
    inputs (all below the last MoE layer: a few percent at init for tiny_moe; with
    model.load_balance_weight = 0 the gradients are the big batch's).
    """
    grad_fn = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)
    B = batch_BT1.shape[0]
    if B % microbatches:
        raise ValueError(f"batch of {B} rows does not split into {microbatches} microbatches")
    # Microbatch j takes rows j, j + n, j + 2n, ...: the batch is split over the data axes
    # in contiguous blocks, so each device already holds its share of every microbatch and
    # no row moves between devices.
    batch_NBT1 = batch_BT1.reshape(B // microbatches, microbatches, -1).swapaxes(0, 1)
    batch_NBT1 = constrain(batch_NBT1, (None, "batch", None))

    def mean_over_microbatches(params, batch_NBT1):
        shapes = jax.eval_shape(lambda p, b: grad_fn(model_cfg, p, b), params, batch_NBT1[0])

        def accumulate(acc, microbatch_BT1):
            out = grad_fn(model_cfg, params, microbatch_BT1)
            return jax.tree.map(jnp.add, acc, out), None

        zeros = _carry_like(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                            batch_NBT1)  # fmt: skip
        summed, _ = jax.lax.scan(accumulate, zeros, batch_NBT1)
        return jax.tree.map(lambda x: x / microbatches, summed)

    # Data parallel, the parameters are whole on every replica, and XLA (CPU and TPU alike)
    # all-reduces the gradient once per microbatch: 4 microbatches sent 3.3x the bytes of 1
    # (XLA:TPU, the 2B config with 2 layers, 16 replicas on v5p-16). Each replica instead sums
    # its own rows' gradients over all microbatches (`shard_map`, manual over "data") and the
    # replicas' means meet once: 5.31 -> 1.62 GiB per chip and step there. Only on a purely
    # data-parallel mesh: beside fsdp (data 4 x fsdp 8) XLA:TPU then compiled the FSDP part
    # worse (21.9 -> 23.2 GiB, a third more temporaries), and beside two split axes XLA's
    # SPMD partitioner aborts (jaxlib 0.10.2). Dense models only: an MoE's load-balance loss
    # (a product of batch means) would become each replica's own.
    mesh = jax.sharding.get_abstract_mesh()
    replicas = 1 if mesh.empty else mesh.shape.get("data", 1)
    pure = replicas > 1 and all(mesh.shape.get(a, 1) == 1 for a in ("fsdp", "tensor", "expert"))
    if not pure or model_cfg.num_moe_layers or (B // microbatches) % replicas:
        return mean_over_microbatches(params, batch_NBT1)

    def per_replica(params, batch_NBT1):
        # Varying per replica, so each replica's gradient stays its own until the mean.
        params = _vary(params, ("data",))
        return jax.lax.pmean(mean_over_microbatches(params, batch_NBT1), "data")

    return jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(P(), P(None, "data")),
        out_specs=P(),
        axis_names=frozenset({"data"}),
    )(params, batch_NBT1)


def init_train_state(model_cfg, optimizer: optax.GradientTransformation, rng) -> TrainState:
    params = models.init_params(model_cfg, rng)
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))


def make_train_step(
    model_cfg,
    optimizer: optax.GradientTransformation,
    learning_rate,
    mesh: jax.sharding.Mesh | None = None,
    microbatches: int = 1,
):
    """(state, batch [B, T+1] int32) -> (new state, metrics dict of scalars).

    With `microbatches` > 1 the gradient is accumulated over that many microbatches of
    B / microbatches rows (`microbatched_value_and_grad`) and the optimizer steps once: one
    inner step, whatever the count; metrics are the means over the microbatches.

    The optimizer's update receives `step=state.step`, so the lr follows the schedule at the
    learner's step however old the optimizer state is (a fresh one may be ramped:
    `train.fresh_warmup_steps`); "learning_rate" logs `learning_rate(state.step,
    state.opt_state)`, the lr of that update (`optimizer.state_learning_rate`). With `mesh`,
    jit the step with shardings on that mesh: the model then also shards its activations by
    the rules table (MoE expert parallelism needs this).
    """
    optimizer = optax.with_extra_args_support(optimizer)  # plain optax ignores `step`

    def train_step(state: TrainState, batch_BT1: jax.Array):
        with constraint_mesh(mesh):
            if microbatches > 1:
                out = microbatched_value_and_grad(model_cfg, state.params, batch_BT1, microbatches)
            else:
                out = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)(
                    model_cfg, state.params, batch_BT1
                )
            (total, (ce, aux)), grads = out
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params, step=state.step)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": ce,
            "total_loss": total,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": learning_rate(state.step, state.opt_state),
        }
        for k, v in aux.items():
            metrics[k] = v
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def make_eval_step(model_cfg, mesh: jax.sharding.Mesh | None = None):
    """(params, batch [B, T+1], row weights [B]) -> the batch's cross-entropy, its rows
    weighted (a mean over tokens, rows of weight 0 left out). `mesh` as in train."""

    def eval_step(params, batch_BT1, row_weights_B):
        with constraint_mesh(mesh):
            return loss_fn(model_cfg, params, batch_BT1, row_weights_B)[1][0]

    return eval_step
