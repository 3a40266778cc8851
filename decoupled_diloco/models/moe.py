"""Mixture-of-experts feed-forward: top-k routing, expert compute (capacity or dropless), losses.

Shape legend as in layers.py, plus E experts, C expert capacity (buffer slots per expert and
group), k = experts_per_token (top-k choices of one token) and M = T * k (assignments of a row).

Grouping: each batch row is one routing group of T tokens, so capacity, token dropping, the
dispatch/combine masks ([B, T, E, C]) and the dropless sort are per row. This keeps the masks
O(B * T * E * C) instead of O((B*T)^2) and never moves tokens across the data-parallel axes.

Gates (`ModelConfig.moe_gate`): "chosen_softmax" renormalises over the k chosen logits (the
issue's rule; with k = 1 the gate is always 1 and the router learns nothing from the LM loss,
so validation rejects that pair); "full_softmax" (Switch) uses the full-softmax probability of
each chosen expert, not renormalised.

Capacity path (capacity_factor > 0), GShard/Switch style with one-hot masks and einsums.
Within a group, assignments claim buffer slots in position order, each token's k choices
(best first) before the next token's, so whether a token is dropped depends on the tokens
before it only: the loss stays causal. (GShard's order, every token's first choice before
any token's second, let a later token's first choice take the slot an earlier token's
second choice needed, changing the earlier position's output: future tokens leaked into
past logits.) Assignments beyond capacity are dropped;
their gate weight is not renormalised, so a fully dropped token passes through the residual
only. Under expert parallelism the dispatched [B, E, C, D] tensors are pinned to experts on
the `expert` mesh axis and rows on the data axes (`sharding.constrain`), so XLA moves tokens
to their expert's devices (all-to-all) and each device computes only its own experts.

Dropless path (capacity_factor <= 0): per row, the T * k (token, expert) assignments are
sorted by expert and the GeGLU matmuls are `jax.lax.ragged_dot_general` grouped matmuls with
per-row group sizes [B, E], then unsorted and combined with the gates: O(T * k) expert FLOPs
on TPU/GPU, where ragged dot is a native instruction. Two caveats, both of jax 0.10.2:
on CPU ragged dot lowers to a masked dense dot (E times the FLOPs; fine for tests), and its
SPMD rule has no expert-sharded form, so under expert parallelism the dropless path gathers
the expert weights (FSDP-like) instead of moving tokens; expert-parallel dropless would need a
ragged all-to-all inside shard_map.
"""

import fractions
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from decoupled_diloco.models.config import ModelConfig
from decoupled_diloco.models.layers import FeedForward, fan_in_init, param
from decoupled_diloco.sharding import constrain

# Name of the routed experts' matmul outputs, which remat "dots" keeps (transformer.py): its
# policy keeps dots without batch dimensions, and these are batched over E (capacity
# path) or grouped (`ragged_dot_general`, dropless), so they would be recomputed.
EXPERT_MATMUL = "expert_matmul"

# Logical axes of expert-major activations: rows on the data axes, experts on `expert`.
_DISPATCHED = ("dispatch_batch", "expert", None, None)
_DISPATCHED_HIDDEN = ("dispatch_batch", "expert", None, "mlp")
_TOKEN_MAJOR = ("batch", None, None, None)


def expert_capacity(group_size: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert and group: ceil(cf * tokens * k / E), at most tokens; <= 0 -> all."""
    if capacity_factor <= 0:
        return group_size
    # In exact arithmetic: in floats 1.1 * 100 / 10 is 11.000000000000002, whose ceil gave
    # every expert a slot more than the rule (capacity_factor as the decimal it was written).
    exact = fractions.Fraction(repr(float(capacity_factor))) * group_size * k / num_experts
    return min(group_size, math.ceil(exact))


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis (ties to the lower index), built on a sort.

    XLA's SPMD partitioner replicates the TopK custom call (all-gathering a batch-sharded
    operand); a sort along the last axis stays sharded over the leading axes.
    """
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    _, order = jax.lax.sort((-x, iota), dimension=x.ndim - 1, num_keys=2)
    indices = order[..., :k]
    return jnp.take_along_axis(x, indices, axis=-1), indices


def route_top_k(
    router_logits_BTE: jax.Array, k: int, gate: str = "chosen_softmax"
) -> tuple[jax.Array, jax.Array]:
    """Top-k experts per token and their gates under rule `gate` (see the module doc).

    Returns gates_BTk (float32; "chosen_softmax": sums to 1 over k, "full_softmax": the
    full-softmax probabilities of the chosen experts) and experts_BTk (int32, best first).
    """
    if gate == "full_softmax":
        return top_k(jax.nn.softmax(router_logits_BTE, axis=-1), k)
    if gate != "chosen_softmax":
        raise ValueError(f"unknown MoE gate rule {gate!r}")
    top_logits_BTk, experts_BTk = top_k(router_logits_BTE, k)
    return jax.nn.softmax(top_logits_BTk, axis=-1), experts_BTk


def dispatch_and_combine(
    experts_BTk: jax.Array,
    gates_BTk: jax.Array,
    num_experts: int,
    capacity: int,
    claimed_BE: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One-hot routing masks for a capacity of `capacity` slots per expert and batch row.

    Returns dispatch_BTEC (float32 0/1: token t goes to slot c of expert e), combine_BTEC
    (dispatch weighted by the gates) and kept_BTk (bool: the assignment got a slot).
    `claimed_BE`: the slots earlier tokens of the rows' group already claimed (decoding, one
    call per token: the group's buffers carry on, so a token is dropped exactly when the
    whole group in one call would drop it); the buffers then hold this call's tokens only,
    C = min(T, capacity) (a token's k choices are distinct experts).
    """
    B, T, k = experts_BTk.shape
    choice_BTkE = jax.nn.one_hot(experts_BTk, num_experts, dtype=jnp.int32)
    # Position-major order (the module doc): a token's slots depend on earlier tokens only.
    choice_BXE = choice_BTkE.reshape(B, T * k, num_experts)
    slot_BXE = jnp.cumsum(choice_BXE, axis=1) - 1
    slot_BTkE = slot_BXE.reshape(B, T, k, num_experts)
    slot_BTk = jnp.sum(slot_BTkE * choice_BTkE, axis=-1)
    if claimed_BE is None:
        kept_BTk = slot_BTk < capacity
    else:
        before_BTk = jnp.take_along_axis(claimed_BE[:, None, :], experts_BTk, axis=-1)
        kept_BTk = before_BTk + slot_BTk < capacity
        capacity = min(T, capacity)
    slot_onehot_BTkC = jax.nn.one_hot(slot_BTk, capacity) * kept_BTk[..., None]
    choice_f_BTkE = choice_BTkE.astype(jnp.float32)
    dispatch_BTEC = jnp.einsum("BTkE,BTkC->BTEC", choice_f_BTkE, slot_onehot_BTkC)
    combine_BTEC = jnp.einsum("BTk,BTkE,BTkC->BTEC", gates_BTk, choice_f_BTkE, slot_onehot_BTkC)
    return dispatch_BTEC, combine_BTEC, kept_BTk


def capacity_experts(
    x_BTD: jax.Array, dispatch_BTEC: jax.Array, combine_BTEC: jax.Array, gate_EDF, up_EDF, down_EFD
) -> jax.Array:
    """Routed GeGLU experts through capacity buffers: dispatch, per-expert matmuls, combine."""
    dtype = x_BTD.dtype
    x_BECD = jnp.einsum("BTEC,BTD->BECD", dispatch_BTEC.astype(dtype), x_BTD)
    x_BECD = constrain(x_BECD, _DISPATCHED)  # token-major -> expert-major: all-to-all
    gate_BECF = checkpoint_name(jnp.einsum("BECD,EDF->BECF", x_BECD, gate_EDF), EXPERT_MATMUL)
    up_BECF = checkpoint_name(jnp.einsum("BECD,EDF->BECF", x_BECD, up_EDF), EXPERT_MATMUL)
    hidden_BECF = constrain(jax.nn.gelu(gate_BECF, approximate=True) * up_BECF, _DISPATCHED_HIDDEN)
    y_BECD = jnp.einsum("BECF,EFD->BECD", hidden_BECF, down_EFD)
    y_BECD = constrain(checkpoint_name(y_BECD, EXPERT_MATMUL), _DISPATCHED)
    y_BECD = constrain(y_BECD, _TOKEN_MAJOR)  # expert-major -> token-major: all-to-all back
    return jnp.einsum("BTEC,BECD->BTD", combine_BTEC.astype(dtype), y_BECD)


# Grouped matmul [B, M, D] x [E, D, F] -> [B, M, F]: rows of each batch row are ragged over
# the E experts (group sizes [B, E]), B is an outer non-contracting dim.
_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([2], [1]), ([], [])),
    lhs_ragged_dimensions=[1],
    rhs_group_dimensions=[0],
)


def _grouped_matmul(
    x_BMI: jax.Array, w_EIO: jax.Array, group_sizes_BE: jax.Array, mlp_dim: int
) -> jax.Array:
    """[B, M, I] x [E, I, O] -> [B, M, O], row m of batch row b through its group's expert.

    `mlp_dim` (1 or 2) is the dim of w_EIO holding the expert hidden width (tensor-sharded).
    """
    # No expert-sharded ragged dot (module doc): whole experts on every token shard, rows
    # stay where their tokens are.
    w_axes = [None, None, None]
    w_axes[mlp_dim] = "mlp"
    w_EIO = constrain(w_EIO, tuple(w_axes))
    y_BMO = jax.lax.ragged_dot_general(
        x_BMI, w_EIO, group_sizes_BE, ragged_dot_dimension_numbers=_GROUPED
    )
    return constrain(
        checkpoint_name(y_BMO, EXPERT_MATMUL), ("batch", None, "mlp" if mlp_dim == 2 else None)
    )


def dropless_experts(
    x_BTD: jax.Array, gates_BTk: jax.Array, experts_BTk: jax.Array, gate_EDF, up_EDF, down_EFD
) -> jax.Array:
    """Routed GeGLU experts without capacity: sort assignments by expert, grouped matmuls."""
    B, T, k = experts_BTk.shape
    num_experts = gate_EDF.shape[0]
    experts_BM = experts_BTk.reshape(B, T * k)  # assignment m = t * k + choice
    order_BM = jnp.argsort(experts_BM, axis=-1, stable=True)
    x_BMD = jnp.take_along_axis(x_BTD, (order_BM // k)[..., None], axis=1)
    group_sizes_BE = jnp.sum(jax.nn.one_hot(experts_BM, num_experts, dtype=jnp.int32), axis=1)
    gate_BMF = _grouped_matmul(x_BMD, gate_EDF, group_sizes_BE, mlp_dim=2)
    up_BMF = _grouped_matmul(x_BMD, up_EDF, group_sizes_BE, mlp_dim=2)
    hidden_BMF = jax.nn.gelu(gate_BMF, approximate=True) * up_BMF
    y_sorted_BMD = _grouped_matmul(hidden_BMF, down_EFD, group_sizes_BE, mlp_dim=1)
    unsort_BM = jnp.argsort(order_BM, axis=-1)  # inverse permutation
    y_BTkD = jnp.take_along_axis(y_sorted_BMD, unsort_BM[..., None], axis=1).reshape(B, T, k, -1)
    return jnp.einsum("BTk,BTkD->BTD", gates_BTk.astype(x_BTD.dtype), y_BTkD)


def router_statistics(
    router_logits_BTE: jax.Array, experts_BTk: jax.Array, kept_BTk: jax.Array
) -> dict[str, jax.Array]:
    """Router losses and load statistics of one MoE layer (all float32).

    load_balance_loss: Switch-style E * sum_e f_e * P_e, f_e = fraction of the top-k
      assignments routed to e (before dropping), P_e = mean router probability of e; it is 1
      under uniform routing and grows as routing concentrates.
    router_z_loss: mean over tokens of logsumexp(logits)^2; keeps router logits small.
    expert_load [E]: f_e (sums to 1). dropped_fraction: share of assignments without a slot.
    """
    num_experts = router_logits_BTE.shape[-1]
    probs_BTE = jax.nn.softmax(router_logits_BTE, axis=-1)
    choice_BTkE = jax.nn.one_hot(experts_BTk, num_experts, dtype=jnp.float32)
    load_E = jnp.mean(jnp.sum(choice_BTkE, axis=2), axis=(0, 1)) / experts_BTk.shape[-1]
    mean_prob_E = jnp.mean(probs_BTE, axis=(0, 1))
    log_z_BT = jax.nn.logsumexp(router_logits_BTE, axis=-1)
    return {
        "load_balance_loss": num_experts * jnp.sum(load_E * mean_prob_E),
        "router_z_loss": jnp.mean(log_z_BT**2),
        "expert_load": load_E,
        "dropped_fraction": jnp.mean(jnp.logical_not(kept_BTk).astype(jnp.float32)),
    }


class MoE(nn.Module):
    """Routed GeGLU experts (+ optional shared expert). Returns (y_BTD, router_statistics).

    Params: "router" [D, E] (float32 logits), experts stacked on a leading E axis: "gate",
    "up" [E, D, F], "down" [E, F, D] with F = expert_hidden; optional "shared" FeedForward.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTD: jax.Array, claimed_BE: jax.Array | None = None, group: int = 0):
        """`claimed_BE`, `group` (decoding a capacity model): the expert slots the row's
        earlier tokens claimed, in buffers sized for a group of `group` tokens (training's
        row); returns (y_BTD, stats, the claimed slots after this call's tokens)."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        D, E, F, k = cfg.d_model, cfg.num_experts, cfg.expert_hidden, cfg.experts_per_token
        router = param(self, "router", ("embed", None), (D, E), fan_in_init(0))
        expert_in_init = fan_in_init(in_axis=1, batch_axis=0)
        gate = param(self, "gate", ("expert", "embed", "mlp"), (E, D, F), expert_in_init)
        up = param(self, "up", ("expert", "embed", "mlp"), (E, D, F), expert_in_init)
        down = param(self, "down", ("expert", "mlp", "embed"), (E, F, D), expert_in_init)
        weights = (gate.astype(dtype), up.astype(dtype), down.astype(dtype))

        # Routing decisions are precision sensitive: always float32, also on accelerators,
        # whose default matmul precision would take one bfloat16 pass (TPU) or TF32 (GPU).
        router_logits_BTE = jnp.einsum(
            "BTD,DE->BTE", x_BTD.astype(jnp.float32), router.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )  # fmt: skip
        gates_BTk, experts_BTk = route_top_k(router_logits_BTE, k, cfg.moe_gate)

        x_BTD = x_BTD.astype(dtype)
        if cfg.capacity_factor > 0:
            capacity = expert_capacity(group or x_BTD.shape[1], k, E, cfg.capacity_factor)
            dispatch_BTEC, combine_BTEC, kept_BTk = dispatch_and_combine(
                experts_BTk, gates_BTk, E, capacity, claimed_BE
            )
            y_BTD = capacity_experts(x_BTD, dispatch_BTEC, combine_BTEC, *weights)
        else:
            kept_BTk = jnp.ones(experts_BTk.shape, bool)
            y_BTD = dropless_experts(x_BTD, gates_BTk, experts_BTk, *weights)
        if cfg.shared_expert:
            y_BTD = y_BTD + FeedForward(cfg, F, name="shared")(x_BTD)
        stats = router_statistics(router_logits_BTE, experts_BTk, kept_BTk)
        if claimed_BE is None:
            return y_BTD, stats
        choice_BE = jnp.sum(jax.nn.one_hot(experts_BTk, E, dtype=jnp.int32), axis=(1, 2))
        return y_BTD, stats, claimed_BE + choice_BE
